"""pipeline/dashboard: the report of a run directory with zero shards, one shard, and a failed
shard (built by the real writers in tests/dashboard_runs.py), the CLI, the live server (run
directory only), and the Ray metrics with their Grafana dashboard."""
import http.client
import json
import re
import threading
from pathlib import Path

import pytest

from pipeline.dashboard import figures, render_report, timeline, write_report
from pipeline.dashboard.__main__ import main as dashboard_main
from pipeline.dashboard.load import load_run, version_token
from pipeline.dashboard.serve import make_server, resolve_inside
from pipeline.data.manifest import read_manifest, write_manifest
from pipeline.cluster.metrics import METRICS, RunMetrics, metric_points
from pipeline.spec_decode.cost import CostModel
from tests.dashboard_runs import FAILURE, make_runs

GRAFANA = Path(__file__).resolve().parents[1] / "infra" / "grafana" / "specbatch.json"
CHARTS = ("gamma-histogram", "throughput", "gamma", "plan", "acceptance", "sources", "cost", "utilization", "commits")


@pytest.fixture(scope="module")
def runs():
    return make_runs()


def chart_ids(page: str) -> set[str]:
    return set(re.findall(r'<div class="chart" id="chart-([\w-]+)"', page))


def test_report_is_self_contained(runs):
    page = write_report(runs["one"]).read_text()
    assert not re.search(r"<script[^>]*\bsrc=", page) and "<link" not in page
    assert "cdn.plot.ly" not in page.split("</head>")[1]
    assert page.count("Plotly.newPlot") == 1                 # one boot loop draws every chart
    assert len(page) > 1_000_000                             # plotly.js is inlined


def test_one_shard_shows_every_chart_with_its_measurements(runs):
    view = load_run(runs["one"])
    page = render_report(runs["one"])
    assert chart_ids(page) == set(CHARTS)
    assert '<span class="status s-finished">finished</span>' in page
    assert "10 / 10" in page                                  # rows done / planned
    assert 'id="no-problem-shards"' in page
    rows = view.rows
    assert {r["task"] for r in rows} == {"summarize", "qa"}
    assert all(r["cost_samples"] and r["finished_at"] >= r["started_at"] for r in rows)

    through = figures.throughput_figure(rows)
    assert [t.name for t in through.data] == ["measured tokens/s", "predicted at gamma 0"]
    assert list(through.data[1].y) == [r["predicted_goodput_gamma0"] for r in rows]
    gamma = figures.gamma_figure(rows)
    hover = " ".join(str(c) for t in gamma.data for c in t.customdata)
    assert "auto:" in hover                                   # the policy's reason rides along
    cost = timeline.cost_figure(rows)
    names = [t.name for t in cost.data]
    assert names[0] == "measured (cpu)" and len(cost.data[0].x) == sum(len(r["cost_samples"]) for r in rows)
    assert any(n.startswith("policy's model (cpu)") for n in names)    # the fitted model's line
    assert all(CostModel.from_dict(json.loads(r["cost_model"])).knee >= 0 for r in rows)
    by_source = figures.source_figure(rows)
    drafted = {t.name: sum(t.y) for t in by_source.data}
    pooled = sum(figures.source_counts(r, "drafted_by_source").get("mtp", 0) for r in rows)
    assert drafted["mtp drafted"] == pooled > 0 and drafted["mtp accepted"] <= pooled


def test_zero_shards_is_a_readable_page(runs):
    page = render_report(runs["empty"])
    assert chart_ids(page) == set()
    for name in CHARTS:
        assert f'id="empty-{name}"' in page
    assert '<span class="status s-running">running</span>' in page and "0 / 10" in page


def test_failed_shard_is_listed_with_its_attempts_and_error(runs):
    page = render_report(runs["failed"])
    table = page[page.index('<table id="problem-shards">'):]
    table = table[:table.index("</table>")]
    cells = re.findall(r"<tr><td>1</td><td>(\w+)</td><td>committed</td><td>(\d+)</td><td>(\d+)</td>"
                       r"<td>3</td><td>([^<]*)</td>", table)
    assert sorted(c[0] for c in cells) == ["qa", "summarize"]
    assert all(c[1] == c[2] for c in cells)                   # every row of it has the error
    assert all(FAILURE in c[3] for c in cells)
    assert "none (failed)" in json.dumps(figures.gamma_histogram(load_run(runs["failed"]).rows).to_dict())
    assert {"throughput", "gamma", "commits"} <= chart_ids(page)


def test_missing_or_broken_files_are_noted_not_raised(tmp_path):
    (tmp_path / "stats").mkdir()
    (tmp_path / "stats" / "shard-00000.parquet").write_bytes(b"not parquet")
    page = render_report(tmp_path)
    assert "no manifest.json yet" in page and "stats/:" in page


def test_cli_writes_the_report(runs, tmp_path, capsys):
    (runs["failed"] / "report.html").unlink(missing_ok=True)
    assert dashboard_main([str(runs["failed"])]) == 0
    assert (runs["failed"] / "report.html").stat().st_size > 1_000_000
    assert dashboard_main([str(tmp_path / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


def _get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.request("GET", path)                 # sent verbatim: no client-side normalisation
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, body


@pytest.fixture
def served(runs, tmp_path):
    import shutil

    run_dir = tmp_path / "live"
    shutil.copytree(runs["one"], run_dir)
    (tmp_path / "secret.txt").write_text("outside the run directory")
    (run_dir / "escape").symlink_to(tmp_path / "secret.txt")
    server = make_server(run_dir, port=0)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield run_dir, server.server_address[1]
    server.shutdown()
    server.server_close()


def test_serve_refreshes_while_running(served):
    run_dir, port = served
    manifest = read_manifest(run_dir)
    manifest["status"] = "running"
    write_manifest(run_dir, manifest)
    status, page = _get(port, "/")
    assert status == 200 and b'fetch("/_version"' in page      # the live page polls ...
    status, token = _get(port, "/_version")
    assert token.decode() == version_token(run_dir)
    manifest["status"] = "finished"
    manifest["totals"]["generated_tokens"] = 123456
    write_manifest(run_dir, manifest)
    assert _get(port, "/_version")[1] != token                 # ... sees the change ...
    status, page = _get(port, "/report.html")
    assert b"123,456" in page and b"/_version" not in page      # ... and a finished run stops
    assert json.loads(_get(port, "/manifest.json")[1])["status"] == "finished"


@pytest.mark.parametrize("path", ["/../secret.txt", "/%2e%2e/secret.txt", "/outputs/../../secret.txt",
                                  "//etc/passwd", "/..%2f..%2f..%2fetc%2fpasswd", "/escape", "/outputs",
                                  "/%00"])
def test_serve_stays_inside_the_run_directory(served, path):
    status, body = _get(served[1], path)
    assert status == 404 and b"outside" not in body and b"root:" not in body


def test_resolve_inside(tmp_path):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "f.txt").write_text("x")
    (tmp_path / "g.txt").write_text("y")
    assert resolve_inside(tmp_path, "/a/f.txt") == (tmp_path / "a" / "f.txt").resolve()
    assert resolve_inside(tmp_path / "a", "/../a/f.txt") == (tmp_path / "a" / "f.txt").resolve()
    assert resolve_inside(tmp_path / "a", "/../g.txt") is None
    assert resolve_inside(tmp_path / "a", "/%2E%2E/g.txt") is None


def test_metric_points_from_stats_rows(runs):
    rows = load_run(runs["failed"]).rows
    good = [r for r in rows if r["shard_id"] == 0]
    points = metric_points(good, {"tokens_per_s": 12.5})
    by_name = {}
    for name, value, tags in points:
        by_name.setdefault(name, []).append((value, tags))
    assert by_name["specbatch_gamma"] == [(float(r["gamma"]), {"task": r["task"]}) for r in good]
    assert by_name["specbatch_run_tokens_per_s"] == [(12.5, {})]
    assert by_name["specbatch_shards"] == [(1.0, {"status": "committed"})]
    depths = {t["depth"] for _, t in by_name["specbatch_acceptance_by_depth"]}
    assert depths <= {"1", "2"} and depths
    failed = metric_points([r for r in rows if r["shard_id"] == 1])
    assert ("specbatch_shards", 1.0, {"status": "failed"}) in failed
    assert not any(n == "specbatch_gamma" for n, _, _ in failed)      # nothing measured: no gauge


class FakeMetric:
    def __init__(self, kind, name, description, tag_keys):
        self.kind, self.name, self.tag_keys, self.calls = kind, name, tag_keys, []

    def set(self, value, tags):
        assert set(tags) == set(self.tag_keys)
        self.calls.append(("set", value, tags))

    def inc(self, value, tags):
        assert set(tags) == set(self.tag_keys) and value > 0
        self.calls.append(("inc", value, tags))


def test_run_metrics_tag_the_run_and_never_raise(runs):
    rows = load_run(runs["one"]).rows
    made = {}
    metrics = RunMetrics("run-7", lambda *a: made.setdefault(a[1], FakeMetric(*a)))
    metrics.observe(rows, {"tokens_per_s": 3.0})
    assert made["specbatch_generated_tokens"].calls[0][2]["run"] == "run-7"
    assert sum(c[1] for c in made["specbatch_generated_tokens"].calls) == sum(r["num_generated_tokens"] for r in rows)
    broken = RunMetrics("run-7", lambda *a: 1 / 0)
    broken.observe(rows)                      # reported once, the run goes on
    assert broken.broken


def test_real_ray_metrics_accept_our_names_and_tags(runs):
    pytest.importorskip("ray")
    metrics = RunMetrics("run-real")
    metrics.observe(load_run(runs["one"]).rows, {"tokens_per_s": 1.0})
    assert not metrics.broken and set(metrics.metrics) <= set(METRICS)


def test_grafana_dashboard_queries_the_exported_metrics():
    board = json.loads(GRAFANA.read_text())
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    used = set(re.findall(r"\bray_specbatch_\w+", " ".join(exprs)))
    exported = {f"ray_{n}" + ("_total" if kind == "counter" else "")
                for n, (kind, _, _) in METRICS.items()}
    assert used <= exported, used - exported
    assert {n[len("ray_"):].removesuffix("_total") for n in used} == set(METRICS)   # all shown


def test_recipe_dashboard_hook_never_fails_the_run(runs, tmp_path, capsys):
    from pipeline.recipes import write_dashboard

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "manifest.json").write_text("{")
    write_dashboard(broken)
    assert "could not write the dashboard" in capsys.readouterr().err
    write_dashboard(tmp_path / "never-opened")           # no run there (e.g. a config error): nothing
    assert not (tmp_path / "never-opened").exists() and capsys.readouterr().err == ""
    (runs["one"] / "report.html").unlink(missing_ok=True)
    write_dashboard(runs["one"])
    assert (runs["one"] / "report.html").is_file()


def test_run_directory_given_as_a_uri(runs, tmp_path):
    """output.dir may be a URI (pipeline.data.storage); file:// takes the same code path as s3://."""
    import shutil

    run_dir = tmp_path / "uri-run"
    shutil.copytree(runs["failed"], run_dir)
    (run_dir / "report.html").unlink(missing_ok=True)
    written = write_report(run_dir.as_uri())
    assert Path(written) == run_dir / "report.html" and 'id="problem-shards"' in Path(written).read_text()
    assert len(load_run(run_dir.as_uri()).rows) == len(load_run(run_dir).rows) == 4


def test_the_cluster_layer_never_imports_the_dashboard():
    """The dashboard is the layer above the driver: the `generate` recipe calls both."""
    cluster = Path(__file__).resolve().parents[1] / "pipeline" / "cluster"
    assert not [p.name for p in cluster.glob("*.py") if "pipeline.dashboard" in p.read_text()]
