"""KV caches: a ragged verify step leaves every row's cache as plain decoding would, and the
MTP heads' caches hold exactly the entries a full-sequence forward computes."""
import pytest
import torch

from pipeline.engine import Engine, SamplingParams
from pipeline.engine.run import GenerateRun
from pipeline.engine.rows import Row
from pipeline.engine.params import RequestOutput
from pipeline.engine.slots import Slots
from pipeline.model.cache import Batch, KVCache
from pipeline.model.loader import load_model
from pipeline.spec_decode.acceptance import greedy_accept
from pipeline.spec_decode.policy import FixedGamma
from tests.tiny_models import random_prompts, tiny_checkpoint


def _prefill(model, cache, prompts):
    lens = torch.tensor([len(p) for p in prompts])
    ids = torch.zeros(len(prompts), int(lens.max()), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, :len(p)] = torch.tensor(p)
    pos = torch.arange(ids.shape[1]).expand_as(ids)
    hidden = model(ids, Batch.make(pos, rows=torch.arange(len(prompts)), kv_len=ids.shape[1]), cache)
    return lens, model.logits(hidden[torch.arange(len(prompts)), lens - 1]).argmax(-1)


def _plain_step(model, cache, lengths, last):
    """One gamma-0 step: returns the next tokens; lengths advance by one."""
    logits = model.logits(model(last[:, None], Batch.make(lengths[:, None]), cache))
    lengths += 1
    return logits[:, 0].argmax(-1)


@torch.no_grad()
def test_ragged_verify_step_leaves_cache_as_plain_decoding(tmp_path):
    m = load_model(tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=0, with_tokenizer=False))
    target, cfg = m.target, m.config
    prompts = random_prompts([4, 7, 5], cfg.vocab_size, seed=4)
    new_cache = lambda: KVCache(cfg.num_layers, 3, 64, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")  # noqa: E731

    ref_cache = new_cache()
    ref_len, tok = _prefill(target, ref_cache, prompts)
    generated = [tok]
    for _ in range(8):
        tok = _plain_step(target, ref_cache, ref_len, tok)
        generated.append(tok)
    gen = torch.stack(generated, dim=1)                      # [3, 9] greedy continuation

    cache = new_cache()
    slots = Slots(3, "cpu", None, cache)
    lengths, first = _prefill(target, cache, prompts)
    slots.lengths[:3], slots.last_token[:3] = lengths, first
    wrong = (gen[:, 1:4] + 1) % cfg.vocab_size
    drafts = torch.stack([gen[0, 1:4],                                  # all three right
                          torch.stack([gen[1, 1], wrong[1, 1], wrong[1, 2]]),   # first right only
                          wrong[2]])                                    # none right
    tokens = torch.cat([slots.last_token[:3, None], drafts], dim=1)
    positions = slots.lengths[:3, None] + torch.arange(4)
    logits = target.logits(target(tokens, Batch.make(positions), cache))
    num, emitted = greedy_accept(drafts, logits)
    assert num.tolist() == [3, 1, 0]
    slots.advance(3, num, emitted)
    assert slots.lengths[:3].tolist() == [len(p) + k + 1 for p, k in zip(prompts, [3, 1, 0])]
    assert slots.last_token[:3].tolist() == [gen[0, 4].item(), gen[1, 2].item(), gen[2, 1].item()]
    for b in range(3):
        n = int(slots.lengths[b])
        torch.testing.assert_close(cache.k[:, b, :, :n], ref_cache.k[:, b, :, :n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(cache.v[:, b, :, :n], ref_cache.v[:, b, :, :n], rtol=1e-5, atol=1e-5)
    # Decoding on from the ragged state overwrites the stale draft slots and reproduces the rest.
    lengths, last = slots.lengths[:3].clone(), slots.last_token[:3].clone()
    produced = {b: [] for b in range(3)}
    for _ in range(4):
        last = _plain_step(target, cache, lengths, last)
        for b in range(3):
            produced[b].append(int(last[b]))
    assert produced[0] == gen[0, 5:9].tolist()
    assert produced[1] == gen[1, 3:7].tolist()
    assert produced[2] == gen[2, 2:6].tolist()


@torch.no_grad()
def test_mtp_caches_hold_prompt_and_accepted_tokens(tmp_path):
    """After several speculative steps, each head's cache equals a full-sequence computation over
    the accepted tokens (head k sees head k-1's output one position earlier)."""
    path = tiny_checkpoint(str(tmp_path), arch="qwen3", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    prompts = random_prompts([5, 9, 3], 128, seed=8)
    rows = [Row(i, p, 40, RequestOutput()) for i, p in enumerate(prompts)]
    run = GenerateRun(engine, rows, SamplingParams(max_new_tokens=40, ignore_eos=True), FixedGamma(3))
    for _ in range(4):
        run._admit()
        run._step()
    s, drafter = run.slots, run.sources.get("mtp").drafter      # the MTP heads behind the "mtp" source
    n = s.n
    drafter.propose(n, s.lengths[:n], 1, lambda logits, depth: (logits.argmax(-1), None))   # runs the fill
    assert engine.last_stats.accepted[0] > 0
    target, heads = engine.target, engine.heads
    for slot in range(n):
        row = s.rows[slot]
        length = int(s.lengths[slot])
        seq = torch.tensor(row.prompt_ids + row.tokens)[None]          # t_0 .. t_L (t_L uncached)
        assert seq.shape[1] == length + 1
        hidden = target.forward_full(seq[:, :length])                  # h_0 .. h_{L-1}
        prev, next_ids = hidden, seq[:, 1:length + 1]
        for c, head in enumerate(heads):
            ref = KVCache(1, 1, length, head.self_attn.num_kv_heads, head.self_attn.head_dim, torch.float32, "cpu")
            # head k has no entry for the first k positions (no head k-1 output before them)
            has_entry = (torch.arange(length) >= c)[None]
            out = head(prev, next_ids, Batch.make(torch.arange(length)[None], key_valid=has_entry), ref, 0)
            valid = drafter.valid[c, slot, :length]
            assert valid[c:].all() and not valid[:c].any()
            torch.testing.assert_close(drafter.cache.k[c, slot, :, c:length], ref.k[0, 0, :, c:], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(drafter.cache.v[c, slot, :, c:length], ref.v[0, 0, :, c:], rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(drafter.carry[c, slot], out[0, -1], rtol=1e-4, atol=1e-4)
            prev = torch.cat([torch.zeros_like(out[:, :1]), out[:, :-1]], dim=1)


@torch.no_grad()
@pytest.mark.parametrize("backlog", [64, 2])
def test_plain_steps_are_filled_at_the_next_draft_and_a_full_backlog_leaves_a_gap(tmp_path, monkeypatch, backlog):
    """At the first draft after gamma-0 steps both heads get entries for those steps' positions
    (the backlog), chained on as if they had drafted throughout. A backlog of 2 tokens holds only
    the newest two plain steps: the one before them is a gap, and head 2 takes no carry across
    it (its first entry after the gap would need head 1's output before it)."""
    import pipeline.engine.drafter as drafter_module
    monkeypatch.setattr(drafter_module, "BACKLOG_TOKENS", backlog)
    path = tiny_checkpoint(str(tmp_path), arch="qwen3", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    prompts = random_prompts([5, 9, 3], 128, seed=8)
    rows = [Row(i, p, 40, RequestOutput()) for i, p in enumerate(prompts)]
    run = GenerateRun(engine, rows, SamplingParams(max_new_tokens=40, ignore_eos=True), FixedGamma(3))
    for gamma in (3, 3, 0, 0, 0, 0, 0):
        run.policy = FixedGamma(gamma)
        run._admit()
        run._step()
    s, drafter = run.slots, run.sources.get("mtp").drafter      # the MTP heads behind the "mtp" source
    n = s.n
    drafter.propose(n, s.lengths[:n], 1, lambda logits, depth: (logits.argmax(-1), None))
    for slot in range(n):
        last = int(s.lengths[slot]) - 1                  # the last step's position
        if backlog == 64:                                # every plain step's position, both heads
            assert drafter.valid[:, slot, last - 4:last + 1].all()
        else:                                            # the newest plain steps, after a gap
            head1 = drafter.valid[0, slot, :last + 1].tolist()
            gap = max(i for i, ok in enumerate(head1) if not ok)
            assert last - 3 <= gap <= last - 2               # 1 or 2 plain steps' tokens kept, as they fell
            assert drafter.valid[0, slot, gap + 1:last + 1].all()
            assert not drafter.valid[1, slot, gap + 1] and drafter.valid[1, slot, gap + 2:last + 1].all()


@torch.no_grad()
@pytest.mark.parametrize("budgets,schedule,most_held", [
    ([9, 14, 6, 11, 8], [2, 0, 0, 1, 0, 0, 0, 3, 0, 2, 0, 0, 1, 1, 0, 0, 0, 2, 0, 0, 0, 0, 3, 0], 1),
    ([40, 34, 12, 37, 30], [2] + [0] * 20 + [3] + [0] * 40 + [1, 0, 0], 2),
    ([45, 20, 43, 46, 42], [0] * 24 + [2, 0, 0, 3] + [0] * 12, 16)])        # plain runs past the backlog's size, held; a row ends
def test_a_steps_held_column_leaves_the_heads_as_the_fill_built_at_once(tmp_path, monkeypatch, budgets, schedule,
                                                                        most_held):
    """A step whose rows kept one token each hands the heads its column as it is
    (Drafter.add_column), and a plain step that follows holds it in the backlog unwritten
    (Backlog.add_column), written only where a draft or a general append needs it (rows that
    move or end are followed in host lists), and dropped unwritten where the backlog overflows.
    Over plain and drafted steps, five rows of different budgets through three slots, the heads'
    caches, masks, carries and backlog and every output equal those where each step builds its fill."""
    from pipeline.engine.drafter import Backlog, Drafter, PendingFill
    path = tiny_checkpoint(str(tmp_path), arch="qwen3", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    prompts = random_prompts([5, 9, 3, 7, 4], 128, seed=3)

    def run_all():
        engine = Engine.from_pretrained(path, device="cpu", max_batch_size=3)
        rows = [Row(i, p, b, RequestOutput()) for i, (p, b) in enumerate(zip(prompts, budgets))]
        run = GenerateRun(engine, rows, SamplingParams(max_new_tokens=max(budgets), ignore_eos=True), FixedGamma(3))
        drafter = run.sources.get("mtp").drafter
        seen = []
        for i in range(200):
            if not (run.queue or run.slots.n):
                break
            run.policy = FixedGamma(schedule[i % len(schedule)])
            run._admit()
            run._step()
            seen.append((dict(drafter.backlog.tokens), drafter.column is not None))
            held.append(len(drafter.backlog.held))
        drafter.backlog._flush()
        return [r.tokens for r in rows], drafter, seen

    held, overflowed = [], []
    real_add_column = Backlog.add_column

    def add_column(self, *a, **k):
        got = real_add_column(self, *a, **k)
        overflowed.append(got)
        return got
    monkeypatch.setattr(Backlog, "add_column", add_column)
    tokens, lazy, seen = run_all()
    assert any(h for _, h in seen) and any(t for t, _ in seen)           # columns held, backlogs appended
    assert max(held) >= most_held                                        # backlog columns held unwritten
    assert (most_held < 16) or any(overflowed)                            # ... and dropped unwritten

    def at_once(self, n, start, hidden, next_ids):                          # the fill built at every step
        self.add_pending(PendingFill(torch.arange(n), start, hidden, next_ids,
                                     torch.ones_like(start), slots=list(range(n)), counts=[1] * n))
    monkeypatch.setattr(Drafter, "add_column", at_once)
    want, eager, seen_eager = run_all()
    assert tokens == want
    assert [t for t, _ in seen] == [t for t, _ in seen_eager]
    for name in ("valid", "carry", "carry_ok", "gap"):
        assert torch.equal(getattr(lazy, name), getattr(eager, name)), name
    valid = lazy.valid[:, :, None, :lazy.cache.capacity, None]            # what attention reads of the
    for name in ("k", "v"):                                                  # heads' caches (the rest is masked)
        got, want_ = getattr(lazy.cache, name), getattr(eager.cache, name)
        assert torch.equal(got * valid, want_ * valid), name
    assert lazy.backlog.tokens == eager.backlog.tokens
    for slot, k in lazy.backlog.tokens.items():                      # what a fill would read (the rest is stale)
        for name in ("hidden", "ids"):
            assert torch.equal(getattr(lazy.backlog, name)[slot, :k], getattr(eager.backlog, name)[slot, :k]), name
        assert lazy.backlog.start[slot] == eager.backlog.start[slot]


@torch.no_grad()
def test_rows_ending_and_moving_during_plain_steps_write_none_of_the_heads_held_columns(tmp_path, monkeypatch):
    """Four rows admitted together decode plainly with the heads ready to draft (a policy that
    may speculate) while they end one by one, the last rows moving into the holes: the heads'
    held columns are written nowhere and the last step's column is never turned into a fill.
    Counted, not timed: at 32 rows each such write was ~0.2 ms of host time (docs/decisions.md,
    stop 60)."""
    from pipeline.engine.drafter import Backlog, Drafter
    path = tiny_checkpoint(str(tmp_path), arch="qwen3", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    budgets = [12, 6, 9, 14]
    rows = [Row(i, p, b, RequestOutput()) for i, (p, b) in enumerate(zip(random_prompts([5, 9, 3, 7], 128, seed=6),
                                                                          budgets))]
    run = GenerateRun(engine, rows, SamplingParams(max_new_tokens=max(budgets), ignore_eos=True), FixedGamma(2))
    writes, fills = [], []
    real_flush, real_to_pending = Backlog._flush, Drafter._column_to_pending

    def flush(self):
        writes.append(len(self.held))
        real_flush(self)

    def to_pending(self):
        fills.append(self.column is not None)
        real_to_pending(self)
    monkeypatch.setattr(Backlog, "_flush", flush)
    monkeypatch.setattr(Drafter, "_column_to_pending", to_pending)
    run.policy = FixedGamma(0)                   # the heads are built for gamma 2; every step is plain
    moved = []
    real_move = Slots._move
    monkeypatch.setattr(Slots, "_move", lambda self, src, dst: (moved.append((src, dst)), real_move(self, src, dst)))
    held, backlog = [], run.sources.get("mtp").drafter.backlog
    while run.queue or run.slots.n:
        run._admit()
        run._step()
        held.append(len(backlog.held))
    assert moved and all(r.finished for r in rows)          # rows ended in the middle and others moved
    assert not any(writes) and not any(fills)
    assert [len(r.tokens) for r in rows] == budgets
    assert max(held) >= 5                                      # the backlog held the plain steps' columns


def test_a_call_reusing_the_last_calls_caches_generates_what_a_fresh_engine_does(tmp_path):
    """Caches are kept between calls; whatever a slot held before is masked until overwritten."""
    path = tiny_checkpoint(str(tmp_path), arch="qwen3", num_mtp_layers=2, draftable=0.1, with_tokenizer=False)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    first, second = random_prompts([30, 25, 28, 31], 128, seed=4), random_prompts([5, 9, 3, 12, 7], 128, seed=5)
    used = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    used.generate(first, params, gamma=3)
    caches = dict(used._caches)
    for gamma in (3, 0, 2):
        fresh = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
        want = [o.token_ids for o in fresh.generate(second, params, gamma=gamma)]
        assert [o.token_ids for o in used.generate(second, params, gamma=gamma)] == want
        assert [o.num_accepted_tokens for o in used.generate(second, params, gamma=gamma)] == \
               [o.num_accepted_tokens for o in fresh.generate(second, params, gamma=gamma)]
    assert all(used._caches[k] is c for k, c in caches.items())         # the same buffers throughout


def test_a_row_moved_into_a_hole_brings_its_cached_positions_and_only_those():
    """Slots.compact moves the last active row into a finished row's slot: positions
    0..length-1 of every layer come along; the rest of the slot (stale, masked until
    overwritten) is not copied, however large the held cache."""
    cache = KVCache(2, 3, 16, 1, 2, torch.float32, "cpu")
    for slot in range(3):
        cache.k[:, slot], cache.v[:, slot] = 10.0 * slot + torch.arange(16.0)[:, None], -1.0 - slot
    slots = Slots(3, "cpu", None, cache)
    rows = [Row(i, [1, 2, 3], 8, RequestOutput()) for i in range(3)]
    slots.place([0, 1, 2], rows, torch.tensor([4, 9, 5]), torch.tensor([7, 7, 7]))
    rows[0].finished = True
    slots.release_finished()
    slots.compact()
    assert slots.rows[:2] == [rows[2], rows[1]] and slots.n == 2 and slots.lengths[0] == 5
    assert torch.equal(cache.k[:, 0, :, :5], 20.0 + torch.arange(5.0)[:, None].expand(2, 1, 5, 2))
    assert (cache.v[:, 0, :, :5] == -3).all()
    assert torch.equal(cache.k[:, 0, :, 5:], torch.arange(5.0, 16.0)[:, None].expand(2, 1, 11, 2))   # slot 0's own
    assert (cache.v[:, 0, :, 5:] == -1).all()


@torch.no_grad()
@pytest.mark.parametrize("gamma", [0, 2])
def test_rows_moved_into_holes_copy_their_cached_tokens_and_generate_as_a_fresh_engine(tmp_path, monkeypatch, gamma):
    """A finished row's hole is filled by the last active row. The engine's held cache is sized
    for its largest call, so a move copies the moved row's cached tokens, not the capacity; the
    output is a fresh engine's (which holds a cache of this call's size)."""
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    limit = Engine.from_pretrained(path, device="cpu").config.max_position_embeddings
    params = SamplingParams(max_new_tokens=10, ignore_eos=True)
    prompts = random_prompts([limit - 3, 5, limit - 7, 6, 4], 128, seed=8)   # the long ones finish early
    used = Engine.from_pretrained(path, device="cpu", max_batch_size=5)
    used.generate(random_prompts([limit - 12] * 5, 128, seed=3), SamplingParams(max_new_tokens=12, ignore_eos=True),
                  gamma=0)                                 # a held cache of the largest capacity
    moves, real = [], KVCache.move_row

    def recording(self, src, dst, length=None):
        if self is used._caches["target"]:
            moves.append((length, self.capacity))
        return real(self, src, dst, length)

    monkeypatch.setattr(KVCache, "move_row", recording)
    got = [o.token_ids for o in used.generate(prompts, params, gamma=gamma)]
    want = [o.token_ids for o in Engine.from_pretrained(path, device="cpu", max_batch_size=5).generate(
        prompts, params, gamma=gamma)]
    assert got == want
    assert moves and all(length is not None and length <= 20 < capacity for length, capacity in moves)


@torch.no_grad()
def test_calls_whose_needs_differ_by_a_few_positions_or_rows_share_the_held_caches(tmp_path):
    """A held cache is replaced only when a call needs more than it has. Positions are rounded up
    to CACHE_STEP, so a call at gamma 3 after one at gamma 0 (three positions more) or a smaller
    batch allocates nothing; a new cache covers the old one's rows too where that at most doubles
    it, so one long prompt after a full batch of short ones gets a one-row cache."""
    from pipeline.engine.engine import CACHE_STEP
    path = tiny_checkpoint(str(tmp_path), arch="llama", num_mtp_layers=1, draftable=0.1, with_tokenizer=False)
    engine = Engine.from_pretrained(path, device="cpu", max_batch_size=4)
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    short = random_prompts([30, 25, 28, 31], 128, seed=4)
    engine.generate(short, params, gamma=0)
    target = engine._caches["target"]
    assert target.capacity == CACHE_STEP and target.k.shape[1] == 4           # 31 + 12 + 2 positions, rounded
    engine.generate(short, params, gamma=3)
    heads = engine._caches["heads"]
    engine.generate(random_prompts([9, 12], 128, seed=5), params, gamma=2)
    assert engine._caches["target"] is target and engine._caches["heads"] is heads
    engine.generate(random_prompts([90], 128, seed=6), params, gamma=0)      # 4 x 128 would be 4x the need
    assert tuple(engine._caches["target"].k.shape[1:4:2]) == (1, 2 * CACHE_STEP)
    engine.generate(short, params, gamma=0)                                  # 4 x 128 is 2x the need: covered
    assert tuple(engine._caches["target"].k.shape[1:4:2]) == (4, 2 * CACHE_STEP)
