"""`+job=train_mtp`: train DeepSeek-layout MTP heads for a checkpoint by self-distillation.

1. The frozen target generates greedy continuations of a prompt set (the sequences the heads
   will draft for at inference time).
2. Heads are trained unrolled over depths 1..K to match the target's own distribution at every
   position (KL + CE on its argmax; generated positions weighted up, later depths down).
3. The heads are written into the checkpoint in DeepSeek naming (`model.layers.{N + k}.*`),
   and per-depth acceptance on held-out sequences is reported.
Resumable: generated sequences and head/optimiser checkpoints live in `work_dir`.
"""
from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pipeline.training.mtp_math import mtp_loss, teacher_forced_acceptance
from pipeline.spec_decode.policy import expected_tokens


@dataclass(frozen=True)
class MTPTrainSpec:
    num_heads: int = 1             # heads written to the checkpoint; the last is reused beyond
    depths: int = 3                # depths trained (unrolled); >= num_heads
    steps: int = 500
    batch_size: int = 16
    group_batches: int = 64        # batches drawn from runs of this many, sorted by length (1: random)
    max_prompt_tokens: int = 320   # prompts are left-truncated to this
    max_new_tokens: int = 48       # greedy continuation generated per prompt
    num_prompts: int = 1536        # training prompts (from the training split)
    # Demo prompts per task (stdlib prompts only): summaries are ~12 tokens against 48 for
    # `complete`, so an equal share would leave them a seventh of the generated positions; json
    # answers are the easiest to draft and need the least.
    task_shares: dict = field(default_factory=lambda: {"summarize": 0.5, "complete": 0.3, "json": 0.2})
    num_eval: int = 96             # held-out sequences for the acceptance report
    lr: float = 1e-3
    warmup: int = 20
    depth_decay: float = 0.6       # loss weight of depth k: decay^(k-1)
    ce_weight: float = 0.5
    gen_weight: float = 3.0        # loss weight of generated positions vs prompt positions
    save_every: int = 50
    seed: int = 0
    bf16: bool = True
    cache_hidden: bool = True      # the frozen target runs once per sequence, not once per step (cached_hidden)
    draft_vocab_size: int = 2048   # heads train and draft over the N most frequent training tokens (0: all);
                                   # 2048 on the demo: +13% tokens/s at gamma 3 (docs/decisions.md)


def greedy_sequences(model, tokenizer, prompts: list[str], max_prompt_tokens: int,
                     max_new_tokens: int, batch_size: int = 32, desc: str = "generate"):
    """Greedy continuations with transformers' generate (identical to the engine at gamma 0).
    Returns a list of (ids [L] LongTensor, prompt_len) pairs, eos-trimmed, in `prompts` order.
    Prompts run in batches of similar length: less left padding, and a batch of short answers
    stops early (a random batch runs until its longest answer ends)."""
    from tqdm import tqdm
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    enc = [tokenizer(p)["input_ids"] for p in prompts]
    enc = [e[:1] + e[1:][-(max_prompt_tokens - 1):] for e in enc]           # keep bos
    order = sorted(range(len(enc)), key=lambda i: len(enc[i]))
    out: list = [None] * len(enc)
    for s in tqdm(range(0, len(order), batch_size), desc=desc, dynamic_ncols=True, mininterval=5.0):
        idx = order[s: s + batch_size]
        width = max(len(enc[i]) for i in idx)
        ids = torch.tensor([[pad] * (width - len(enc[i])) + enc[i] for i in idx])     # left padding
        att = (torch.arange(width)[None, :] >= torch.tensor([width - len(enc[i]) for i in idx])[:, None]).long()
        dev = model.device
        with torch.no_grad():
            gen = model.generate(input_ids=ids.to(dev), attention_mask=att.to(dev), do_sample=False,
                                 max_new_tokens=max_new_tokens, eos_token_id=eos, pad_token_id=pad)
        for i, row in zip(idx, gen[:, width:].cpu().tolist()):
            if eos in row:
                row = row[: row.index(eos) + 1]
            out[i] = (torch.tensor(enc[i] + row), len(enc[i]))
    return out


def collate(seqs, gen_weight: float):
    """Right-pad (ids, prompt_len) pairs: ids [B, T], weights [B, T], generated-mask [B, T]."""
    t = max(len(s) for s, _ in seqs)
    ids = torch.zeros(len(seqs), t, dtype=torch.long)
    w = torch.zeros(len(seqs), t)
    gen = torch.zeros(len(seqs), t, dtype=torch.bool)
    for i, (s, p) in enumerate(seqs):
        ids[i, : len(s)] = s
        w[i, : len(s)] = 1.0
        w[i, p - 1: len(s)] = gen_weight        # the last prompt position drafts the first answer
        gen[i, p - 1: len(s)] = True
    return ids, w, gen


@torch.no_grad()
def cached_hidden(target, seqs, batch_size: int = 16, bf16: bool = True) -> list[torch.Tensor]:
    """The frozen target's hidden states of each (ids, prompt_len) sequence, [L_i, hidden] on
    the CPU, computed once in batches of similar length. Training draws ~5 batches per sequence
    (500 steps x 16 of 1,536), so a deep target's forward is paid once instead of every step:
    on the 12-layer demo target it was about a third of a step. Positions past a sequence's
    end do not reach its states (causal), so they equal the per-step forward's."""
    dev = target.model.norm.weight.device
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i][0]))
    out: list[torch.Tensor | None] = [None] * len(seqs)
    for s in range(0, len(order), batch_size):
        idx = order[s: s + batch_size]
        ids, _, _ = collate([seqs[i] for i in idx], 1.0)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            h = target.forward_full(ids.to(dev))                      # [b, T, hidden]
        for j, i in enumerate(idx):
            out[i] = h[j, : len(seqs[i][0])].cpu().clone()
    return out


def stack_hidden(rows: list[torch.Tensor], length: int) -> torch.Tensor:
    """[L_i, hidden] rows -> [B, length, hidden], zeros past each row's end (weight 0 there)."""
    out = rows[0].new_zeros(len(rows), length, rows[0].shape[-1])
    for i, r in enumerate(rows):
        out[i, : r.shape[0]] = r
    return out


def length_grouped_batches(lengths: list[int], batch_size: int, steps: int, seed: int,
                           group: int) -> list[list[int]]:
    """Sequence indices for each of `steps` batches: epochs of a seeded shuffle, each run of
    group x batch_size sequences sorted by length and cut into batches, those batches shuffled
    again. A batch is padded to its longest sequence, so random batches of the demo's lengths
    (33 to 368 tokens) are a third real tokens; grouped in 64s, 97%. Every sequence still comes
    once per epoch. group <= 1: plain random batches (the same shuffle, no sort).
    Example: lengths [5, 50, 6, 60], batch 2, group 2 -> batches {5, 6} and {50, 60} in some order."""
    rng, out = random.Random(seed), []
    span = batch_size * max(group, 1)
    while len(out) < steps:
        order = list(range(len(lengths)))
        rng.shuffle(order)
        epoch = []
        for s in range(0, len(order), span):
            chunk = order[s: s + span]
            if group > 1:
                chunk.sort(key=lambda i: lengths[i])
            epoch += [chunk[b: b + batch_size] for b in range(0, len(chunk), batch_size)]
        rng.shuffle(epoch)
        out += [b for b in epoch if len(b) == batch_size] or epoch
    return out[:steps]


def train_mtp_heads(loaded, train_seqs, eval_seqs, spec: MTPTrainSpec, work_dir: Path, log=print,
                    vocab: torch.Tensor | None = None):
    """Train spec.num_heads fresh heads on `loaded.target`; returns (heads, eval acceptance).
    `vocab`: the draft vocabulary the heads will draft over, trained and evaluated over
    (pipeline.training.mtp_math); None: the full vocabulary."""
    from tqdm import tqdm

    from pipeline.model.mtp import MTPHead
    target = loaded.target
    dev = target.model.norm.weight.device
    for p in target.parameters():
        p.requires_grad_(False)
    torch.manual_seed(spec.seed)
    heads = torch.nn.ModuleList(MTPHead.from_target(target, loaded.config) for _ in range(spec.num_heads))
    opt = torch.optim.AdamW(heads.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=0.01)
    ckpt, start = work_dir / "mtp_train.pt", 0
    if ckpt.exists():
        state = torch.load(ckpt, map_location="cpu", weights_only=True)
        heads.load_state_dict(state["heads"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        log(f"resuming MTP training at step {start}/{spec.steps}")
    for h in heads:
        h.bind(target).train()
    bar = tqdm(range(start, spec.steps), initial=start, total=spec.steps, desc="mtp heads",
               dynamic_ncols=True, mininterval=5.0)
    ema = None
    cache = cached_hidden(target, train_seqs, spec.batch_size, spec.bf16) if spec.cache_hidden and start < spec.steps else None
    schedule = length_grouped_batches([len(s) for s, _ in train_seqs], spec.batch_size, spec.steps,
                                      spec.seed, spec.group_batches)
    for step in bar:
        picks = schedule[step]                                   # batch depends only on (data, seed, step)
        ids, w, _ = collate([train_seqs[i] for i in picks], spec.gen_weight)
        ids, w = ids.to(dev), w.to(dev)
        lr = spec.lr * min(1.0, (step + 1) / spec.warmup) * (0.1 + 0.9 * (1 - step / spec.steps))
        for g in opt.param_groups:
            g["lr"] = lr
        with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=spec.bf16):
            with torch.no_grad():
                if cache is None:
                    hidden = target.forward_full(ids)
                else:
                    hidden = stack_hidden([cache[i] for i in picks], ids.shape[1]).to(dev)
                keep = w > 0                                    # no output projection on padding
                teacher = target.logits(hidden[keep])
            loss, parts = mtp_loss(heads, hidden, teacher, ids, w, spec.depths, spec.depth_decay,
                                   spec.ce_weight, vocab, keep)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(heads.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.9 * ema + 0.1 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", d1=f"{parts[0]:.2f}", dK=f"{parts[-1]:.2f}")
        if (step + 1) % spec.save_every == 0 or step + 1 == spec.steps:
            tmp = ckpt.with_suffix(".tmp")
            torch.save({"heads": heads.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            tmp.replace(ckpt)
    heads.eval()
    acc = evaluate_heads(target, heads, eval_seqs, spec.depths, vocab=vocab)
    return heads, acc


@torch.no_grad()
def evaluate_heads(target, heads, seqs, depths: int, batch_size: int = 16,
                   vocab: torch.Tensor | None = None) -> list[float]:
    """Teacher-forced greedy per-depth acceptance over the generated parts of `seqs`."""
    right, total = [0.0] * depths, [0.0] * depths
    for s in range(0, len(seqs), batch_size):
        ids, _, gen = collate(seqs[s: s + batch_size], 1.0)
        dev = target.model.norm.weight.device
        ids, gen = ids.to(dev), gen.to(dev)
        hidden = target.forward_full(ids)
        teacher = target.logits(hidden)
        n = gen[:, : ids.shape[1] - depths].sum().item()
        acc = teacher_forced_acceptance(heads, hidden, teacher, ids, gen, depths, vocab)
        alive = n
        for k, a in enumerate(acc):
            total[k] += alive
            right[k] += alive * a
            alive *= a
    return [r / max(t, 1e-9) for r, t in zip(right, total)]


def data_prompts(path: str, template: str | None, column: str, spec: MTPTrainSpec):
    """Prompts from a Parquet dataset (`data.path`): the last num_eval rows are held out."""
    import pyarrow.parquet as pq
    rows = pq.read_table(path).to_pylist()
    ps = [template.format(**r) if template else r[column] for r in rows]
    held = ps[-spec.num_eval:]
    train = ps[: len(ps) - len(held)]
    random.Random(spec.seed).shuffle(train)
    return train[: spec.num_prompts], held


def train_mtp_into(model_dir: Path, train_prompts: list[str], eval_prompts: list[str],
                   spec: MTPTrainSpec, work_dir: Path, device: str = "cpu", log=print) -> dict:
    """Generate, train and write heads into `model_dir` (a checkpoint directory, edited in place)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pipeline.model.loader import load_model, resolve_device
    from pipeline.model.mtp import save_mtp_heads
    dev = resolve_device(device)
    work_dir.mkdir(parents=True, exist_ok=True)
    seq_path = work_dir / "sequences.pt"
    if seq_path.exists():
        data = torch.load(seq_path, weights_only=False)
    else:
        t = time.time()
        tok = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=False)
        hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32,
                                                  trust_remote_code=False).to(dev).eval()
        data = {"train": greedy_sequences(hf, tok, train_prompts, spec.max_prompt_tokens, spec.max_new_tokens),
                "eval": greedy_sequences(hf, tok, eval_prompts, spec.max_prompt_tokens, spec.max_new_tokens,
                                         desc="generate (held out)")}
        torch.save(data, seq_path)
        del hf
        log(f"generated {len(data['train'])} + {len(data['eval'])} greedy sequences in {time.time() - t:.0f}s")
    loaded = load_model(model_dir, device=dev, dtype=torch.float32, draft_vocab=False)
    from pipeline.model.draft_vocab import FILE, choose_draft_vocab, save_draft_vocab
    vocab, counts = choose_draft_vocab([ids for ids, _ in data["train"]], loaded.config.vocab_size,
                                       spec.draft_vocab_size, always=loaded.config.eos_token_ids)
    heads, acc = train_mtp_heads(loaded, data["train"], data["eval"], spec, work_dir, log=log,
                                 vocab=None if vocab is None else vocab.to(dev))
    save_mtp_heads(model_dir, [h.float().cpu() for h in heads])
    (model_dir / FILE).unlink(missing_ok=True)          # new heads never draft over an old corpus's subset
    if vocab is not None:
        save_draft_vocab(model_dir, vocab, "MTP training sequences", counts)
    from pipeline.demo.prior import write_heldout_prior
    write_heldout_prior(model_dir, eval_prompts, max_new_tokens=spec.max_new_tokens, device=str(dev), log=log)
    report = {"teacher_forced_acceptance": [round(a, 4) for a in acc],
              "expected_tokens_per_step_gamma3": round(expected_tokens(acc, 3), 3)}
    log(f"MTP heads written to {model_dir}: {report}")
    return report


def main(cfg) -> int:
    """Hydra recipe `train_mtp`: heads for `model.path` (edited in place); keys under `mtp:`."""
    from omegaconf import OmegaConf
    opts = OmegaConf.to_container(cfg.get("mtp", {}) or {}, resolve=True)
    work = Path(opts.pop("work_dir", "runs/train_mtp/work"))
    torch.set_num_threads(int(opts.pop("threads", 2)))
    source = opts.pop("prompt_source", "stdlib")
    spec = MTPTrainSpec(**opts)
    if source == "stdlib":
        from pipeline.demo.extract import extract_functions
        from pipeline.demo.mtp_prompts import stdlib_prompts
        train_p, eval_p = stdlib_prompts(extract_functions(), spec)
    elif source == "data":
        train_p, eval_p = data_prompts(str(cfg.data.path), cfg.data.get("template"),
                                       cfg.data.get("prompt_column", "prompt"), spec)
    else:
        raise ValueError(f"mtp.prompt_source must be 'stdlib' or 'data', got {source!r}")
    train_mtp_into(Path(cfg.model.path), train_p, eval_p, spec, work, device=cfg.model.get("device", "cpu"))
    return 0
