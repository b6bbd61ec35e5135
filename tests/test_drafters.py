"""Draft sources behind the drafter protocol: greedy identity for every source and for rows
with different draft counts in one step, a checkpoint without heads, and the bounded task index."""
import random

import pytest
import torch

import pipeline.engine.run as engine_module
from pipeline.engine import Engine, SamplingParams
from pipeline.engine.drafters import TaskIndex, resolve_draft
from pipeline.engine.drafters import DraftRequest
from pipeline.engine.drafters.ngram import NgramSource, RowIndex
from pipeline.engine.rows import Row
from tests.tiny_models import hf_greedy, made_up_machine, random_prompts, tiny_checkpoint

MAX_NEW = 24


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


def repetitive_prompts(seed: int) -> list[list[int]]:
    """Prompts that repeat a few segments, so suffix matches are found (and sometimes wrong)."""
    base = random_prompts([6, 4, 8, 5, 7, 3], 128, seed=seed)
    return [p + base[(i + 1) % len(base)] + p + p[:2] for i, p in enumerate(base)]


def record_draft_lens(monkeypatch) -> list[list[int]]:
    seen = []
    real = engine_module.verify_forward

    def recording(target, cache, last, drafts, draft_len, lengths, layout="auto"):
        seen.append(draft_len.tolist())
        return real(target, cache, last, drafts, draft_len, lengths, layout)

    monkeypatch.setattr(engine_module, "verify_forward", recording)
    return seen


@pytest.mark.parametrize("draft,gamma", [("ngram", 3), ("ngram", "auto"), ("mtp", "auto"), ("auto", "auto"),
                                         ("none", "auto")])
def test_greedy_matches_transformers_for_every_source(root, monkeypatch, draft, gamma):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    prompts = repetitive_prompts(seed=1)
    refs = hf_greedy(path, prompts, MAX_NEW)
    seen = record_draft_lens(monkeypatch)
    with made_up_machine():                          # what auto drafts, whatever this machine's load
        engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=gamma, draft=draft, task="t")
    assert [o.token_ids for o in outs] == refs
    by_source = engine.last_stats.drafted_by_source
    if draft == "none":
        assert sum(o.num_drafted_tokens for o in outs) == 0 and not by_source
    if draft == "ngram":
        assert by_source.get("ngram", 0) > 0 and "mtp" not in by_source
        assert any(len(set(lens)) > 1 for lens in seen), "rows of one step must carry different draft counts"
        assert 0 < engine.last_stats.accepted_by_source["ngram"] < by_source["ngram"]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_mixed_draft_lengths_in_one_step_are_greedy_identical(root, monkeypatch, layout):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    prompts = repetitive_prompts(seed=4)
    refs = hf_greedy(path, prompts, MAX_NEW)
    seen = record_draft_lens(monkeypatch)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=6)
    engine.verify_layout = layout
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=4, draft="ngram")
    assert [o.token_ids for o in outs] == refs
    mixed = [lens for lens in seen if 0 in lens and max(lens) > 1]
    assert mixed, "some step must verify rows with 0 drafts next to rows with several"


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_only_a_padded_verify_prices_its_width(root, layout):
    """A verify of per-row drafts prices its width at its rows (VerifyCorrection) only where it
    ran as one padded forward. Packed, each token is its own query row gathering its cache row
    (stop 43's prices, 1 row, 8 tokens: 15.0 ms against 10.1 padded), and at one row its mean
    tokens per row is always whole: the benchmark's forced-packed calls priced the 1-row verify
    widths every other system then read."""
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=1)
    engine.verify_layout = layout
    engine.generate(repetitive_prompts(seed=4)[:3], SamplingParams(max_new_tokens=MAX_NEW), gamma=4, draft="ngram")
    assert engine.last_stats.drafted_by_source.get("ngram", 0) > 0
    widths = {key[0] for key in engine.costs.verify_local.samples}            # (tokens per row, rows, context)
    assert 1 in widths and (max(widths) > 1) == (layout == "padded"), widths


def test_checkpoint_without_heads_speculates_with_ngram(root):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=0, draftable=0.1, with_tokenizer=False)
    prompts = repetitive_prompts(seed=2)
    refs = hf_greedy(path, prompts, MAX_NEW)
    with made_up_machine():
        engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
        assert engine.num_mtp_heads == 0
        for gamma, draft in (("auto", "ngram"), (3, "auto"), (2, "ngram")):
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=gamma, draft=draft)
            assert [o.token_ids for o in outs] == refs, (gamma, draft)
            assert engine.last_stats.drafted_by_source.get("ngram", 0) > 0
    with pytest.raises(ValueError, match="MTP heads"):
        engine.generate(prompts, SamplingParams(max_new_tokens=4), gamma=2, draft="mtp")


def test_resolve_draft():
    assert resolve_draft("auto", False) == ("ngram",) and resolve_draft("auto", True) == ("mtp", "ngram")
    assert resolve_draft("none", True) == ()
    with pytest.raises(ValueError):
        resolve_draft("medusa", True)


def test_row_index_matches_its_own_tokens_then_the_task():
    idx = RowIndex([5, 6, 7, 8, 5, 6])
    idx.extend([], 6)
    assert idx.match(None, 3) == ([7, 8, 5], 2)          # "5 6" occurred before, followed by 7 8 5
    task = TaskIndex(100)
    task.add([1, 2, 9, 9, 4])
    other = RowIndex([3, 1, 2])
    other.extend([], 3)
    assert other.match(task, 2) == ([9, 9], 2)           # not in the row: the task's outputs
    assert RowIndex([3, 4]).match(None, 2) == ([], 0)


def test_row_index_keeps_the_newest_end_of_every_ngram_as_it_grows():
    """Extended a few tokens at a time, the index holds for every 1-3-gram of the row its newest
    end that has a continuation, as a brute-force scan finds it."""
    rng = random.Random(3)
    prompt = [rng.randrange(6) for _ in range(40)]
    out = [rng.randrange(6) for _ in range(30)]
    idx = RowIndex(prompt)
    for n in (0, 1, 2, 7, 8, 30):
        idx.extend(out[:n], len(prompt))
        seq = prompt + out[:n]
        want = {tuple(seq[e - m:e]): e for e in range(1, len(seq)) for m in range(1, min(3, e) + 1)}
        assert idx.seq == seq and idx.ends == want


def test_a_tail_is_looked_up_after_the_heads_drafts_and_within_the_budget():
    """The heads drafted [7, 8] on a row whose prompt holds 7 8 9 10: its tail is 9 10 (a
    2-gram match); a match at the row's end runs on into the drafts; the budget holds."""
    idx = RowIndex([5, 6, 7, 8, 9])
    idx.extend([], 5)
    assert idx.match(None, 5, [5, 6]) == ([7, 8, 9, 5, 6], 2)            # its docstring's example
    rows = [Row(0, [1, 7, 8, 9, 10, 2], 64, None, tokens=[3]), Row(1, [1, 7, 8, 9, 10, 2], 5, None, tokens=[3]),
            None]
    tails, match = NgramSource(None, "cpu").tails(rows, [[7, 8], [7, 8], [7, 8]], 3)
    assert tails == [[9, 10, 2], [9], []] and match == [2, 2, 0]        # row 1: 5 - 1 token - 1 - 2 drafts


def test_heads_rows_carry_their_ngram_tails_greedy_identical(root, monkeypatch):
    """Tails kept whatever their price: greedy output is the target's, the tails were verified
    (and some kept), and the heads' per-depth evidence stops at their own depth."""
    from tests.tiny_models import heads_always_at, keep_every_tail
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    prompts = repetitive_prompts(seed=5)
    refs = hf_greedy(path, prompts, MAX_NEW)
    kept = keep_every_tail(monkeypatch)
    seen = record_draft_lens(monkeypatch)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW), gamma=heads_always_at(engine, 2),
                           draft="auto", task="t")
    assert [o.token_ids for o in outs] == refs
    st = engine.last_stats
    assert any(any(t) for t in kept) and any(max(lens) > 2 for lens in seen)
    assert st.drafted_by_source["ngram"] > 0 and st.accepted_by_source["ngram"] > 0
    assert len(st.reached) == 2                      # the heads' depths; the tails count as n-gram drafts
    drafted = sum(o.num_drafted_tokens for o in outs)
    assert drafted == sum(st.drafted_by_source.values())
    assert sum(o.num_accepted_tokens for o in outs) == sum(st.accepted_by_source.values())


def test_a_tail_behind_a_rejected_heads_draft_is_drafted_but_no_evidence():
    """Emission splits a heads row with a tail: the heads' counts up to their depth, the tail's
    under its match length from its own depth 1 where it was reached, else only as drafted."""
    from types import SimpleNamespace
    from pipeline.engine.emit import emit_ragged
    from pipeline.engine.params import RequestOutput
    from pipeline.spec_decode.stats import SpecStats
    rows = [Row(i, [1, 2], 64, RequestOutput()) for i in range(3)]
    plan = SimpleNamespace(draft_len=torch.tensor([5, 5, 2]), use_mtp=torch.tensor([True, True, False]),
                           match=[0, 0, 3], tail_len=[3, 3, 0], tail_match=[2, 2, 0])
    stats = SpecStats()
    emit_ragged(rows, stats, plan, [3, 1, 2], [[7] * 6, [7] * 6, [7] * 3], lambda row, toks: None)
    assert stats.drafted_by_source == {"mtp": 4, "ngram": 8} and stats.accepted_by_source == {"mtp": 3, "ngram": 3}
    assert stats.reached == [2, 2] and stats.accepted == [2, 1]           # the heads: depths 1-2 only
    assert stats.source_reached["ngram:2"] == [1, 1, 0]                    # row 0's tail: kept 1 of 3
    assert stats.source_accepted["ngram:2"] == [1, 0, 0]


def test_ngram_drafts_stop_short_of_the_rows_token_budget():
    """A row with r tokens left emits at most r: its proposal holds at most r - 1 drafts."""
    prompt = [5, 6, 7, 8, 9, 10, 5, 6]                   # "5 6" was followed by 7 8 9 10 5 6
    made = lambda used: list(range(20, 18 + used)) + [5, 6] if used else []     # noqa: E731  ends "5 6" again
    rows = [Row(i, list(prompt), budget, None, tokens=made(used)) for i, (budget, used) in
            enumerate([(64, 0), (10, 7), (10, 9), (10, 10)])]
    prop = NgramSource(None, "cpu").propose(DraftRequest(4, torch.tensor([8, 15, 17, 18]), 4, None, rows))
    assert prop.host_len == [4, 2, 0, 0]
    assert prop.drafts[0].tolist() == [7, 8, 9, 10] and prop.drafts[1].tolist() == [20, 21, -1, -1]


def test_task_index_stays_within_its_bound_over_a_long_run():
    index = TaskIndex(max_tokens=500)
    gen = torch.Generator().manual_seed(0)
    for i in range(2000):
        seq = torch.randint(0, 50, (int(torch.randint(5, 80, (1,), generator=gen)),), generator=gen).tolist()
        index.add(seq)
        assert index.held <= 500
        assert len(index.keys) <= len(index.orders) * index.held
        assert len(index.seqs) == len(index._by_id)
    last = seq
    assert index.lookup(tuple(last[:3]), 2) == last[3:5] or len(last) < 5
    assert all(sid in index._by_id for sid, _ in index.keys.values())


def test_task_index_is_kept_per_task_across_calls(root):
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=0, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2)
    prompts = random_prompts([5, 6], 128, seed=7)
    engine.generate(prompts, SamplingParams(max_new_tokens=8), gamma="auto", draft="ngram", task="a")
    held = engine.task_indexes["a"].held
    assert held > 0 and "b" not in engine.task_indexes
    engine.generate(prompts, SamplingParams(max_new_tokens=8), gamma="auto", draft="ngram", task="a")
    assert engine.task_indexes["a"].held > held
    assert engine.ngram_evidence["a"].source_reached


def test_a_plain_llama_shard_with_spec_draft_ngram_is_greedy_identical(tmp_path):
    """The `+job=generate spec.draft=ngram` path without Ray: process_shard on a plain
    transformers-made Llama (no heads) gives transformers' greedy text, and the stats row counts
    the n-gram drafts."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from pipeline.cluster.worker import ShardTask, process_shard
    from pipeline.config import DataConfig
    from pipeline.data import open_source, plan_shards

    path = tiny_checkpoint(str(tmp_path / "m"), arch="llama", num_mtp_layers=0, draftable=0.1)
    texts = [f"the quick brown fox {i} jumps over the quick brown fox" for i in range(6)]
    pq.write_table(pa.table({"text": texts}), tmp_path / "d.parquet")
    source = open_source(str(tmp_path / "d.parquet"))
    data = DataConfig(path=str(tmp_path / "d.parquet"), prompt_column="text")
    task = ShardTask(plan_shards(source, 6)[0], 1, source.files, source.file_rows, data, (),
                     SamplingParams(max_new_tokens=MAX_NEW), "auto", draft="ngram")
    with made_up_machine():
        engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
        result = process_shard(engine, task, {"device": "cpu"}, {})
    ids = [engine.tokenizer(t)["input_ids"] for t in texts]
    refs = [engine.tokenizer.decode(r, skip_special_tokens=True) for r in hf_greedy(path, ids, MAX_NEW)]
    assert result.table.column("generated_text").to_pylist() == refs
    row = result.stats_rows[0]
    assert row["drafted_by_source"].get("ngram", 0) > 0 and "mtp" not in row["drafted_by_source"]
    assert sum(result.table.column("num_drafted_tokens").to_pylist()) == row["drafted_by_source"]["ngram"]


def test_heads_catch_up_on_gamma_0_steps_before_they_draft(root, monkeypatch):
    """A row whose first steps run gamma 0 keeps its prompt and the skipped steps' tokens for its
    heads (the prompt fill and the backlog), so at its first draft their caches hold what heads
    drafting from the start hold, and greedy output is unchanged. Before, a gamma-0 step dropped
    the prompt's fill (json on the demo: 2.33 tokens per gamma-3 step instead of 3.16 after three
    such steps), and later its tokens were a masked gap (complete: 2.87 against 3.15 after 48)."""
    from pipeline.engine.drafter import Drafter
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    prompt = random_prompts([9], 128, seed=4)[0]
    seen, real = [], Drafter.propose

    def recording(self, n, lengths, gamma, pick):
        out = real(self, n, lengths, gamma, pick)
        seen.append((int(lengths[0]), self.valid[:, 0].clone(), self.cache.k[:, 0].clone()))
        return out

    monkeypatch.setattr(Drafter, "propose", recording)

    class Script:
        decisions = ()

        def __init__(self, plain):
            self.steps, self.plain = 0, plain

        def choose(self, ctx):
            self.steps += 1
            return 0 if self.steps <= self.plain else 2

        def max_gamma(self):
            return 2

    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=1)
    ref = hf_greedy(path, [prompt], 12)[0]
    assert engine.generate([prompt], SamplingParams(max_new_tokens=12), gamma=Script(0), draft="mtp")[0].token_ids == ref
    throughout = seen[-1]
    seen.clear()
    assert engine.generate([prompt], SamplingParams(max_new_tokens=12), gamma=Script(3), draft="mtp")[0].token_ids == ref
    length, valid, keys = seen[0]
    p = len(prompt)
    assert length == p + 3 and throughout[0] >= length       # three gamma-0 steps before the first draft
    assert valid[0, :p + 3].all() and valid[1, 1:p + 3].all()   # both heads: prompt, skipped steps, last step
    assert torch.equal(valid[:, :p + 3], throughout[1][:, :p + 3])
    assert torch.allclose(keys[:, :, :p + 3], throughout[2][:, :, :p + 3], atol=1e-4)


def test_a_deferred_prompt_fill_is_prefill_work_not_a_steps_drafting(root, monkeypatch):
    """The heads' fill of a prompt runs with the row's first drafted step; its time goes to the
    stats' prefill, not to that step's draft_s (the cost model would price every depth by it)."""
    import time

    from pipeline.engine.drafter import Drafter
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    real = Drafter._fill

    def slow_prompt_fill(self, p):
        if p.from_zero:
            time.sleep(0.2)
        return real(self, p)

    monkeypatch.setattr(Drafter, "_fill", slow_prompt_fill)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2)
    prompts = random_prompts([9, 5, 7], 128, seed=6)
    engine.generate(prompts, SamplingParams(max_new_tokens=6, ignore_eos=True), gamma=2)
    st = engine.last_stats
    assert len(st.steps) >= 3 and max(s.draft_s for s in st.steps) < 0.2
    deferred = [p for p in st.prefills if p.rows == 0]
    assert len(deferred) == 2 and all(p.seconds >= 0.2 for p in deferred)   # batch 2: two admissions
    assert st.prefill_time_s >= 3 * 0.2


@pytest.mark.parametrize("host", [False, True])
@pytest.mark.parametrize("slice_rows", [0, 4])
def test_a_backlog_follows_its_rows_and_keeps_the_newest_tokens_when_full(monkeypatch, host, slice_rows):
    """Gamma-0 steps' tokens per slot: appended step by step, moved and dropped with their rows,
    taken as one fill; a row that would exceed the size starts over from its newest step (the
    older tokens become a masked gap: `add` says which rows). The same with and without the
    fill's host mirrors, by index tensors and by per-row copies, and by one column copy where
    every row appends a token at the same column."""
    from pipeline.engine import drafter as drafter_module
    from pipeline.engine.drafter import Backlog, PendingFill
    monkeypatch.setattr(drafter_module, "SLICE_ROWS", slice_rows)

    def step(rows, start, count, tok):
        n = len(rows)
        return PendingFill(torch.tensor(rows), torch.tensor(start), torch.full((n, 2, 1), float(tok)),
                           torch.full((n, 2), tok), torch.tensor(count),
                           slots=list(rows) if host else None, counts=list(count) if host else None)

    b = Backlog(batch_size=4, size=3, device="cpu")
    assert not b and b.take() is None
    assert b.add(step([1, 2], [10, 20], [1, 1], 5)) == []
    assert b.add(step([1, 2], [11, 21], [1, 2], 6)) == []
    assert b.tokens == {1: 2, 2: 3}
    b.move(2, 0)
    b.drop([1])
    fill = b.take()
    assert fill.rows.tolist() == [0] and fill.start.tolist() == [20] and fill.count.tolist() == [3]
    assert fill.next_ids.tolist() == [[5, 6, 6]] and fill.hidden[0, :, 0].tolist() == [5.0, 6.0, 6.0]
    assert fill.slots == [0] and fill.counts == [3]
    assert not b
    b.add(step([3, 1], [30, 40], [2, 1], 7))
    assert b.add(step([3, 1], [32, 41], [2, 2], 8)) == [0]          # row 0 (slot 3): 4 > 3, its newest step alone
    fill = b.take()
    assert fill.rows.tolist() == [1, 3] and fill.start.tolist() == [40, 32] and fill.count.tolist() == [3, 2]
    assert [r[:c] for r, c in zip(fill.next_ids.tolist(), fill.counts)] == [[7, 8, 8], [8, 8]]
    b.add(step([0, 1], [50, 60], [1, 1], 9))          # rows 0..r-1, a token each: one column copy
    b.add(step([0, 1], [51, 61], [1, 1], 4))
    fill = b.take()
    assert fill.rows.tolist() == [0, 1] and fill.start.tolist() == [50, 60] and fill.counts == [2, 2]
    assert fill.next_ids.tolist() == [[9, 4], [9, 4]] and fill.hidden[:, :, 0].tolist() == [[9.0, 4.0], [9.0, 4.0]]


def test_held_backlog_columns_follow_rows_that_end_or_move_without_writing():
    """Plain steps of slots 0..3 are held unwritten; slot 1 ends, slot 3 moves into its hole
    and a slot ends at the restart: nothing is written until a fill reads them, which then
    gets each row's own tokens at its new slot; a row overflowing drops its held columns
    unwritten. Before, every ending or moving row wrote the held columns first (~0.2 ms at 32 rows)."""
    from pipeline.engine.drafter import Backlog

    def col(tok, rows=4):
        return (torch.arange(rows) + 10 * tok, torch.arange(rows, dtype=torch.float32)[:, None, None] + tok,
                (torch.arange(rows) + 100 * tok)[:, None])

    b = Backlog(batch_size=4, size=3, device="cpu")
    slots = [0, 1, 2, 3]
    assert b.add_column(slots, *col(1)) == []
    b.drop([1])
    b.move(3, 1)
    slots = [0, None, 2, 1]                        # the engine's view of the same rows now
    assert b.add_column(slots, *col(2)) == []
    assert b.hidden is None and len(b.held) == 2 and b.tokens == {0: 2, 2: 2, 1: 2}
    fill = b.take()
    assert fill.slots == [0, 1, 2] and fill.counts == [2, 2, 2]
    assert fill.start.tolist() == [10, 13, 12]            # each row's first position, at its new slot
    assert fill.next_ids.tolist() == [[100, 200], [103, 203], [102, 202]]
    assert fill.hidden[:, :, 0].tolist() == [[1.0, 2.0], [4.0, 5.0], [3.0, 4.0]]
    for tok in (3, 4, 5):
        assert b.add_column([0, 1], *col(tok, 2), restart=True) == []
    assert b.add_column([0, 1], *col(6, 2), restart=True) == [0, 1]   # full: starts over, unwritten
    assert b.hidden is not None and len(b.held) == 1 and b.tokens == {0: 1, 1: 1}
    fill = b.take()
    assert fill.start.tolist() == [60, 61] and fill.next_ids.tolist() == [[600], [601]]


def test_held_backlog_columns_take_rows_holding_different_counts():
    """After a drafted step rows hold different counts (slot 0 two tokens, slot 1 one): plain
    steps are still held unwritten, each row's token at the column after its own; when slot 0
    fills the size it alone starts over (its older tokens a gap) and slot 1 keeps its own. A
    fill then reads each row's tokens in order. Before, every such step took the general
    append (~130 us at 32 rows)."""
    from pipeline.engine.drafter import Backlog, PendingFill

    def col(tok):
        return (torch.tensor([10 * tok, 10 * tok + 1]), torch.full((2, 1, 1), float(tok)),
                torch.tensor([[100 * tok], [100 * tok + 1]]))

    b = Backlog(batch_size=2, size=3, device="cpu")
    b.add(PendingFill(torch.tensor([0, 1]), torch.tensor([5, 6]), torch.full((2, 2, 1), 1.0),
                      torch.tensor([[1, 2], [3, 4]]), torch.tensor([2, 1]), slots=[0, 1], counts=[2, 1]))
    written = b.hidden.clone()
    assert b.add_column([0, 1], *col(2)) == []
    assert torch.equal(b.hidden, written) and b.tokens == {0: 3, 1: 2}        # held, not written
    assert b.add_column([0, 1], *col(3)) is None                              # slot 0 full: `add` decides
    assert b.add_column([0, 1], *col(3), restart=True) == [0]                 # slot 0 alone starts over
    assert b.tokens == {0: 1, 1: 3} and torch.equal(b.hidden, written)
    fill = b.take()
    assert fill.slots == [0, 1] and fill.counts == [1, 3] and fill.start.tolist() == [30, 6]
    assert fill.next_ids[0, :1].tolist() == [300] and fill.next_ids[1].tolist() == [3, 201, 301]
    assert fill.hidden[1, :, 0].tolist() == [1.0, 2.0, 3.0]


def test_the_last_steps_column_gives_each_row_its_own_token_after_rows_end_and_move(tmp_path):
    """The last plain step's column (Drafter.add_column) stays as it is while rows end and move;
    the fill made of it (a draft follows) runs each remaining row's token at its slot now:
    slot 2 ends (a new row may take it), then slot 3 moves into slot 1 after slot 1 ends."""
    from pipeline.engine.drafters import MTPSource
    path = tiny_checkpoint(str(tmp_path), arch="qwen3", num_mtp_layers=1, with_tokenizer=False)
    d = MTPSource.for_engine(Engine.from_pretrained(path, device="cpu", max_batch_size=4), 4, 32).drafter
    hidden = torch.arange(4, dtype=torch.float32)[:, None, None].expand(4, 1, 3)
    d.add_column(4, torch.tensor([10, 11, 12, 13]), hidden, torch.tensor([[100], [101], [102], [103]]))
    d.drop_rows(torch.tensor([2]))
    assert d.column is not None and not d.pending          # nothing built yet
    d._column_to_pending()
    (fill,) = d.pending
    assert fill.slots == [0, 1, 3] and fill.rows.tolist() == [0, 1, 3]
    assert fill.start.tolist() == [10, 11, 13] and fill.next_ids[:, 0].tolist() == [100, 101, 103]
    assert fill.hidden[:, 0, 0].tolist() == [0.0, 1.0, 3.0]
    d.pending = []
    d.add_column(4, torch.tensor([10, 11, 12, 13]), hidden, torch.tensor([[100], [101], [102], [103]]))
    d.drop_rows(torch.tensor([1]))
    d.move_row(3, 1)
    d._column_to_pending()
    (fill,) = d.pending
    assert fill.slots == [0, 2, 1] and fill.rows.tolist() == [0, 2, 1]
    assert fill.next_ids[:, 0].tolist() == [100, 102, 103]


def test_waiting_prompt_fills_follow_their_rows_as_they_move_and_finish():
    """The docstring example of PendingPrompts: a fill of slots [3, 5]; slot 5 finishes and 3
    moves to 1, so `take` runs only the first row's entries, as slot 1."""
    from pipeline.engine.drafter import PendingFill, PendingPrompts
    hidden = torch.arange(2 * 4 * 2, dtype=torch.float32).reshape(2, 4, 2)
    fill = PendingFill(torch.tensor([3, 5]), torch.zeros(2, dtype=torch.long), hidden,
                       torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]]), torch.tensor([4, 2]), from_zero=True)
    waiting = PendingPrompts()
    waiting.add(fill, [3, 5], [4, 2])
    waiting.drop([5])
    waiting.move(3, 1)
    assert waiting and waiting.tokens == {1: 4}  # the prompt tokens still to fill, by slot
    (taken,) = waiting.take("cpu")
    assert taken.rows.tolist() == [1] and taken.count.tolist() == [4] and taken.from_zero
    assert torch.equal(taken.hidden, hidden[:1]) and taken.next_ids.tolist() == [[1, 2, 3, 4]]
    assert not waiting and waiting.take("cpu") == []
    waiting.add(fill, [3, 5], [4, 2])
    waiting.drop([3, 5])                         # every row gone: nothing to run
    assert not waiting and waiting.take("cpu") == []


@pytest.mark.parametrize("head_ms,want", [(10.0, False), (0.1, True)])
def test_heads_run_for_a_step_only_where_their_cost_pays_against_the_ngram_drafts(head_ms, want):
    """One row: the heads expect 2.5 drafts kept, its n-gram draft 2.2. Heads whose drafting
    costs 10 ms on a 10.5 ms step lose to the free n-gram draft (3.5 tokens / 22 ms against 3.2 / 12);
    at 0.1 ms they win. Before, the row took the heads on expected tokens alone."""
    from pipeline.engine.drafting import DraftPlanner
    from pipeline.spec_decode.cost import CostModel
    model = CostModel((10e-3, 0.5e-3, 0.0, 0.0), 0.0, (head_ms * 1e-3, 0.0, 0.0, 0.0), 0)
    planner = DraftPlanner({}, auto=True, ngram_cap=3, evidence=None, cost_model=lambda: model, params=None)
    assert planner._heads_pay([[0.9, 0.8, 0.5]], [True], 2.5, 3, 1, 64.0)[0] is want


def test_a_row_takes_the_heads_or_its_ngram_draft_by_what_each_keeps_within_the_heads_depth():
    """Heads at gamma 3 keep 1.8 drafts; a long weak match keeps 1.2 of its first 3 (1.8 of 5):
    the heads. Counted whole, the match's 4th and 5th drafts were free and it tied or won, though
    they widen every row's verify (priced apart, for the step)."""
    from pipeline.spec_decode.row_drafts import takes_heads
    weak = [0.5, 0.4, 0.3, 0.3, 0.3]
    assert takes_heads(weak, 1.8, 3) and not takes_heads(weak, 1.1, 3)
    assert not takes_heads([0.9, 0.8, 0.7], 1.8, 3)                  # a strong match beats the heads
    assert takes_heads(weak + [0.3], 1.8, 3) and not takes_heads(weak + [0.3], 1.8, 6)


@pytest.mark.parametrize("strong,lookups", [(False, 4), (True, 16)])
def test_the_lookup_pauses_while_the_heads_beat_every_match(strong, lookups):
    """Where no row keeps an n-gram draft, the lookup's host time is spent for nothing: it pauses
    1, 3, 7 steps (4 lookups in 16 steps); a match that wins is looked up every step."""
    from pipeline.engine.drafters.base import Proposal
    from pipeline.engine.drafting import DraftPlanner
    from pipeline.spec_decode.stats import SpecStats

    calls = []

    class Ngram:
        def propose(self, req):
            calls.append(1)
            return Proposal(torch.tensor([[5, 6, 7]]), torch.tensor([3]), None, [3], 0.0, [3])

    class Heads:
        def propose(self, req):
            return Proposal(torch.tensor([[1, 2, 3]]), torch.tensor([3]), None)

        def skip(self):
            pass

    a = 0.99 if strong else 0.2
    stats = SpecStats(reached=[100] * 3, accepted=[80] * 3,
                      source_reached={"ngram:3": [100] * 3}, source_accepted={"ngram:3": [int(100 * a)] * 3})
    planner = DraftPlanner({"ngram": Ngram(), "mtp": Heads()}, auto=True, ngram_cap=3, evidence=None,
                           cost_model=lambda: None, params=None)
    for _ in range(16):
        out = planner.plan(1, torch.tensor([10]), [None], 3, None, stats, None, 10.0, False)
        assert out.drafts.tolist() == ([[5, 6, 7]] if strong and calls[-1:] else [[1, 2, 3]])
    assert len(calls) == lookups


@pytest.mark.parametrize("first_match,by_gamma", [(1, True), (3, False)])
def test_a_step_is_a_gammas_shape_only_where_every_row_drafts_the_heads_gamma(first_match, by_gamma):
    """Two rows, heads at gamma 3. Matches of length 1 are weak here, so both rows take the heads:
    one draft count for every row, verified as a gamma-3 step, and its time prices gamma 3. A
    strong 3-token match on the first row takes its n-gram draft: the step is no gamma's shape.
    Labelled by-gamma with a count per row, forced-packed verifies (137 ms against 76 padded)
    priced 48 rows at gamma 3 at 1.46x their cost (docs/decisions.md, stop 44)."""
    from pipeline.engine.drafters.base import Proposal
    from pipeline.engine.drafting import DraftPlanner
    from pipeline.spec_decode.stats import SpecStats

    class Ngram:
        def propose(self, req):
            return Proposal(torch.tensor([[5, 6, 7], [8, 9, 10]]), torch.tensor([3, 3]), None,
                            [first_match, 1], 0.0, [3, 3])

    class Heads:
        def propose(self, req):
            return Proposal(torch.tensor([[1, 2, 3], [1, 2, 3]]), torch.tensor([3, 3]), None)

        def skip(self):
            pass

    stats = SpecStats(reached=[100] * 3, accepted=[80] * 3,
                      source_reached={"ngram:3": [100] * 3, "ngram:1": [100] * 3},
                      source_accepted={"ngram:3": [99] * 3, "ngram:1": [20] * 3})
    planner = DraftPlanner({"ngram": Ngram(), "mtp": Heads()}, auto=True, ngram_cap=3, evidence=None,
                           cost_model=lambda: None, params=None)
    out = planner.plan(2, torch.tensor([10, 10]), [None, None], 3, None, stats, None, 10.0, False)
    assert out.by_gamma is by_gamma and (out.draft_len is None) is by_gamma
    assert out.drafts.tolist() == ([[1, 2, 3], [1, 2, 3]] if by_gamma else [[5, 6, 7], [1, 2, 3]])


def test_a_batch_that_never_drafts_moves_no_head_cache_rows(root, monkeypatch):
    """Rows that finish early leave holes the last row moves into; the heads' cache of a row
    that never drafted holds nothing, so only the target's cache row is copied. Once rows
    draft, both are (and greedy output is unchanged either way)."""
    from pipeline.model.cache import KVCache
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
    moves, real = [], KVCache.move_row

    def counting(self, src, dst, length=None):
        moves.append("heads" if self is engine._caches.get("heads") else "target")
        return real(self, src, dst, length)

    monkeypatch.setattr(KVCache, "move_row", counting)

    class Always:
        decisions = ()

        def __init__(self, gamma):
            self.gamma = gamma

        def choose(self, ctx):
            return self.gamma

        def max_gamma(self):
            return 2

    limit = engine.config.max_position_embeddings
    prompts = random_prompts([limit - 3, 5, limit - 7, 6, 4], 128, seed=8)   # the long ones finish early
    refs = hf_greedy(path, prompts, 10)
    for gamma in (0, 2):
        moves.clear()
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=10, ignore_eos=True), gamma=Always(gamma))
        assert [o.token_ids for o in outs] == [r[:len(o.token_ids)] for o, r in zip(outs, refs)]
        assert moves.count("target") > 0
        assert moves.count("heads") == (0 if gamma == 0 else moves.count("target"))


def test_a_step_prices_the_waiting_prompt_fills_per_token_their_rows_have_left(root):
    """What the gamma policy is told a speculative step would pay first: each waiting prompt's
    fill (measured seconds per prompt token), in all and over the tokens its row is expected to produce
    still: the task's (or, with no task, the call's) median output length so far less what it
    has, else its budget."""
    from collections import deque

    from pipeline.engine.run import GenerateRun
    path = tiny_checkpoint(root, arch="llama", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=2)
    params = SamplingParams(max_new_tokens=20)
    prompts = random_prompts([9, 5], 128, seed=9)

    def run(policy, task="t"):
        rows = [engine._make_row(i, p, params) for i, p in enumerate(prompts)]
        r = GenerateRun(engine, rows, params, policy, ("mtp",), None, task)
        r._admit()                          # prefilled: both prompts wait for the heads
        return r

    assert run(engine.auto_policy())._waiting_fills() == (0.0, 0.0)    # no fill measured yet
    engine.costs.note_prompt_fill(0.01, 100)                        # 100 us a prompt token
    per_left, whole = run(engine.auto_policy())._waiting_fills()
    assert per_left == pytest.approx(1e-4 * (9 + 5) / 19)         # budget: 20 - 1
    assert whole == pytest.approx(1e-4 * (9 + 5))                  # what the next speculative step runs first
    engine.output_lengths["t"] = deque([8, 8, 9])
    assert run(engine.auto_policy())._waiting_fills()[0] == pytest.approx(1e-4 * (9 + 5) / 7)    # median 8, 1 made
    untold = run(engine.auto_policy(), task=None)            # a call of no task: its own rows' lengths only
    assert untold._waiting_fills()[0] == pytest.approx(1e-4 * (9 + 5) / 19)
    untold.lengths.extend([4, 4])
    assert untold._waiting_fills()[0] == pytest.approx(1e-4 * (9 + 5) / 3)
    from pipeline.spec_decode.policy import FixedGamma
    assert run(FixedGamma(2))._waiting_fills() == (0.0, 0.0)         # a fixed gamma decides nothing


def test_a_rows_remainder_is_read_from_the_rows_that_ran_longer():
    """A row past the median output length still has the remainder of the rows that got as far:
    priced as if it were about to end, its waiting fill would hold it at gamma 0."""
    from pipeline.engine.run import expected_left
    lengths = [10, 20, 40, 64, 64]
    assert expected_left(lengths, 30, 34) == 34          # past 30: 10, 34, 34 left (median less 30: 10)
    assert expected_left(lengths, 5, 59) == 35           # every row ran longer: 5, 15, 35, 59, 59
    assert expected_left(lengths, 30, 20) == 20          # within its budget
    assert expected_left(lengths, 64, 100) == 1          # longer than every recent row
    assert expected_left([], 3, 17) == 17                # nothing finished yet: its budget
    assert expected_left([8, 8, 9], 1, 19) == 7


def test_a_lookup_pauses_after_its_grace_of_misses_and_a_hit_ends_the_pause():
    from pipeline.engine.drafting import Backoff
    pause = Backoff(grace=3)
    for _ in range(3):                    # the tails' grace: three misses pause nothing
        pause.miss()
        assert not pause.skip()
    pause.miss()                          # the 4th: one step skipped
    assert pause.skip() and not pause.skip()
    pause.miss()
    assert [pause.skip() for _ in range(4)] == [True, True, True, False]
    pause.hit()
    pause.miss()                          # counted afresh: three more misses before a pause
    assert not pause.skip()


def test_a_wider_verify_is_never_priced_below_a_narrower_one():
    """Measured verify prices per width (medians of real steps) are noisy: one run priced 1-row
    verifies of 1..6 tokens at 4.7, 5.2, 6.8, 6.4, 8.2, 7.1 ms, and a planner reading them as
    they are would prefer 4 drafts to 3 and 6 to 5 for the price alone. Pooled instead."""
    from pipeline.engine.drafting import nondecreasing, width_costs
    measured = [4.7, 5.2, 6.8, 6.4, 8.2, 7.1]
    assert nondecreasing(measured) == pytest.approx([4.7, 5.2, 6.6, 6.6, 7.65, 7.65])
    assert nondecreasing([3.0, 2.0, 1.0]) == pytest.approx([2.0] * 3)
    assert nondecreasing([1.0, 2.0]) == [1.0, 2.0] and nondecreasing([]) == []

    class Measured:
        def step_s(self, rows, gamma, ctx):
            return 5.0
        def measured_verify_s(self, rows, q, ctx):
            return measured[q - 1]
    costs = width_costs(Measured(), 1, 160.0, 5)
    assert costs == pytest.approx([5.0, 5.5, 6.9, 6.9, 7.95, 7.95])
    assert all(a <= b for a, b in zip(costs, costs[1:]))


def test_sources_sum_their_deferred_work_by_slot():
    """GenerateRun asks the sources, not the heads, what waits before their next drafts: per slot
    summed over sources; the n-gram source defers nothing."""
    from pipeline.engine.drafters import Sources

    class Deferring:
        def __init__(self, waiting, fill):
            self.waiting, self.fill = waiting, fill

        def waiting_tokens(self):
            return dict(self.waiting)

        def take_prompt_fill(self):
            out, self.fill = self.fill, (0.0, 0)
            return out

    ngram = NgramSource(None, "cpu")
    assert (ngram.waiting_tokens(), ngram.take_prompt_fill(), ngram.last_fill_tokens()) == ({}, (0.0, 0), -1)
    sources = Sources({"a": Deferring({0: 114, 2: 3}, (2e-3, 114)), "b": Deferring({2: 4}, (1e-3, 4)),
                       "ngram": ngram})
    assert sources.waiting_tokens() == {0: 114, 2: 7}
    assert sources.take_prompt_fill() == (pytest.approx(3e-3), 118)
    assert sources.take_prompt_fill() == (0.0, 0)                 # taken once


def test_any_row_pays_is_what_either_pricing_keeps_for_rows_at_the_best_p():
    """The pre-check worked out per depth says what padded_lengths and draft_lengths say over
    all n x G entries, on random shapes, prices and acceptances (both ways)."""
    from pipeline.spec_decode.row_drafts import any_row_pays, cumulative, draft_lengths, padded_lengths
    rng = random.Random(5)
    seen = set()
    for _ in range(3000):
        n, g = rng.choice([1, 2, 3, 7, 48]), rng.randint(1, 5)
        best = cumulative([rng.uniform(0.0, 1.0) for _ in range(g)])
        base = rng.uniform(1.0, 20.0)
        costs = sorted([base] + [base * rng.uniform(1.0, 2.5) for _ in range(g)])
        token, first, gain = rng.uniform(0.0, 0.5) * base / n, rng.uniform(0, 0.3) * base, rng.choice([0.0, 0.05])
        rows = [best] * n
        want = any(padded_lengths(rows, costs, gain)) or any(draft_lengths(rows, costs[0], token, first, gain))
        assert any_row_pays(best, n, costs, token, first, gain) == want
        seen.add(want)
    assert seen == {True, False}


@pytest.mark.parametrize("bound,lookups", [(True, 0), (False, 12)])
def test_no_lookup_where_even_the_best_match_on_every_row_cannot_pay(bound, lookups):
    """With the heads at gamma 0, an n-gram lookup is made only where a draft could pay at this
    shape: where a verified token costs what an emitted one does (compute-bound), not even a
    3-token match on every row keeps a draft, so none is looked up; where a wider verify costs
    little more than a plain step, every step looks up (its strong matches are kept)."""
    from pipeline.engine.drafters.base import Proposal
    from pipeline.engine.drafting import DraftPlanner
    from pipeline.spec_decode.cost import CostModel
    from pipeline.spec_decode.stats import SpecStats

    calls = []

    class Ngram:
        def propose(self, req):
            calls.append(1)
            return Proposal(torch.tensor([[5, 6, 7]] * 4), torch.tensor([3] * 4), None, [3] * 4, 0.0, [3] * 4)

    class Heads:
        def skip(self):
            pass

    verify = (1e-6, 1e-3, 0.0, 0.0) if bound else (10e-3, 1e-5, 0.0, 0.0)   # per step, per token
    model = CostModel(verify, 0.0, (0.0, 0.0, 0.0, 0.0), 0)
    stats = SpecStats(source_reached={"ngram:3": [100] * 3}, source_accepted={"ngram:3": [90] * 3})
    planner = DraftPlanner({"ngram": Ngram(), "mtp": Heads()}, auto=True, ngram_cap=3, evidence=None,
                           cost_model=lambda: model, params=None)
    for _ in range(12):
        out = planner.plan(4, torch.tensor([10] * 4), [None] * 4, 0, None, stats, None, 10.0, False)
        assert out.drafts.shape[1] == (0 if bound else 3)
    assert len(calls) == lookups
