"""The MTP heads as a draft source: the chained heads of pipeline.engine.drafter behind the
drafter protocol. Every row drafts the same number of tokens (the heads run for all rows)."""
from __future__ import annotations

import torch

from pipeline.engine.drafter import Drafter, PendingFill
from pipeline.engine.drafters.base import DraftRequest, Proposal
from pipeline.spec_decode.sampling import GREEDY_PICK


class MTPSource:
    name = "mtp"
    deterministic = False
    needs_hidden = True
    cost_per = "depth"

    def __init__(self, drafter: Drafter, prompt_window: int = 0):
        """prompt_window: the heads read only each prompt's last this many tokens (0: all of it;
        `after_prefill`)."""
        self.drafter = drafter
        self.prompt_window = prompt_window

    @classmethod
    def for_engine(cls, engine, rows: int, capacity: int, coupled: bool = False,
                   held_cache: bool = False) -> MTPSource:
        """The engine's heads drafting for `rows` slots of `capacity` tokens. `held_cache`: the
        heads' KV cache the engine holds between generate calls, else a new one (a profile's).
        `coupled`: picks over all V columns (coupled noise is keyed by token id)."""
        heads = engine.heads
        attn = heads[0].self_attn
        cache = (engine.kv_cache("heads", len(heads), rows, capacity, attn.num_kv_heads, attn.head_dim)
                 if held_cache else None)
        drafter = Drafter(heads, rows, capacity, engine.config.hidden_size, engine.dtype, engine.device, cache=cache)
        drafter.full_vocab_picks = coupled
        return cls(drafter, getattr(engine, "draft_window", 0) or 0)

    def propose(self, req: DraftRequest) -> Proposal:
        drafts, probs = self.drafter.propose(req.n, req.lengths, req.max_len, req.pick)   # [n, g]
        draft_len = torch.full((req.n,), req.max_len, dtype=torch.long, device=drafts.device)
        return Proposal(drafts, draft_len, probs)

    def probe(self, rows: int, depth: int, ctx: int):
        """One step's drafting at context `ctx`: every head's fill over the depth + 1 tokens a
        step accepts at most, then `depth` drafts with their logits (greedy picks), as a
        generate call runs it. Needs rows <= the slots and ctx + depth < the capacity built for."""
        d = self.drafter
        dev, q = d.carry.device, depth + 1
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, d.heads[0].vocab_size, (rows, q), generator=gen).to(dev)      # [rows, q]
        hidden = torch.zeros(rows, q, d.carry.shape[-1], dtype=d.carry.dtype, device=dev)       # [rows, q, H]
        fill = PendingFill(torch.arange(rows, device=dev), torch.full((rows,), max(ctx - q, 0), device=dev),
                           hidden, tokens, torch.full((rows,), q, device=dev),
                           slots=list(range(rows)), counts=[q] * rows)       # as `after_verify` gives them
        lengths = torch.full((rows,), ctx, device=dev)

        def run():
            d.add_pending(fill)
            return d.propose(rows, lengths, depth, GREEDY_PICK)
        return run

    def after_prefill(self, slots, hidden, ids, lens, first) -> None:
        """The prompts' fill, run at their rows' first draft. With a prompt window W, a prompt
        longer than W is filled from position len - W only: the heads' keys before it stay
        masked, as a gap's do. The fill is work only drafting pays, ~1/L of the target's prefill
        (one layer against L), and a head may draft better from the recent tokens alone: the demo's
        heads kept or gained acceptance with W = 64 on prompts of ~20-440 tokens, at a quarter of
        the fill on the long ones (docs/decisions.md, stop 57). Drafts only propose: the text is the
        same at every W.
        Example: lens [10, 3], W 4: row 0 fills positions 6..9, row 1 positions 0..2."""
        idx = torch.arange(len(lens), device=lens.device)
        next_ids = torch.cat([ids[:, 1:], ids[:, :1]], dim=1)
        next_ids[idx, lens - 1] = first
        counts = lens.tolist()
        w = self.prompt_window
        if not w or max(counts) <= w:
            fill = PendingFill(slots, torch.zeros_like(lens), hidden, next_ids, lens, from_zero=True, prompt=True)
        else:
            start = (lens - w).clamp(min=0)                                          # [r]
            width = min(w, hidden.shape[1])
            cols = (start[:, None] + torch.arange(width, device=lens.device)).clamp(max=hidden.shape[1] - 1)
            counts = [min(c, w) for c in counts]
            fill = PendingFill(slots, start, hidden[idx[:, None], cols], next_ids[idx[:, None], cols],
                               lens.clamp(max=w), prompt=True)
        self.drafter.add_prompt(fill, slots.tolist(), counts)

    def after_verify(self, n, lengths, hidden, emitted, num_accepted, accepted) -> None:
        """The step's accepted tokens wait for the heads' fill, cut to the most any row accepted:
        positions past that are masked anyway, and a padded verify of 8-wide n-gram drafts whose
        rows kept at most 3 would otherwise be filled 9 wide. `accepted`: num_accepted on the host."""
        w = max(accepted) + 1 if n else 0
        if w == 1:                                   # one token a row (every plain step): no fill built yet
            if hidden.shape[1] > 1:                  # (a verify of drafts none of which was kept)
                hidden, emitted = hidden[:, :1], emitted[:, :1]
            self.drafter.add_column(n, lengths.clone(), hidden, emitted)
            return
        self.drafter.add_pending(PendingFill(torch.arange(n, device=lengths.device), lengths.clone(),
                                             hidden[:, :w], emitted[:, :w], num_accepted + 1,
                                             slots=list(range(n)), counts=[a + 1 for a in accepted]))

    def skip(self) -> None:
        self.drafter.discard_pending()

    def reset_rows(self, rows) -> None:
        self.drafter.reset_rows(rows)

    def move_row(self, src: int, dst: int) -> None:
        self.drafter.move_row(src, dst)

    def drop_rows(self, rows) -> None:
        self.drafter.drop_rows(rows)

    def finish_rows(self, rows) -> None:
        pass

    def waiting_tokens(self) -> dict[int, int]:
        """Per slot, the prompt and skipped-step tokens the heads run before its next draft."""
        d = self.drafter
        if not (d.prompts or d.backlog):
            return {}
        out = dict(d.prompts.tokens)
        for slot, k in d.backlog.tokens.items():
            out[slot] = out.get(slot, 0) + k
        return out

    def take_prompt_fill(self) -> tuple[float, int]:
        return self.drafter.take_prompt_fill()

    def last_fill_tokens(self) -> int:
        return self.drafter.step_fill_tokens
