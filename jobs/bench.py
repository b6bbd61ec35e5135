"""Recipe `bench` (and `bench_quick`): the engine against transformers generate(), prompt lookup,
every fixed gamma and auto. Writes bench.md, bench.json and bench_plots.html to output.dir.

    python -m pipeline.run +job=bench            # the full matrix (long on a CPU: run it on a GPU)
    python -m pipeline.run +job=bench_quick      # a small matrix, minutes on a CPU
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

from pipeline.bench.report import write_all
from pipeline.bench.runner import BenchSpec, device_description, run_matrix


def main(cfg) -> int:
    raw = OmegaConf.to_container(cfg.bench, resolve=True)
    spec = BenchSpec(model_path=cfg.model.path, data_path=cfg.data.path, out_dir=cfg.output.dir, device=cfg.model.device,
                     **{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
    result = run_matrix(spec)
    engine, roof = result["engine"], result["roofline"]
    machine = {"device": device_description(engine), "dtype": str(engine.dtype).replace("torch.", ""),
               "flops": roof.flops, "bandwidth": roof.bandwidth, "params": roof.params,
               "model": Path(spec.model_path).name, "max_new_tokens": spec.max_new_tokens, "reps": spec.reps}
    text = write_all(result, Path(spec.out_dir), machine)
    print(text)
    print(f"wrote {spec.out_dir}/bench.md, bench.json, bench_plots.html")
    return 0
