"""Self-distillation math for MTP heads: unrolled chained drafting, losses, acceptance.

Depth k at position i (DeepSeek-V3): the head takes prev_hidden = the depth k-1 output at i
(the target's hidden h_i for k = 1) and the token t_{i+k}, and predicts t_{i+k+1}. Its teacher
is the target's own distribution at position i + k, i.e. target_logits[:, i + k].

With a draft vocabulary (`vocab`: the sorted ids the heads will draft over, pipeline.model.draft_vocab)
the heads train as they draft: their logits over the subset only, against the teacher's
distribution renormalised over the subset, and the argmax term only where the teacher's argmax
lies inside it (elsewhere no draft can be accepted). On the demo (6,144 tokens, 2,048 drafted) a
training step costs 0.45x the full-vocabulary one: the output projection and the softmaxes over
[batch, length, V] are most of a head's step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.model.mtp import head_for_depth


def unrolled_head_logits(heads, hidden: torch.Tensor, ids: torch.Tensor, depths: int,
                         vocab: torch.Tensor | None = None, keep: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Chain the heads over depths 1..depths on whole sequences (gradients flow through the chain).

    hidden: [B, T, H] target hidden states; ids: [B, T]. Returns per depth k logits
    [B, T - k, V] (or [B, T - k, Vd] over `vocab`), where entry i predicts ids[:, i + k + 1]
    (teacher: target logits at i + k). A head reused across depths (fewer heads than depths) is
    applied again to its own output. `keep` [B, T] bool (indexed by the teacher's position
    i + k): only those entries' logits, [N_k, V or Vd] in row-major order. The heads still run
    on every position (later positions attend to them); the output projection, most of a
    step, runs where a loss is taken.
    """
    t = ids.shape[1]
    prev, out = hidden, []
    for k in range(1, depths + 1):
        head = heads[head_for_depth(len(heads), k)]
        h = head.forward_full(prev[:, : t - k], ids[:, k:])          # [B, T - k, H]
        x = h if keep is None else h[keep[:, k:]]
        out.append(head.logits(x) if vocab is None else head.subset_logits(x, vocab))
        prev = h
    return out


def depth_weights(depths: int, decay: float) -> list[float]:
    """Loss weight per depth, later depths weighted down: [1, decay, decay^2, ...]."""
    return [decay ** k for k in range(depths)]


def teacher_targets(teacher_logits: torch.Tensor, vocab: torch.Tensor | None = None):
    """The teacher as the heads train against it: (its logits over `vocab`, or all V where None,
    [B, T, Vd or V]; the index of its full-vocabulary argmax among them [B, T], -1 where it lies
    outside `vocab`). Taken once a step for every depth. Example: vocab [2, 5], argmax 5 -> 1,
    argmax 3 -> -1."""
    want = teacher_logits.argmax(-1)                                   # [B, T] over V
    if vocab is None:
        return teacher_logits, want
    slot = torch.full((teacher_logits.shape[-1],), -1, dtype=torch.long, device=vocab.device)
    slot[vocab] = torch.arange(vocab.numel(), device=vocab.device)
    return teacher_logits[..., vocab], slot[want]


def distill_loss(head_logits: torch.Tensor, teacher: torch.Tensor, want: torch.Tensor, weights: torch.Tensor,
                 ce_weight: float) -> torch.Tensor:
    """KL(teacher || head) plus ce_weight * CE(head, teacher argmax), weighted mean over positions.

    head_logits, teacher: [B, L, V] or both over a draft vocabulary [B, L, Vd]; want: [B, L] the
    teacher's argmax among them, -1 where it lies outside (no argmax term there: `teacher_targets`);
    weights: [B, L] (0 on padding).
    """
    logq = F.log_softmax(head_logits.float(), dim=-1)
    logp = F.log_softmax(teacher.float(), dim=-1)
    kl = (logp.exp() * (logp - logq)).sum(-1)                          # [B, L]
    ce = -logq.gather(-1, want.clamp(min=0)[..., None]).squeeze(-1) * (want >= 0)   # [B, L]
    per_pos = kl + ce_weight * ce
    return (per_pos * weights).sum() / weights.sum().clamp_min(1e-6)


def mtp_loss(heads, hidden, teacher_logits, ids, weights, depths: int, decay: float,
             ce_weight: float, vocab: torch.Tensor | None = None,
             keep: torch.Tensor | None = None) -> tuple[torch.Tensor, list[float]]:
    """Weighted sum over depths of distill_loss. weights: [B, T] per-position weights of ids
    (0 on padding); depth k's position i uses the weight of position i + k; `vocab`: the draft
    vocabulary the heads train over (None: all). `keep` [B, T] bool: the positions that carry a
    loss, where teacher_logits is [N, V] at those positions in row-major order (the target's
    output projection skipped elsewhere); None: teacher_logits [B, T, V]. With keep = weights > 0
    the loss is the same as without. Returns the loss and the per-depth values (floats, for
    logging)."""
    total, parts = 0.0, []
    if keep is None:                  # every position, the teacher's rows in row-major order
        keep = torch.ones(ids.shape, dtype=torch.bool, device=ids.device)
        teacher_logits = teacher_logits.flatten(0, 1)
    teacher, want = teacher_targets(teacher_logits, vocab)
    row = keep.flatten().cumsum(0).view_as(keep) - 1                    # position -> teacher row
    for k, (lg, w) in enumerate(zip(unrolled_head_logits(heads, hidden, ids, depths, vocab, keep),
                                    depth_weights(depths, decay)), start=1):
        sel = keep[:, k:]
        r = row[:, k:][sel]
        lk = distill_loss(lg, teacher[r], want[r], weights[:, k:][sel], ce_weight)
        total = total + w * lk
        parts.append(float(lk.detach()))
    return total / sum(depth_weights(depths, decay)), parts


@torch.no_grad()
def teacher_forced_acceptance(heads, hidden, teacher_logits, ids, mask, depths: int,
                              vocab: torch.Tensor | None = None) -> list[float]:
    """Greedy per-depth acceptance a_k estimated on whole sequences, drafting from every position.

    Draft k from position i is right when the head's argmax (over `vocab` where given, as it
    drafts) equals the target's argmax at i + k; a_k = P(draft k right | drafts 1..k-1 right).
    mask: [B, T] bool, positions whose drafts count (e.g. the generated part). Returns
    [a_1, ..., a_depths].
    """
    t = ids.shape[1]
    logits = unrolled_head_logits(heads, hidden, ids, depths, vocab)
    want = teacher_logits.argmax(-1)                                   # [B, T]
    alive = mask[:, : t - depths].clone()                              # drafts all depths fit
    out = []
    for k, lg in enumerate(logits, start=1):
        draft = lg[:, : t - depths].argmax(-1)
        if vocab is not None:
            draft = vocab[draft]
        right = draft == want[:, k: k + t - depths]
        n_before = alive.sum().item()
        alive = alive & right
        out.append(alive.sum().item() / max(1, n_before))
    return out
