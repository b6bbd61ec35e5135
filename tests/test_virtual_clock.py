"""The benchmarks' virtual clock: model forwards charged a fixed price per shape, host time
real, nothing the engine computes changed."""
import time

import torch

from pipeline.bench.virtual_clock import VirtualClock, kv_bucket, monotone, rows_bucket
from pipeline.engine import Engine, SamplingParams
from pipeline.model.cache import Batch
from tests.tiny_models import random_prompts, tiny_checkpoint


def _engine(tmp_path):
    path = tiny_checkpoint(str(tmp_path / "models"), arch="llama", num_mtp_layers=1, with_tokenizer=False)
    return Engine.from_pretrained(path, device="cpu", max_batch_size=4, gamma_max=3)


def test_buckets():
    assert [rows_bucket(n) for n in (1, 8, 9, 10, 48)] == [1, 8, 10, 10, 49]
    assert all(rows_bucket(n) >= n for n in range(1, 300))
    assert (kv_bucket(1), kv_bucket(32), kv_bucket(33), kv_bucket(600)) == (32, 32, 64, 640)


def test_a_forward_is_charged_its_shapes_price_and_the_clock_is_put_back(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    engine = _engine(tmp_path)
    cache = engine.kv_cache("target", engine.config.num_layers, 1, 64, engine.config.num_kv_heads,
                            engine.config.head_dim)
    clock = VirtualClock(prices={"target:1x1@32": 5.0})
    with clock.installed():
        t0 = time.perf_counter()
        engine.target(torch.tensor([[3]]), Batch.make(torch.tensor([[7]])), cache)
        assert 5.0 <= time.perf_counter() - t0 < 5.5          # the price, not the real microseconds
        assert clock.measured == 0
        engine.target(torch.tensor([[3, 4]]), Batch.make(torch.tensor([[7, 8]])), cache)
        assert clock.measured == 1 and "target:1x2@32" in clock.prices   # a new shape is measured once
    assert time.perf_counter is not clock.now
    assert abs(time.perf_counter() - t0) < 60                 # real time again


def test_same_outputs_and_the_same_charge_for_the_same_work(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    prompts = random_prompts([5, 9, 3], 128, seed=1)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    plain = [o.token_ids for o in _engine(tmp_path).generate(prompts, params, gamma=2)]
    clock = VirtualClock()
    charges = []
    with clock.installed():
        for _ in range(2):
            engine = _engine(tmp_path)
            before = clock.charged
            outs = engine.generate(prompts, params, gamma=2)
            charges.append(clock.charged - before)
            assert [o.token_ids for o in outs] == plain
    assert charges[0] == charges[1] > 0
    saved = tmp_path / "prices.json"
    clock.save(saved)
    assert VirtualClock.load(saved).prices == clock.prices


def test_a_new_shape_is_priced_at_its_fastest_rerun():
    """Reruns slowed by another process's work (here: sleeps) do not set the price."""
    delays = iter([0.05, 0.05, 0.0, 0.05, 0.05])
    clock = VirtualClock(reps=5)
    fn = clock.priced("k", lambda: time.sleep(next(delays)), lambda: "s")
    fn()
    assert clock.prices["k:s"] < 0.02             # the median of these reruns is 0.05


def test_a_pricing_pass_keeps_the_faster_of_the_loaded_and_the_new_price():
    clock = VirtualClock(reps=2, prices={"k:slow": 5.0, "k:fast": 1e-9}, reprice=True)
    clock.priced("k", lambda: None, lambda: "slow")()
    clock.priced("k", lambda: None, lambda: "fast")()
    assert clock.prices["k:slow"] < 0.01 and clock.prices["k:fast"] == 1e-9 and clock.measured == 2
    clock.priced("k", lambda: None, lambda: "slow")()
    assert clock.measured == 2                     # once per shape and pass
    plain = VirtualClock(prices={"k:slow": 5.0})
    plain.priced("k", lambda: None, lambda: "slow")()
    assert plain.prices["k:slow"] == 5.0 and plain.measured == 0


def test_a_shape_is_charged_no_more_than_a_shape_doing_more_work():
    """Measured prices only overstate: a forward costs at most what a larger one was measured at."""
    prices = {"target:1x1@32": 4.0, "target:1x3@160": 9.4, "target:1x4@160": 5.6, "target:1x4@192": 5.5,
              "target:2x3@160": 5.0, "head:0:1x2@64": 0.9, "head:1:1x2@64": 0.5, "logits:1x256": 0.3,
              "logits:2x256": 0.2, "logits:1x512": 0.1, "k:slow": 5.0}
    m = monotone(prices)
    assert m["target:1x3@160"] == 5.0                 # 2x3@160 and 1x4@160/192 do at least its work
    assert m["target:1x4@160"] == 5.5 and m["target:1x4@192"] == 5.5 and m["target:1x1@32"] == 4.0
    assert m["head:0:1x2@64"] == 0.9                   # another head layer is another group
    assert m["logits:1x256"] == 0.2 and m["logits:1x512"] == 0.1   # a logits width is a group, rows are work
    assert m["k:slow"] == 5.0 and all(m[k] <= prices[k] for k in prices)
    work = lambda k: tuple(int(x) for x in k.split(":")[1].replace("@", "x").split("x"))   # noqa: E731
    targets = [k for k in m if k.startswith("target:")]
    assert all(m[a] <= m[b] for a in targets for b in targets if all(x <= y for x, y in zip(work(a), work(b))))


def test_the_clock_charges_the_monotone_price_and_saves_the_measured_one(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    engine = _engine(tmp_path)
    cache = engine.kv_cache("target", engine.config.num_layers, 1, 64, engine.config.num_kv_heads,
                            engine.config.head_dim)
    one = lambda: engine.target(torch.tensor([[3]]), Batch.make(torch.tensor([[7]])), cache)   # noqa: E731
    prices = {"target:1x1@32": 5.0, "target:1x2@32": 2.0}
    for raw, charge in ((False, 2.0), (True, 5.0)):
        clock = VirtualClock(prices=prices, raw=raw)
        with clock.installed():
            t0 = time.perf_counter()
            one()
            assert charge <= time.perf_counter() - t0 < charge + 0.5
        clock.save(tmp_path / "p.json")
        assert VirtualClock.load(tmp_path / "p.json").prices == prices
    clock = VirtualClock(prices={"target:1x2@64": 1e-7})      # a new shape: at most a loaded larger one
    with clock.installed():
        one()
    assert clock.measured == 1 and clock.charges["target:1x1@32"] == 1e-7 < clock.prices["target:1x1@32"]


def test_the_target_forwards_after_a_prefill_pay_the_cold_charges(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    engine = _engine(tmp_path)
    cache = engine.kv_cache("target", engine.config.num_layers, 1, 64, engine.config.num_kv_heads,
                            engine.config.head_dim)
    clock = VirtualClock(rule=lambda key: 1.0, cold_s=(0.5, 0.25))

    def charged(tokens, batch):
        before = clock.charged
        engine.target(torch.tensor([tokens]), batch, cache)
        return clock.charged - before

    with clock.installed():
        step = Batch.make(torch.tensor([[9]]))
        assert charged([3], step) == 1.0                       # no prefill yet: no cold charge
        assert charged([3, 4, 5, 6], Batch.from_start(1, 4, "cpu")) == 1.0   # the prefill pays its price
        assert [charged([3], step) for _ in range(3)] == [1.5, 1.25, 1.0]
        charged([3, 4, 5, 6], Batch.from_start(1, 4, "cpu"))
        assert charged([3], step) == 1.5                       # each prefill starts them again
