"""Rebuild the shipped demo from scratch: dataset, tokenizer, base model, MTP heads.

Stages: the held-out dataset (`data`), a BPE tokenizer, a small Llama trained from scratch
(`base`), task fine-tuning (`sft`), optionally grown deeper and trained at that depth
(`deepen`, pipeline/demo/grow.py: a deep target at the cost of training a shallow one), the MTP
head (`mtp`), bfloat16 weights on disk (`store`), the heads' prompt window measured on the
held-out data (`window`, pipeline.model.draft_window) and the held-out acceptance report (`eval`).

    python -m pipeline.run +job=build_demo          # the Hydra job (conf/job/build_demo.yaml)
    python -m pipeline.demo.build [--work-dir DIR] [--stages data,tokenizer,base,sft,deepen,mtp,eval]
    python -m pipeline.demo.build --stages vocab    # only a draft vocabulary for the shipped heads
    python -m pipeline.demo.build --stages store,eval   # re-store the weights, re-measure what ships
    python -m pipeline.demo.build --stages window   # only the heads' prompt window (draft_window.json)

Every stage is seeded and skips work it finds done in `work_dir` (the base model's training
resumes from its last checkpoint), so an interrupted build continues where it stopped.
"""
from __future__ import annotations

import argparse
import json
import shutil
import time
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

ASSETS = Path(__file__).resolve().parents[1] / "assets" / "demo"
STAGES = ("data", "tokenizer", "base", "sft", "deepen", "mtp", "store", "window", "eval")
EXTRA_STAGES = ("vocab",)   # on request only: a draft vocabulary for heads built before they had one


@dataclass(frozen=True)
class BuildSpec:
    work_dir: Path = Path("runs/build_demo/work")
    model_dir: Path = ASSETS / "model"
    data_path: Path = ASSETS / "data" / "demo.parquet"
    stages: tuple[str, ...] = STAGES  # subset of STAGES to run
    heldout_percent: int = 15         # percent of functions held out (by a stable hash)
    seed: int = 0
    threads: int = 2
    device: str = "cpu"               # cpu | cuda | auto (base, sft and MTP training, evaluation)
    base: dict = field(default_factory=dict)       # BaseTrainSpec overrides
    sft: dict = field(default_factory=dict)        # SFT_SPEC overrides (task fine-tuning)
    model: dict = field(default_factory=dict)      # BaseModelSpec overrides
    mtp: dict = field(default_factory=dict)        # MTPTrainSpec overrides
    deepen: dict = field(default_factory=dict)     # num_layers (0: no deepen stage) + DEEPEN_SPEC overrides
    eval: dict = field(default_factory=dict)       # evaluate_acceptance keyword overrides
    draft_vocab_size: int = 2048      # the "vocab" stage's size (the mtp stage uses mtp.draft_vocab_size)
    store_dtype: str = "bfloat16"     # the "store" stage's weight dtype on disk (loads compute in float32)


def build(spec: BuildSpec, log=print) -> dict:
    import torch

    from pipeline.demo.corpus import demo_rows, tokenizer_texts, write_demo_parquet
    from pipeline.demo.extract import extract_functions
    from pipeline.demo.tokenizer import train_tokenizer
    from pipeline.demo.train_base import (DEEPEN_SPEC, SFT_SPEC, BaseModelSpec, BaseTrainSpec, sft_examples,
                                          train_base_model)

    from pipeline.model.loader import resolve_device
    torch.set_num_threads(spec.threads)
    dev = resolve_device(spec.device)
    work = Path(spec.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    times, t0 = {}, time.time()
    result = {"times_s": times}
    records = extract_functions(heldout_percent=spec.heldout_percent)
    log(f"extracted {len(records)} functions ({sum(r.heldout for r in records)} held out)")
    if "data" in spec.stages:
        rows = demo_rows(records, seed=spec.seed)
        write_demo_parquet(rows, Path(spec.data_path))
        log(f"wrote {len(rows)} held-out rows to {spec.data_path}")
    times["data"] = time.time() - t0

    model_spec = BaseModelSpec(**spec.model)
    tok_dir = work / "tokenizer"
    if "tokenizer" in spec.stages and not (tok_dir / "tokenizer.json").exists():
        t = time.time()
        tokenizer_texts_ = tokenizer_texts(records)
        train_tokenizer(tokenizer_texts_, model_spec.vocab_size).save_pretrained(str(tok_dir))
        times["tokenizer"] = time.time() - t
    base_dir, sft_dir = work / "base_model", work / "sft_model"
    if "base" in spec.stages and not (base_dir / "config.json").exists():
        t = time.time()
        train_spec = BaseTrainSpec(**{"seed": spec.seed, **spec.base})
        tokenizer, examples = _examples(tok_dir, records, train_spec.block_len)
        log(f"{len(examples)} training examples, {sum(len(e.ids) for e in examples)} tokens")
        train_base_model(examples, tokenizer, base_dir, work, model_spec, train_spec, log=log,
                         device=str(dev))
        times["base"] = time.time() - t
    if "sft" in spec.stages and not (sft_dir / "config.json").exists():
        t = time.time()
        sft_spec = replace(SFT_SPEC, **{"seed": spec.seed, **spec.sft})
        tokenizer, examples = _examples(tok_dir, records, sft_spec.block_len)
        train_base_model(sft_examples(examples), tokenizer, sft_dir, work, model_spec, sft_spec,
                         log=log, init_dir=base_dir, name="sft", device=str(dev))
        times["sft"] = time.time() - t
    trained_dir = sft_dir if (sft_dir / "config.json").exists() else base_dir
    deep = dict(spec.deepen)
    deep_layers, deep_dir = int(deep.pop("num_layers", 0) or 0), work / "deep_model"
    if "deepen" in spec.stages and deep_layers and not (deep_dir / "config.json").exists():
        from pipeline.demo.grow import grow_checkpoint
        t = time.time()
        grown = grow_checkpoint(trained_dir, work / "grown_init", deep_layers)
        deepen_spec = replace(DEEPEN_SPEC, **{"seed": spec.seed, **deep})
        tokenizer, examples = _examples(tok_dir, records, deepen_spec.block_len)
        log(f"deepen: {trained_dir.name} grown to {deep_layers} layers")
        train_base_model(sft_examples(examples), tokenizer, deep_dir, work, model_spec, deepen_spec,
                         log=log, init_dir=grown, name="deepen", device=str(dev))
        times["deepen"] = time.time() - t
    if deep_layers and (deep_dir / "config.json").exists():
        trained_dir = deep_dir
    if "mtp" in spec.stages:
        from pipeline.demo.mtp_prompts import stdlib_prompts
        from pipeline.training.train_mtp import MTPTrainSpec, train_mtp_into
        t = time.time()
        model_dir = Path(spec.model_dir)
        if model_dir.exists():
            shutil.rmtree(model_dir)
        shutil.copytree(trained_dir, model_dir)
        mtp_spec = MTPTrainSpec(**{"seed": spec.seed, **spec.mtp})
        train_p, eval_p = stdlib_prompts(records, mtp_spec)
        result["mtp"] = train_mtp_into(model_dir, train_p, eval_p, mtp_spec, work / "mtp",
                                       device=str(dev), log=log)
        times["mtp"] = time.time() - t
    if "store" in spec.stages:
        store_weights(Path(spec.model_dir), spec.store_dtype, log=log)
    if "vocab" in spec.stages:
        write_corpus_draft_vocab(Path(spec.model_dir), records, spec.draft_vocab_size, log=log)
    if "window" in spec.stages:          # before eval: the prior is measured as the engine will draft
        result["draft_window"] = write_window(Path(spec.model_dir), Path(spec.data_path), str(dev), log)
    if "eval" in spec.stages:
        from pipeline.demo.evaluate import evaluate_acceptance
        from pipeline.engine.params import DEFAULT_GAMMA_MAX
        t = time.time()
        opts = {"device": str(dev), "gamma": 3, **spec.eval}
        prior_gamma = int(opts.pop("prior_gamma", DEFAULT_GAMMA_MAX))
        result["acceptance"] = evaluate_acceptance(Path(spec.model_dir), Path(spec.data_path), log=log, **opts)
        measured = result["acceptance"]
        if prior_gamma != opts["gamma"]:      # the prior covers every depth "auto" may run, not the report's
            measured = evaluate_acceptance(Path(spec.model_dir), Path(spec.data_path), log=log,
                                           **{**opts, "gamma": prior_gamma, "examples": 0})
            result["prior_acceptance"] = {t: {k: r[k] for k in ("gamma", "acceptance_by_depth", "mean_acceptance_length")}
                                          for t, r in measured.items()}
        from pipeline.demo.prior import write_eval_prior
        write_eval_prior(spec.model_dir, measured)     # the heads' prior ships with them
        times["eval"] = time.time() - t
    result["total_s"] = time.time() - t0
    (work / "build_result.json").write_text(json.dumps(result, indent=2, default=str))
    log(json.dumps(result, indent=2, default=str))
    return result


def store_weights(model_dir: Path, dtype: str, log=print) -> None:
    """Cast the floating-point tensors of model_dir's safetensors files to `dtype` in place.
    config.json keeps its compute dtype (float32), so transformers and the engine load the
    bfloat16 weights into float32 modules: half the bytes on disk, the same arithmetic after.
    The values are also ones float16 holds (`storable`), so CPU inference may run them through
    a float16-weight GEMM (pipeline.model.packed) and still compute this checkpoint.
    The eval stage runs after this one, so the reported acceptance is that of what ships."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    dt = getattr(torch, dtype)
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            meta = f.metadata()
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        stored = {k: storable(t, dt) if t.is_floating_point() else t for k, t in tensors.items()}
        if all(torch.equal(stored[k], t) and stored[k].dtype == t.dtype for k, t in tensors.items()):
            continue
        save_file(stored, str(path), metadata=meta)
        log(f"stored {path.name} as {dtype}: {path.stat().st_size / 2**20:.1f} MiB")


def write_window(model_dir: Path, data_path: Path, device: str, log, **kw) -> int:
    """The heads' prompt window (pipeline.model.draft_window), measured on the held-out data
    with whole prompts and the bench's long ones, stored as draft_window.json. `kw`:
    pipeline.bench.draft_window.measure_windows's settings."""
    from pipeline.bench.draft_window import markdown, measure_windows, tokens_per_step
    from pipeline.engine import Engine
    from pipeline.model.draft_window import choose_window, write_draft_window
    opts = {"tasks": ("summarize", "complete", "json"), "windows": (0, 32, 64, 128, 256), **kw}
    engine = Engine.from_pretrained(model_dir, device=device, max_batch_size=kw.get("batch", 8))
    cells = measure_windows(engine, str(data_path), **opts)
    measured = tokens_per_step(cells, opts["windows"])
    chosen = choose_window(measured)
    write_draft_window(model_dir, chosen, measured, f"pipeline.demo.build window stage on {data_path.name}")
    log(f"window: heads read each prompt's last {chosen or 'all'} tokens\n{markdown(cells, opts['windows'])}")
    return chosen


def storable(t, dt):
    """`t` cast to `dt`, rounded to values float16 holds as well when `dt` is bfloat16.

    Both formats hold every bfloat16 value from 2^-14 up to 65,504; below 2^-14 float16's grid
    (2^-24) is coarser than bfloat16's, so such a weight moves by at most 2^-25 (3e-8): the
    bfloat16 3.2037e-6 becomes 3.2187e-6. A tensor with values past float16's range stays
    plain bfloat16."""
    import torch
    if dt != torch.bfloat16 or t.abs().max() >= 65504:
        return t.to(dt)
    return t.to(torch.float16).to(torch.bfloat16)


def write_corpus_draft_vocab(model_dir: Path, records, size: int, log=print):
    """draft_vocab.json from the base model's training corpus (the tokenizer's texts): the mtp
    stage writes one from the heads' own training sequences; this one needs no MTP training."""
    from transformers import AutoTokenizer

    from pipeline.demo.corpus import tokenizer_texts
    from pipeline.model.draft_vocab import build_draft_vocab
    tok = AutoTokenizer.from_pretrained(str(model_dir))
    ids = tok(tokenizer_texts(records))["input_ids"]
    path = build_draft_vocab(model_dir, ids, size, "demo training corpus (tokenizer texts)",
                             always=[tok.eos_token_id])
    log(f"draft vocabulary of {size} tokens written to {path}")


def _examples(tok_dir: Path, records, block_len: int):
    from transformers import AutoTokenizer

    from pipeline.demo.corpus import tokenized_examples
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    return tokenizer, tokenized_examples(records, tokenizer, block_len)


def spec_from_mapping(m: dict) -> BuildSpec:
    known = {f.name for f in fields(BuildSpec)}
    unknown = set(m) - known
    if unknown:
        raise ValueError(f"unknown build_demo keys {sorted(unknown)}; known: {sorted(known)}")
    out = {k: v for k, v in m.items() if v is not None}
    for k in ("work_dir", "model_dir", "data_path"):
        if k in out:
            out[k] = Path(out[k])
    if "stages" in out:
        out["stages"] = tuple(out["stages"])
        bad = set(out["stages"]) - set(STAGES + EXTRA_STAGES)
        if bad:
            raise ValueError(f"unknown stages {sorted(bad)}; known: {STAGES + EXTRA_STAGES}")
    return replace(BuildSpec(), **out)


def run_job(cfg) -> int:
    """Hydra recipe `build_demo` (jobs/build_demo.py): the `demo:` keys are BuildSpec fields."""
    from omegaconf import OmegaConf
    build(spec_from_mapping(OmegaConf.to_container(cfg.demo, resolve=True)))
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work-dir", default=str(BuildSpec.work_dir))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--base-steps", type=int, default=None)
    ap.add_argument("--sft-steps", type=int, default=None)
    ap.add_argument("--mtp-steps", type=int, default=None)
    a = ap.parse_args(argv)
    spec = spec_from_mapping({"work_dir": a.work_dir, "stages": a.stages.split(","),
                              "threads": a.threads,
                              "base": {"steps": a.base_steps} if a.base_steps else {},
                              "sft": {"steps": a.sft_steps} if a.sft_steps else {},
                              "mtp": {"steps": a.mtp_steps} if a.mtp_steps else {}})
    build(spec)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
