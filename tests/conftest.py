"""Without a GPU, run every kernel through Triton's interpreter (must be set before llmkernels is imported)."""

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from llmkernels.launch import clear_plans  # noqa: E402
from llmkernels.testing import default_device  # noqa: E402

# Hypothesis profiles of the property tests (tests/test_properties.py), picked by
# LLMK_HYPOTHESIS_PROFILE: "ci" (default) is derandomized and small enough for the CPU interpreter
# (each test sets its own example count for it); "gpu-long" draws 1000 fresh examples per test.
try:
    from hypothesis import HealthCheck, settings
except ImportError:  # hypothesis is in the [test] extra; without it the property tests skip
    HYPOTHESIS_PROFILE = None
else:
    _SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile(
        "ci",
        derandomize=True,
        deadline=None,
        database=None,
        print_blob=True,
        max_examples=10,
        suppress_health_check=_SLOW_OK,
    )
    settings.register_profile(
        "gpu-long", derandomize=False, deadline=None, print_blob=True, max_examples=1000, suppress_health_check=_SLOW_OK
    )
    HYPOTHESIS_PROFILE = os.environ.get("LLMK_HYPOTHESIS_PROFILE", "ci")
    settings.load_profile(HYPOTHESIS_PROFILE)


@pytest.fixture
def device():
    return default_device()


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    # A different seed per test, the same in every run (str hashes are salted per process).
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(autouse=True)
def _fresh_plans():
    # Tests patch planning rules (capabilities, thresholds): every test plans its calls afresh, and its
    # repeated calls run the cached plans.
    clear_plans()


def pytest_collection_modifyitems(config, items):
    if default_device().type == "cuda":
        return
    skip = pytest.mark.skip(reason="realistic shapes need a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
