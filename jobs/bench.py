"""Recipe `bench` (and `bench_quick`): the engine against transformers generate(), prompt lookup,
every fixed gamma and auto. Writes bench.md, bench.json and bench_plots.html to output.dir.

    python -m pipeline.run +job=bench            # the full matrix (long on a CPU: run it on a GPU)
    python -m pipeline.run +job=bench_quick      # a small matrix, minutes on a CPU

The harness is pipeline/bench/; benchmarks/*.py are its other command-line entries.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from pipeline.bench.report import write_all
from pipeline.bench.runner import BenchSpec, machine_info, run_matrix


def spec_from(cfg) -> BenchSpec:
    """The matrix's settings: `bench.*`, with the model, data, output folder and device of the run."""
    raw = OmegaConf.to_container(cfg.bench, resolve=True)
    return BenchSpec(model_path=cfg.model.path, data_path=cfg.data.path, out_dir=cfg.output.dir, device=cfg.model.device,
                     **{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})


def main(cfg) -> int:
    spec = spec_from(cfg)
    result = run_matrix(spec)
    print(write_all(result, Path(spec.out_dir), machine_info(spec, result)))
    print(f"wrote {spec.out_dir}/bench.md, bench.json, bench_plots.html")
    return 0
