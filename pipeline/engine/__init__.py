"""Batched speculative decoding with MTP draft heads (no Ray needed)."""
from pipeline.engine.engine import Engine
from pipeline.engine.params import RequestOutput, SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams"]
