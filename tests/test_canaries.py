"""No read or write outside any tensor, whatever the metadata (``public_calls.py`` lists the calls).

Every input leaf of a call sits in the middle of a larger buffer whose other elements are canaries, and
every buffer the library allocates for a kernel to write sits between guard bytes. Each call runs twice,
with two different canary fillings (NaN or 0xFF bytes or the integer maximum; zeros or the integer
minimum): a read of a canary that reaches the result makes the two runs differ. After each run every
guard, every canary and every input is checked unchanged (a write outside a buffer, or into an input).
The metadata leaves (integer tensors: offsets, ids, page tables, sequence lengths, row indices) take
hostile values too: all maximal, all minimal, and a mix of extremes, -1, 0 and in-range values (in the CPU
interpreter: each leaf alone mixed, and all of them at once maximal, then minimal).
On the GPU the same tests run under compute-sanitizer's memcheck (``tools/gpu_reliability.sh``).
"""

import os

import pytest
import torch
from public_calls import CALLS_BY_NAME, bit_differences, fill, observe, outcome, poisoned_buffer

from llmkernels import runtime
from llmkernels.testing import on_gpu

pytestmark = pytest.mark.filterwarnings(
    "ignore:invalid value encountered:RuntimeWarning", "ignore:overflow encountered:RuntimeWarning"
)

FILLINGS = ("high", "low")
HOSTILE_VALUES = ("max", "min", "mixed")
EXTRA_CANARIES = 64  # canary elements beyond a buffer's own size, on each side
# Each metadata leaf alone at each hostile kind on the GPU (or with LLMK_FULL_WALK=1); in the CPU interpreter each
# leaf alone with mixed extremes and all of them together at their maximum and at their minimum.
LEAF_BY_LEAF = on_gpu() or os.environ.get("LLMK_FULL_WALK") == "1"


class Canaried:
    """Tensors placed between canaries; :meth:`check` asserts that canaries and contents are unchanged."""

    def __init__(self):
        self.placed = []  # (name, storage, start, numel, storage bytes before the call)

    def place(self, name: str, tensor: torch.Tensor, filling: str | None) -> torch.Tensor:
        """A copy of ``tensor`` inside canaries of ``filling`` (None: random bytes)."""
        pad = tensor.numel() + EXTRA_CANARIES
        storage = torch.empty(tensor.numel() + 2 * pad, dtype=tensor.dtype, device=tensor.device)
        if filling is None:
            storage.view(torch.uint8).copy_(
                torch.randint(0, 256, (storage.numel() * storage.element_size(),), dtype=torch.uint8).view(
                    storage.view(torch.uint8).shape
                )
            )
        else:
            fill(storage, filling)
        view = storage[pad : pad + tensor.numel()].view(tensor.shape)
        view.copy_(tensor)
        self.placed.append((name, storage, pad, tensor.numel(), _bits(storage).clone()))
        return view

    def check(self, written: set):
        """Every canary intact; every placed tensor not in ``written`` intact as well."""
        for name, storage, start, numel, before in self.placed:
            after = _bits(storage)
            size = storage.element_size()
            inside = slice(start * size, (start + numel) * size)
            outside = torch.ones_like(after, dtype=torch.bool)
            outside[inside] = False
            assert torch.equal(after[outside], before[outside]), f"a kernel wrote outside {name}"
            if name not in written:
                assert torch.equal(after[inside], before[inside]), f"a kernel wrote into the input {name}"


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.view(torch.uint8) if tensor.element_size() == 1 else tensor.view(-1).view(torch.uint8)


def hostile(tensor: torch.Tensor, kind: str) -> torch.Tensor:
    """An integer tensor of the same shape holding extreme values."""
    info = torch.iinfo(tensor.dtype)
    if kind == "max":
        return torch.full_like(tensor, info.max)
    if kind == "min":
        return torch.full_like(tensor, info.min)
    choices = torch.tensor(
        [
            info.min,
            -(2**31) if info.bits > 32 else info.min + 1,
            -1,
            0,
            1,
            7,
            2**30,
            info.max,
            *tensor.reshape(-1).tolist(),
        ],
        dtype=tensor.dtype,
    )
    picks = torch.randint(0, choices.numel(), tensor.shape)
    return choices[picks].to(tensor.device)


def run_canaried(call, leaves: dict, filling: str, monkeypatch):
    canaried = Canaried()
    monkeypatch.setattr(
        runtime,
        "new_buffer",
        lambda shape, dtype, device: canaried.place(
            "a buffer the library allocated", poisoned_buffer(shape, dtype, device), None
        ),
    )
    placed = {name: canaried.place(name, tensor, filling) for name, tensor in leaves.items()}
    result = outcome(call, placed)
    written = {*call.written, "a buffer the library allocated"}
    canaried.check(written)
    return result


def _metadata_leaves(leaves: dict) -> list[str]:
    return [name for name, tensor in leaves.items() if not tensor.is_floating_point() and tensor.element_size() > 1]


@pytest.mark.parametrize("name", list(CALLS_BY_NAME))
def test_canaries_stay_unread_and_untouched(name, device, monkeypatch):
    call = CALLS_BY_NAME[name]
    leaves = call.make(device)
    monkeypatch.setattr(runtime, "new_buffer", poisoned_buffer)
    clean = observe(call, {name: tensor.clone() for name, tensor in leaves.items()})
    for filling in FILLINGS:
        problem = bit_differences(run_canaried(call, leaves, filling, monkeypatch), clean)
        assert problem is None, f"{name} between {filling} canaries: {problem}"


@pytest.mark.parametrize("name", list(CALLS_BY_NAME))
def test_hostile_metadata_reads_and_writes_nothing_outside(name, device, monkeypatch):
    call = CALLS_BY_NAME[name]
    leaves = call.make(device)
    if not _metadata_leaves(leaves):
        pytest.skip("no integer metadata")
    failures = []
    metadata = _metadata_leaves(leaves)
    if LEAF_BY_LEAF:
        trials = [{leaf: hostile(leaves[leaf], kind)} for leaf in metadata for kind in HOSTILE_VALUES]
    else:  # each leaf alone with mixed extremes, then every leaf at its maximum, then at its minimum
        trials = [{leaf: hostile(leaves[leaf], "mixed")} for leaf in metadata]
        trials += [{leaf: hostile(leaves[leaf], kind) for leaf in metadata} for kind in ("max", "min")]
    for hostile_leaves in trials:
        trial = {**leaves, **hostile_leaves}
        results = [run_canaried(call, trial, filling, monkeypatch) for filling in FILLINGS]
        problem = bit_differences(*results)
        if problem:
            values = ", ".join(f"{leaf} = {tensor.tolist()}" for leaf, tensor in hostile_leaves.items())
            failures.append(f"{values}: the canaries reached the result: {problem}")
    assert not failures, f"{name}:\n" + "\n".join(failures)
