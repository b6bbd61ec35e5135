"""Tests in tests/gpu need CUDA; without it every test here is skipped (not failed)."""
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(skip)
