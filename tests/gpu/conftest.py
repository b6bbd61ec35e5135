"""Tests in tests/gpu need CUDA; without it every test here is skipped (not failed)."""
import pytest


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
    here = str(config.rootpath / "tests" / "gpu")
    for item in items:
        if str(item.path).startswith(here):
            item.add_marker(skip)
