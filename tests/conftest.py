"""Without a GPU, run every kernel through Triton's interpreter (must be set before llmkernels is imported)."""
import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmkernels._testing import default_device  # noqa: E402


@pytest.fixture
def device():
    return default_device()


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test, the same in every run (str hashes are salted per process).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


def pytest_collection_modifyitems(config, items):
    if default_device().type == "cuda":
        return
    skip = pytest.mark.skip(reason="realistic shapes need a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
