"""Test-wide setup: never reach the Hugging Face hub (checkpoints are written by the tests),
and one local-Ray fixture for the modules that need it."""
import atexit
import os
import shutil
import tempfile

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
if "SPECBATCH_CACHE" not in os.environ:          # never ~/.cache; removed when the test run ends
    os.environ["SPECBATCH_CACHE"] = tempfile.mkdtemp(prefix="specbatch-test-cache-")
    atexit.register(shutil.rmtree, os.environ["SPECBATCH_CACHE"], ignore_errors=True)


@pytest.fixture(scope="module")
def ray_session():
    """A local Ray for one test module, shut down after it (never a global `ray stop`)."""
    import ray

    ray.init(num_cpus=2, include_dashboard=False, logging_level="warning")
    yield
    ray.shutdown()
