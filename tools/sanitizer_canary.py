"""A deliberate out-of-bounds store, to show that compute-sanitizer sees kernels launched inside
pytest-xdist workers: run under the same command as the memcheck step and expect 1 error per worker
that ran it.

    PYTORCH_NO_CUDA_MEMORY_CACHING=1 compute-sanitizer --tool memcheck --target-processes all \\
        python -m pytest tools/sanitizer_canary.py -n 2 -p no:cacheprovider
"""

import pytest
import torch
import triton
import triton.language as tl


@triton.jit
def _store_past_the_end(out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, 1.0, mask=offsets < n + 64)  # 64 elements too many


@pytest.mark.parametrize("worker", [0, 1])
def test_out_of_bounds_store(worker):
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    out = torch.empty(256, device="cuda")
    _store_past_the_end[(1,)](out, out.numel(), BLOCK=512)
    torch.cuda.synchronize()
