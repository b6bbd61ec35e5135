"""An end-to-end Ray run with spec.gamma=auto: the stats each shard commits agree with the
steps that ran, as the output rows count them. With gamma_max 1 every drafted token is one
row-step at gamma 1, so a_1 is exactly accepted / drafted over the shard's rows, and the
tokens emitted by verify steps (mean acceptance length x row-steps) are the rows' generated
tokens past the first (the prefill's), plus at most one cut at a stop per row."""
import json

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.config import RunConfig
from pipeline.data.stats_files import read_stats
from tests.tiny_models import tiny_checkpoint

ray = pytest.importorskip("ray")
ROWS, PER_SHARD = 24, 8


def test_auto_run_stats_match_the_steps_that_ran(ray_session, tmp_path):
    from pipeline.cluster.driver import run_generation

    model = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, draftable=0.1)
    pq.write_table(pa.table({"prompt": [f"the quick brown fox {i} " * (1 + i % 3) for i in range(ROWS)]}),
                   tmp_path / "d.parquet")
    raw = {"model": {"path": model, "device": "cpu"}, "data": {"path": str(tmp_path / "d.parquet")},
           "output": {"dir": str(tmp_path / "run")}, "sampling": {"max_new_tokens": 16},
           "spec": {"gamma": "auto", "gamma_max": 1}, "shards": {"rows_per_shard": PER_SHARD},
           "engine": {"max_batch_size": 8}, "cluster": {"num_actors": 1, "cpus_per_actor": 1}}
    manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False)
    assert manifest["status"] == "finished"
    out = ds.dataset(str(tmp_path / "run" / "outputs"), format="parquet").to_table()
    stats = read_stats(tmp_path / "run").to_pylist()
    assert sorted(s["shard_id"] for s in stats) == [0, 1, 2]
    drafted_anywhere = 0
    for s in stats:
        rows = out.filter(pc.is_in(out["id"], pa.array(range(s["shard_id"] * PER_SHARD,
                                                              (s["shard_id"] + 1) * PER_SHARD))))
        assert rows.num_rows == s["num_rows"] == PER_SHARD and rows["error"].null_count == PER_SHARD
        assert s["gamma_reason"].startswith("auto") and s["gamma"] in (0, 1)
        generated = sum(rows["num_generated_tokens"].to_pylist())
        drafted = sum(rows["num_drafted_tokens"].to_pylist())
        accepted = sum(rows["num_accepted_tokens"].to_pylist())
        assert s["num_generated_tokens"] == generated
        drafted_anywhere += drafted
        if drafted:
            assert s["acceptance_by_depth"][0] == pytest.approx(accepted / drafted)
        mal = s["mean_acceptance_length"]
        if accepted:                           # row-steps = accepted / (mal - 1); emitted = mal x that
            emitted = mal * accepted / (mal - 1)
            assert generated - PER_SHARD - 1e-6 <= emitted <= generated - PER_SHARD + PER_SHARD + 1e-6
    assert drafted_anywhere > 0                # auto speculated (at least while calibrating)
    stored = json.loads((tmp_path / "run" / "manifest.json").read_text())
    assert stored["totals"]["generated_tokens"] == sum(out["num_generated_tokens"].to_pylist())
    assert stored["totals"]["rows"] == ROWS
