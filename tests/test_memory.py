"""Bounded memory. The driver's does not grow with the dataset: planning, committing and
recording a million rows takes what ten thousand take (the engine is a fast stand-in, so the
driver and the data layer are what is measured). An actor's is bounded by max_batch_size and
the context: the engine's KV caches do not grow with the number of prompts."""
import sys
import threading
import tracemalloc

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest

from pipeline.config import RunConfig
from pipeline.engine import RequestOutput
from tests.tiny_models import tiny_checkpoint

ray = pytest.importorskip("ray")



class NoStats:
    steps: list = []
    draft_time_s = verify_time_s = 0.0

    def acceptance_by_depth(self):
        return []

    def mean_acceptance_length(self):
        return 1.0


class FastEcho:
    """A stand-in engine that answers at once: the run's time and memory are the driver's and
    the data layer's, not a model's."""
    last_stats = NoStats()

    def generate(self, prompts, params, gamma="auto", row_keys=None):
        return [RequestOutput(p[:6], [1], finish_reason="length", num_prompt_tokens=1) for p in prompts]


def echo_loader(model, engine):
    return FastEcho()


def write_rows(path, num_rows, group=50_000):
    """num_rows rows of ~200 bytes (id, prompt, source) in row groups, written group by group."""
    filler = pa.scalar("lorem ipsum dolor sit amet " * 7)
    schema = pa.schema([("uid", pa.int64()), ("prompt", pa.string()), ("source", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, num_rows, group):
            ids = pa.array(range(start, min(start + group, num_rows)), pa.int64())
            text = pc.binary_join_element_wise(ids.cast(pa.string()), filler, " ")
            writer.write_table(pa.table([ids, text, pc.utf8_slice_codeunits(text, 0, 12)],
                                        schema=schema), row_group_size=group)


def driver_peaks(raw):
    """Run and return (Python heap peak, Arrow memory peak) of this process, the driver."""
    from pipeline.cluster.driver import run_generation

    arrow = [pa.total_allocated_bytes()]
    stop = threading.Event()

    def sample():
        while not stop.wait(0.002):
            arrow.append(pa.total_allocated_bytes())

    thread = threading.Thread(target=sample, daemon=True)
    tracemalloc.start()
    thread.start()
    try:
        manifest = run_generation(RunConfig.from_dict(raw), raw, progress=False, loader=echo_loader)
        _, heap = tracemalloc.get_traced_memory()
    finally:
        stop.set()
        thread.join()
        tracemalloc.stop()
    assert manifest["status"] == "finished"
    return heap, max(arrow) - arrow[0], manifest


def test_driver_memory_does_not_grow_with_the_dataset(ray_session, tmp_path):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
    model = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1)   # only checked, not loaded
    data = tmp_path / "million.parquet"
    write_rows(data, 1_000_000)
    peaks = {}
    for rows in (1_000, 10_000, 1_000_000):     # the first run pays one-time costs (imports, ...)
        raw = {"model": {"path": model}, "data": {"path": str(data), "id_column": "uid",
                                                  "limit": rows},
               "output": {"dir": str(tmp_path / f"run-{rows}"), "keep_columns": ["source"]},
               "sampling": {"max_new_tokens": 2}, "spec": {"gamma": 0},
               "shards": {"rows_per_shard": 50_000}, "cluster": {"num_actors": 2, "cpus_per_actor": 1}}
        peaks[rows] = driver_peaks(raw)
        assert peaks[rows][2]["totals"]["rows"] == rows
    small, large = peaks[10_000], peaks[1_000_000]
    dataset_bytes = 1_000_000 * 200
    # the million-row run has 20x the shards but holds none of their rows (~200 MB): its Python
    # heap peak stays within 4 MB of the 10k run's, and its Arrow memory below one row group's
    assert large[0] < small[0] + 4_000_000, (small[0], large[0])
    assert large[1] < small[1] + 0.04 * dataset_bytes, (small[1], large[1])
    ids = ds.dataset(str(tmp_path / "run-1000000" / "outputs"), format="parquet").to_table(columns=["id"])
    assert ids.num_rows == 1_000_000 and pc.count_distinct(ids["id"]).as_py() == 1_000_000


def test_engine_caches_are_bounded_by_batch_and_context(tmp_path, monkeypatch):
    import pipeline.engine.drafter as drafter_module
    import pipeline.engine.engine as engine_module
    from pipeline.engine import Engine, SamplingParams
    from pipeline.model.cache import KVCache
    from tests.tiny_models import random_prompts

    shapes = []

    class Recorded(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            shapes.append(tuple(self.k.shape))         # [layers, rows, kv_heads, T, d]

    monkeypatch.setattr(engine_module, "KVCache", Recorded)
    monkeypatch.setattr(drafter_module, "KVCache", Recorded)
    context, batch, gamma = 64, 4, 2
    engine = Engine.from_pretrained(
        tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, max_position_embeddings=context),
        device="cpu", max_batch_size=batch)
    params = SamplingParams(max_new_tokens=200, ignore_eos=True)      # more than the context holds
    for n in (4, 13):
        prompts = random_prompts([58 + i % 4 for i in range(n)], 128, seed=n)    # near the context
        outs = engine.generate(prompts, params, gamma=gamma)
        assert len(outs) == n and all(o.error is None for o in outs)
    assert shapes and all(s[1] <= batch and s[3] <= context + gamma + 2 for s in shapes), shapes
    assert max(s[1] for s in shapes) == batch                   # 13 prompts, still 4 cache rows
    assert len(shapes) == 2         # the target's and the heads' caches: made by the first call, reused by the second
