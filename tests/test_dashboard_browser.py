"""The report in a real browser: headless Chromium (Debian's `chromium`; .ci/run installs it,
this test installs nothing and skips without it, but fails under CI=true) loads report.html from disk with the network
off, and the live DOM must show every chart drawn by plotly and no JavaScript error, for a run
with zero shards, one shard, and a failed shard. Screenshots are kept in the test's tmp folder
(and in $DASHBOARD_SCREENSHOTS when set) for a person to look at."""
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from pipeline.dashboard import write_report
from tests.dashboard_runs import make_runs

CHROMIUM = next((p for p in ("/usr/bin/chromium", shutil.which("chromium") or "") if p and os.path.exists(p)), None)
IN_CI = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
# Without chromium these skip, except under CI=true, where they must run: there they fail.
pytestmark = pytest.mark.skipif(CHROMIUM is None and not IN_CI,
                                reason="chromium is not installed (apt-get install chromium)")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         "--disable-dev-shm-usage", "--virtual-time-budget=10000"]


def chromium(tmp_path: Path, *args: str) -> str:
    if CHROMIUM is None:
        pytest.fail("CI=true but chromium is not installed: the browser tests must run in CI "
                    "(.ci/run installs it with apt-get)")
    profile = tmp_path / "profile"
    result = subprocess.run([CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout


def live_dom(tmp_path: Path, page: Path) -> str:
    return chromium(tmp_path, "--dump-dom", page.as_uri())


@pytest.fixture(scope="module")
def runs():
    return make_runs()


@pytest.mark.parametrize("name", ["empty", "one", "failed"])
def test_charts_render_without_javascript_errors(runs, tmp_path, name):
    page = write_report(runs[name])
    source = page.read_text()
    charts = len(re.findall(r'<div class="chart" id=', source))
    dom = live_dom(tmp_path, page)
    assert '<li class="js-error"' not in dom and 'data-js-errors="yes"' not in dom
    assert f'data-charts-rendered="{charts}"' in dom
    drawn = re.findall(r'<div class="chart[^"]*js-plotly-plot[^"]*" id="chart-', dom)
    assert len(drawn) == charts                               # plotly took every chart div ...
    assert len(re.findall(r'class="main-svg"', dom)) >= charts    # ... and drew SVG into it
    if name == "one":
        assert charts == 9 and "measured tokens/s" in dom and "policy's model" in dom
    if name == "empty":
        assert charts == 0 and "no shard has finished yet" in dom
    if name == "failed":
        assert "actor died 3 times" in dom

    shot = tmp_path / f"report-{name}.png"
    chromium(tmp_path, "--window-size=1400,2400", f"--screenshot={shot}", page.as_uri())
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    if os.environ.get("DASHBOARD_SCREENSHOTS"):
        Path(os.environ["DASHBOARD_SCREENSHOTS"]).mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, Path(os.environ["DASHBOARD_SCREENSHOTS"]) / shot.name)


def test_a_javascript_error_would_be_seen(runs, tmp_path):
    """The error hook the checks above rely on does catch errors (so their silence means none)."""
    page = tmp_path / "broken.html"
    source = write_report(runs["one"]).read_text()
    page.write_text(source.replace("</body>", "<script>noSuchFunction();</script></body>"))
    dom = live_dom(tmp_path, page)
    assert '<li class="js-error"' in dom and 'data-js-errors="yes"' in dom and "noSuchFunction" in dom
