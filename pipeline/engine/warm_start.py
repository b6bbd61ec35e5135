"""What lets a fresh engine's first `gamma="auto"` call start warm: the checkpoint's acceptance
prior (`spec_prior.json`, pipeline.model.spec_prior) and a cost profile cached on disk.

The profile depends on the device, the checkpoint, the dtype, torch's thread count and the
shapes profiled (gamma_max, context), so those key the cache, which holds each batch size's
records as they are measured (an engine profiles only the batch sizes its calls reach); the checkpoint
enters as a fingerprint of its config and weight files (names, sizes and their first 64 KiB),
so a retrained checkpoint in the same directory is profiled again, and so does the code that
runs the step (`code_fingerprint`): a profile measured by an older engine prices steps that no
longer exist. The cache lives under
`$SPECBATCH_CACHE/profiles` (default `~/.cache/specbatch/profiles`); a file that cannot be
read or written only costs a fresh profile. Only the first profile of an engine is taken from
the cache: a re-profile (the tracker found the old one stale) is measured, and replaces it.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from dataclasses import asdict
from functools import lru_cache
from pathlib import Path

import torch

from pipeline.engine.profile import profile_costs, rows_grid
from pipeline.model.spec_prior import read_spec_prior
from pipeline.spec_decode.evidence import PRIOR_ROW_STEPS
from pipeline.spec_decode.plan import scaled_counts, spread_weight
from pipeline.spec_decode.prior_mix import PriorMixture
from pipeline.spec_decode.stats import SpecStats, StepRecord

_FORMAT = 1
EXPLORE_ROWS = 8        # calls of at most this many rows with nothing profiled measure on their own steps


def checkpoint_prior(path, task: str | None = None) -> SpecStats | None:
    """`task`'s held-out acceptance from `path/spec_prior.json`, at most PRIOR_ROW_STEPS
    row-steps (as the driver's plan weighs it); for a task the file does not hold, or None,
    all tasks pooled, weighing what the tasks' spread allows (`spread_weight`, at most
    PRIOR_ROW_STEPS: tasks far apart make a weak prior); None without the file."""
    if path is None:
        return None
    tasks = read_spec_prior(path)
    if not tasks or "*" not in tasks:
        return None
    if task is not None and task != "*" and task in tasks:
        reached, accepted = scaled_counts(*tasks[task], PRIOR_ROW_STEPS, whole=False)
        return SpecStats(list(reached), list(accepted)) if reached and reached[0] else None
    weight = spread_weight({k: v for k, v in tasks.items() if k != "*"}, PRIOR_ROW_STEPS)
    reached, accepted = scaled_counts(*tasks["*"], weight, whole=False)
    return SpecStats(list(reached), list(accepted)) if reached and reached[0] else None


def checkpoint_mixture(path) -> PriorMixture | None:
    """Every task of `path/spec_prior.json` as one component (at most PRIOR_ROW_STEPS row-steps, as
    a named task's prior), plus all tasks pooled as `checkpoint_prior` weighs them: the prior of
    a call that names no task the file holds (pipeline.spec_decode.prior_mix). None without the
    file or with fewer than two tasks (nothing to tell apart)."""
    tasks = read_spec_prior(path) if path is not None else None
    named = {k: v for k, v in (tasks or {}).items() if k != "*" and v[0] and v[0][0]}
    if len(named) < 2:
        return None
    parts = [(name, scaled_counts(*counts, PRIOR_ROW_STEPS, whole=False)) for name, counts in sorted(named.items())]
    parts.append(("*", scaled_counts(*tasks["*"], spread_weight(named, PRIOR_ROW_STEPS), whole=False)))
    return PriorMixture(tuple(parts))


def cache_dir() -> Path:
    base = os.environ.get("SPECBATCH_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "specbatch")
    return Path(base) / "profiles"


def checkpoint_fingerprint(path) -> str:
    """A hash of the checkpoint's config, weight files and draft vocabulary (names, sizes, first
    64 KiB): a draft vocabulary changes what a draft depth costs."""
    h = hashlib.sha256()
    root = Path(path)
    for f in sorted(root.glob("*")):
        if f.name in ("config.json", "draft_vocab.json") or f.suffix in (".safetensors", ".bin", ".pt"):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
            with open(f, "rb") as fh:
                h.update(fh.read(1 << 16))
    return h.hexdigest()[:24]


STEP_CODE = ("model", "engine", "spec_decode/cost.py")    # under pipeline/: what a profile times


def step_code_files() -> list[Path]:
    """The source files that run a step (STEP_CODE under pipeline/): Python, and the C kernels
    (pipeline/model/half_gemm.c) that the engine compiles."""
    root = Path(__file__).resolve().parents[1]
    out = []
    for part in STEP_CODE:
        p = root / part
        out += sorted([*p.rglob("*.py"), *p.rglob("*.c")]) if p.is_dir() else [p]
    return out


@lru_cache(maxsize=1)
def code_fingerprint() -> str:
    """A hash of `step_code_files`, once per process."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in step_code_files():
        h.update(f.relative_to(root).as_posix().encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:24]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    return f"cpu:{platform.machine()}:{platform.processor() or '?'}:{os.cpu_count()}"


def cpu_kernels() -> str:
    """Which kernels a CPU step runs in this process: the C library's rows per pass (8: AVX-512,
    6: AVX2; 0: none, e.g. SPECBATCH_NATIVE=0 or no compiler) and the float16-weight GEMM. Same
    code, other kernels: a demo step at batch 1 cost 5.0 ms without the C kernels and 2.0 ms with
    them on one CPU (docs/decisions.md, stop 51), so one's profile misprices the other."""
    from pipeline.model import native, packed
    return f"native:{native.rows_per_pass()}|fp16:{packed.fp16_kernel()}"


def profile_key(engine, context_len: int) -> str | None:
    """The cache key of this engine's profile; None when the checkpoint has no path."""
    path = getattr(engine.model, "path", None)
    if path is None or not Path(path).is_dir():
        return None
    from pipeline.model import native
    parts = [device_name(engine.device), str(engine.dtype), str(native.thread_count()),
             str(engine.gamma_max), str(context_len), checkpoint_fingerprint(path), code_fingerprint()]
    if engine.device.type == "cpu":
        parts.append(cpu_kernels())
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:32]


def load_profile(key: str | None) -> list[StepRecord] | None:
    if key is None:
        return None
    try:
        body = json.loads((cache_dir() / f"{key}.json").read_text())
        if body.get("format") != _FORMAT:
            return None
        return [StepRecord(**r) for r in body["records"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def save_profile(key: str | None, records: list[StepRecord]) -> None:
    if key is None:
        return
    try:
        folder = cache_dir()
        folder.mkdir(parents=True, exist_ok=True)
        tmp = folder / f".{key}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps({"format": _FORMAT, "records": [asdict(r) for r in records]}))
        os.replace(tmp, folder / f"{key}.json")
    except OSError:
        pass


def explores(engine, batch: int) -> bool:
    """Whether a call of `batch` rows that finds no profile anywhere measures its costs on its
    own steps instead: at most EXPLORE_ROWS rows (a profile costs more than such a call's
    decoding, 0.2-0.5 s of bare forwards on a CPU against a few steps a row), an engine with
    nothing profiled yet, and gamma_max >= 2 (the policy's exploration, pipeline.spec_decode.policy,
    runs gamma 0, gamma_max and one between until the cost model has three shapes to fit)."""
    return batch <= EXPLORE_ROWS and not engine.costs.profile and engine.gamma_max >= 2


def ensure_profile(engine, context_len: int = 128, rows: int | None = None, explore: bool = False) -> None:
    """Give `engine.costs` a profile of every batch size of `rows_grid(rows)` (default: up to
    max_batch_size): those it lacks are taken from the disk cache, else measured and cached.
    A stale profile is replaced whole, by measuring (the cache holds what went stale). With
    `explore`, a call of a few `rows` with nothing profiled or cached takes no profile
    (`explores`): its steps are the measurements, and the model is fitted from them alone."""
    costs = engine.costs
    stale = costs.needs_profile()
    have = set() if stale else {r.rows for r in costs.profile}
    batch = min(rows or engine.max_batch_size, engine.max_batch_size)
    missing = [r for r in rows_grid(batch) if r not in have]
    if not missing:
        return
    key = profile_key(engine, context_len)
    on_disk = load_profile(key) or []
    cached = [r for r in on_disk if r.rows in missing] if costs.profiles_taken == 0 or not stale else []
    measure = [r for r in missing if r not in {c.rows for c in cached}]
    if measure and not cached and explore and explores(engine, batch):
        return
    measured = (profile_costs(engine, engine.max_batch_size, engine.gamma_max, context_len, rows_list=measure)
                if measure else [])
    if measured:
        save_profile(key, [r for r in on_disk if r.rows not in measure] + measured)
    if stale:
        costs.set_profile(cached + measured)
    else:
        costs.extend_profile(cached + measured)
    costs.profile_cached = not measured
