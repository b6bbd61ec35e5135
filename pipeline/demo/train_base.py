"""Train the demo's small Llama from scratch on the training split, seeded and resumable.

Examples (task prompts + answers, raw function sources, documentation topics) are packed whole
into blocks of `block_len` tokens; the loss is next-token cross-entropy with answer tokens of
task examples weighted up. Checkpoints (model, optimiser, step) go to `work_dir` every
`save_every` steps and a rerun resumes from the latest one.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from pipeline.demo.corpus import Example


@dataclass(frozen=True)
class BaseModelSpec:
    vocab_size: int = 6144
    hidden_size: int = 256
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    intermediate_size: int = 768
    max_position_embeddings: int = 1024


@dataclass(frozen=True)
class BaseTrainSpec:
    steps: int = 1100
    batch_size: int = 16           # blocks per step
    block_len: int = 512           # tokens per block
    lr: float = 2e-3
    min_lr_ratio: float = 0.1
    warmup: int = 50
    weight_decay: float = 0.1
    answer_weight: float = 2.0     # loss weight of answer tokens in task examples
    prompt_weight: float = 1.0     # loss weight of prompt tokens in task examples
    summary_repeat: int = 2        # summarize examples appear this many times per epoch
    save_every: int = 50
    seed: int = 0
    bf16: bool = True              # bfloat16 autocast (fast on CPUs with avx512_bf16 / on CUDA)


# Task fine-tuning after the base phase: task examples (answers weighted, prompts down) plus a
# third of the raw sources, a short decaying schedule from a lower peak.
SFT_SPEC = BaseTrainSpec(steps=220, lr=1e-3, warmup=10, min_lr_ratio=0.05, answer_weight=1.0,
                         prompt_weight=0.25, summary_repeat=3)


# Depth up-scaling (pipeline.demo.grow) after task fine-tuning: the grown model trains on the
# fine-tuning mix with the fine-tuning peak, long enough for the new (zero-output) layers to
# take part. Steps and peak: docs/decisions.md (2026-12-02, stop 29).
DEEPEN_SPEC = replace(SFT_SPEC, steps=300, warmup=20, min_lr_ratio=0.1)


def sft_examples(examples: list[Example]) -> list[Example]:
    """The fine-tuning mix: every task example and every third raw example (stable)."""
    raw = [e for e in examples if e.task == "raw"]
    return [e for e in examples if e.task != "raw"] + raw[::3]


def llama_config(spec: BaseModelSpec):
    from transformers import LlamaConfig

    from pipeline.demo.tokenizer import BOS_ID, EOS_ID, PAD_ID
    cfg = LlamaConfig(
        vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size, num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
        head_dim=spec.hidden_size // spec.num_heads,
        max_position_embeddings=spec.max_position_embeddings, rope_theta=10000.0,
        tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID,
        initializer_range=0.02)
    cfg.architectures = ["LlamaForCausalLM"]
    return cfg


def pack_blocks(examples: list[Example], block_len: int, rng: random.Random) -> list[list[tuple[int, int]]]:
    """Shuffle examples and pack them whole, in order, into blocks of at most block_len tokens.
    Returns per block a list of (example index, offset in block)."""
    order = list(range(len(examples)))
    rng.shuffle(order)
    blocks, cur, used = [], [], 0
    for i in order:
        n = len(examples[i].ids)
        if used + n > block_len and cur:
            blocks.append(cur)
            cur, used = [], 0
        cur.append((i, used))
        used += n
    if cur:
        blocks.append(cur)
    return blocks


def block_tensors(examples: list[Example], block, block_len: int, answer_weight: float,
                  prompt_weight: float = 1.0):
    """ids [block_len], targets [block_len], weights [block_len] for one packed block.
    weights[t] is the loss weight for predicting targets[t] = ids[t + 1]; 0 on padding and
    across example boundaries, answer_weight on answers of task examples."""
    ids = torch.zeros(block_len + 1, dtype=torch.long)
    w = torch.zeros(block_len + 1)
    for i, off in block:
        ex = examples[i]
        n = len(ex.ids)
        ids[off: off + n] = torch.tensor(ex.ids)
        ew = torch.ones(n)
        if ex.answer_start > 1:
            ew[: ex.answer_start] = prompt_weight
            ew[ex.answer_start:] = answer_weight
        ew[0] = 0.0                      # bos is never a target
        w[off: off + n] = ew
    return ids[:-1], ids[1:], w[1:]


def chunked_lm_loss(hidden: torch.Tensor, head: torch.nn.Module, targets: torch.Tensor, weights: torch.Tensor,
                    chunk: int = 2048) -> torch.Tensor:
    """Weighted mean cross-entropy of head(hidden) against targets: hidden [B, T, H], targets and
    weights [B, T]. The logits are made `chunk` tokens at a time: the full [B, T, V] logits in
    float32 (200 MB at 16 x 512 x 6144) and their copies cost ~15% of a CPU training step."""
    h, t, w = hidden.flatten(0, 1), targets.flatten(), weights.flatten()
    total = hidden.new_zeros((), dtype=torch.float32)
    for s in range(0, h.shape[0], chunk):
        ce = F.cross_entropy(head(h[s:s + chunk]).float(), t[s:s + chunk], reduction="none")
        total = total + (ce * w[s:s + chunk]).sum()
    return total / w.sum().clamp_min(1.0)


def lr_at(step: int, spec: BaseTrainSpec) -> float:
    """Linear warmup, then cosine decay to min_lr_ratio * lr."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    p = (step - spec.warmup) / max(1, spec.steps - spec.warmup)
    return spec.lr * (spec.min_lr_ratio + (1 - spec.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


class BatchStream:
    """Deterministic batches: epoch e packs with Random(seed + e); step s maps to a fixed slice."""

    def __init__(self, examples: list[Example], spec: BaseTrainSpec):
        reps = [e for e in examples for _ in range(spec.summary_repeat if _is_summary(e) else 1)]
        self.examples, self.spec = reps, spec
        self._epoch, self._blocks = -1, []
        first = pack_blocks(reps, spec.block_len, random.Random(spec.seed))
        self.steps_per_epoch = len(first) // spec.batch_size

    def batch(self, step: int):
        s = self.spec
        epoch, k = divmod(step, self.steps_per_epoch)
        if epoch != self._epoch:
            self._epoch = epoch
            self._blocks = pack_blocks(self.examples, s.block_len, random.Random(s.seed + epoch))
        rows = [block_tensors(self.examples, b, s.block_len, s.answer_weight, s.prompt_weight)
                for b in self._blocks[k * s.batch_size:(k + 1) * s.batch_size]]
        return tuple(torch.stack(x) for x in zip(*rows)), epoch


def _is_summary(e: Example) -> bool:
    return e.task == "summarize"


def train_base_model(examples: list[Example], tokenizer, out_dir: Path, work_dir: Path,
                     model_spec: BaseModelSpec = BaseModelSpec(),
                     spec: BaseTrainSpec = BaseTrainSpec(), log=print, init_dir: Path | None = None,
                     name: str = "base", device: str = "cpu") -> Path:
    """Train (or resume) and save a LlamaForCausalLM + tokenizer to out_dir. With init_dir, start
    from that checkpoint instead of a fresh model (the task fine-tuning phase)."""
    from tqdm import tqdm
    from transformers import GenerationConfig, LlamaForCausalLM

    torch.manual_seed(spec.seed)
    if init_dir is not None:
        model = LlamaForCausalLM.from_pretrained(str(init_dir), dtype=torch.float32)
    else:
        model = LlamaForCausalLM(llama_config(model_spec))
    dev = torch.device(device)
    model.to(dev)                                  # before the optimiser: its state follows params
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": spec.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)
    work_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, start = work_dir / f"{name}_train.pt", 0
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = int(state["step"])
        log(f"resuming {name} training at step {start}/{spec.steps}")
    stream = BatchStream(examples, spec)
    model.train()
    bar = tqdm(range(start, spec.steps), initial=start, total=spec.steps, desc=f"{name} model",
               dynamic_ncols=True, mininterval=5.0)
    t0, ema = time.time(), None
    for step in bar:
        (ids, targets, weights), epoch = stream.batch(step)
        ids, targets, weights = ids.to(dev), targets.to(dev), weights.to(dev)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, spec)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=spec.bf16):
            hidden = model.model(input_ids=ids).last_hidden_state
            loss = chunked_lm_loss(hidden, model.lm_head, targets, weights)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.95 * ema + 0.05 * loss.item()
        bar.set_postfix(loss=f"{ema:.3f}", epoch=epoch)
        if (step + 1) % spec.save_every == 0 or step + 1 == spec.steps:
            tmp = ckpt_path.with_suffix(".tmp")
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": step + 1}, tmp)
            tmp.replace(ckpt_path)
    log(f"{name} training: {spec.steps - start} steps in {time.time() - t0:.0f}s, loss {ema}")
    model.eval()
    out_dir.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=model.config.bos_token_id,
                                               eos_token_id=model.config.eos_token_id,
                                               pad_token_id=model.config.pad_token_id)
    model.cpu().save_pretrained(str(out_dir))
    tokenizer.save_pretrained(str(out_dir))
    return out_dir
