"""Tests in tests/gpu need CUDA; without it every test here is skipped (not failed).
SPECBATCH_GPU_TESTS_DEVICE=cpu runs them on the CPU instead, to check the tests themselves on a
machine without a GPU (what they assert of CUDA they skip there)."""
import os
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OVERRIDE = os.environ.get("SPECBATCH_GPU_TESTS_DEVICE")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda() or OVERRIDE:
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)


@pytest.fixture
def device() -> str:
    """The device the tests run on: cuda, or SPECBATCH_GPU_TESTS_DEVICE."""
    return OVERRIDE or "cuda"
