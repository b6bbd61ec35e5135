"""Recipe `build_demo`: rebuild the shipped demo model, MTP heads and dataset from scratch.

    python -m pipeline.run +job=build_demo [demo.base.steps=450 demo.threads=2 ...]
"""
from pipeline.demo.build import run_job as main  # noqa: F401
