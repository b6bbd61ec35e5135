"""Batched speculative decoding with draft sources: MTP heads and n-gram matches (no Ray needed).

`Engine` (and with it torch) is imported on first use, so the run configuration can use
`SamplingParams` without loading torch.
"""
from pipeline.engine.params import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str):
    if name == "Engine":
        from pipeline.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'pipeline.engine' has no attribute {name!r}")
