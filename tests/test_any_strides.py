"""Any strides: every tensor argument of every public function, given as a strided, expanded, offset or
transposed view, gives the same bits as its contiguous copy (``public_calls.py`` lists the calls).

The walk is data-driven: each leaf of each call goes through each view kind (in the CPU interpreter every
leaf at once per kind first, leaf by leaf where that fails), and separate tests check
that every public function of the public modules is walked (or listed as taking no tensor, or reading
none) and that every tensor argument of every walked function is some call's leaf. A leaf the call
writes in place (``out=``, a KV cache, in-place hidden states) takes every view but the expanded one,
which must raise (its rows would race); its contents afterwards are compared too.
"""

import inspect
import os

import pytest
import torch
from public_calls import (
    CALLS,
    CALLS_BY_NAME,
    CONTAINERS,
    HAS_TORCHAO,
    NO_TENSOR_FUNCTIONS,
    NON_TENSOR_ARGUMENTS,
    NOT_WALKED,
    PUBLIC,
    TORCHAO_FUNCTIONS,
    InputRejected,
    bit_differences,
    discover_public,
    fill,
    observe,
    outcome,
    poisoned_buffer,
)

from llmkernels import runtime
from llmkernels.testing import on_gpu

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

VIEW_KINDS = ("strided", "expanded", "offset", "transposed")


def view_of(tensor: torch.Tensor, kind: str) -> torch.Tensor | None:
    """A view with other strides holding ``tensor``'s values (``"expanded"``: its first slice along the
    first dim of size > 1, repeated with stride 0), in fresh memory whose other elements are "high"
    (NaN, 0xFF bytes, the integer maximum: a read of them shows);
    None when the kind does not apply to this shape."""
    sizes = tensor.shape
    long_dims = [d for d, size in enumerate(sizes) if size > 1]
    if kind == "expanded":
        return tensor.narrow(long_dims[0], 0, 1).expand(sizes) if long_dims else None
    if kind == "strided":
        if not long_dims:
            return None
        dim = long_dims[-1]
        base = fill(tensor.new_empty((*sizes[:dim], 2 * sizes[dim], *sizes[dim + 1 :])), "high")
        view = base[(slice(None),) * dim + (slice(None, None, 2),)]
    elif kind == "offset":
        base = fill(tensor.new_empty(tensor.numel() + 3), "high")
        view = base[3:].view(sizes)
    elif kind == "transposed":
        if tensor.dim() < 2 or sizes[-1] < 2 or sizes[-2] < 2:
            return None
        view = fill(tensor.new_empty((*sizes[:-2], sizes[-1], sizes[-2])), "high").transpose(-1, -2)
    else:
        raise ValueError(kind)
    return view.copy_(tensor)


def fresh(call, leaves: dict) -> dict:
    """The leaves with written ones cloned, so that each run starts from the same contents."""
    return {name: tensor.clone() if name in call.written else tensor for name, tensor in leaves.items()}


@pytest.fixture(autouse=True)
def _poisoned_outputs(monkeypatch):
    monkeypatch.setattr(runtime, "new_buffer", poisoned_buffer)


def _views_outcome(call, leaves: dict, expected, names, kind: str):
    """``(problem, viewed, checked)`` of one run with each leaf of ``names`` as a ``kind`` view at once: what
    differs from the contiguous call (None: nothing), how many leaves took the view, and whether the comparison
    says something (False: the view kind fits none of them, another library refused it, or the values of the
    expanded views make the reference itself raise)."""
    views = {name: view for name in names if (view := view_of(leaves[name], kind)) is not None}
    if not views:
        return None, 0, False
    reference = expected
    if kind == "expanded":  # other values: the contiguous call with the same values
        reference = outcome(call, {**fresh(call, leaves), **{name: view.contiguous() for name, view in views.items()}})
    try:
        result = outcome(call, {**fresh(call, leaves), **views})
    except InputRejected:  # another library's constructor takes no such view (torchao: contiguous qdata)
        return None, len(views), False
    problem = bit_differences(result, reference)
    if problem:
        strides = ", ".join(f"{name} {tuple(view.stride())}" for name, view in views.items())
        problem = f"{', '.join(views)} as {kind} views (strides {strides}): {problem}"
    return problem, len(views), not isinstance(reference, Exception)


# Each leaf alone through each view kind on the GPU (or with LLMK_FULL_WALK=1); in the CPU interpreter every leaf
# at once per kind (a handful of runs per call instead of four per leaf), and leaf by leaf only where that run
# fails or says nothing, so that a failure still names its leaf.
LEAF_BY_LEAF = on_gpu() or os.environ.get("LLMK_FULL_WALK") == "1"


@pytest.mark.parametrize("name", list(CALLS_BY_NAME))
def test_every_tensor_argument_takes_any_view(name, device):
    call = CALLS_BY_NAME[name]
    leaves = call.make(device)
    expected = observe(call, fresh(call, leaves))
    failures, walked = [], 0
    for leaf in leaves:  # an in-place output may not overlap itself: an expanded view of it must raise
        if leaf in call.written and view_of(leaves[leaf], "expanded") is not None:
            walked += 1
            with pytest.raises(ValueError, match="share memory"):
                call.run({**fresh(call, leaves), leaf: view_of(leaves[leaf], "expanded")})
    for kind in VIEW_KINDS:
        names = [leaf for leaf in leaves if not (kind == "expanded" and leaf in call.written)]
        if not LEAF_BY_LEAF:
            problem, viewed, checked = _views_outcome(call, leaves, expected, names, kind)
            if checked and not problem:
                walked += viewed
                continue
        for leaf in names:
            problem, viewed, _ = _views_outcome(call, leaves, expected, [leaf], kind)
            walked += viewed
            if problem:
                failures.append(problem)
    assert walked >= len(leaves), "every leaf takes at least one view"
    assert not failures, f"{name}:\n" + "\n".join(failures)


def _leaf_names(function_key: str, device) -> set:
    return {leaf for call in CALLS if function_key in call.functions for leaf in call.make(device)}


@pytest.mark.parametrize("function_key", [key for key in PUBLIC if HAS_TORCHAO or key not in TORCHAO_FUNCTIONS])
def test_the_walk_covers_every_tensor_argument(function_key, device):
    """A tensor argument added to a public function fails here until a call in ``public_calls.py`` feeds it
    (or it is listed there as holding no tensor)."""
    leaves = _leaf_names(function_key, device)
    parameters = [
        p for p in inspect.signature(PUBLIC[function_key]).parameters if p not in NON_TENSOR_ARGUMENTS[function_key]
    ]
    assert parameters, f"{function_key} has no tensor argument: drop it from PUBLIC"
    if function_key in CONTAINERS:
        missing = [p for p in parameters if not any(f"{arg}.{p}" in leaves for arg in CONTAINERS[function_key])]
    else:
        missing = [p for p in parameters if not any(leaf.split(".")[0] == p for leaf in leaves)]
    assert not missing, f"{function_key}: tensor arguments {missing} are walked by no call in public_calls.py"


def test_every_public_function_is_walked():
    """A public function added to a public module fails here until a call in ``public_calls.py`` walks it, or
    it is listed there as taking no tensor or reading none."""
    discovered = discover_public()
    listed = {
        **{key: "walked" for key in PUBLIC},
        **{key: "takes no tensor" for key in NO_TENSOR_FUNCTIONS},
        **{key: "reads no tensor" for key in NOT_WALKED},
    }
    unlisted = sorted(set(discovered) - set(listed))
    assert not unlisted, f"public functions in no walk of public_calls.py: {unlisted}"
    gone = sorted(set(listed) - set(discovered))
    assert not gone, f"public_calls.py lists functions that are not public: {gone}"
    twice = [key for key in PUBLIC if key in NO_TENSOR_FUNCTIONS or key in NOT_WALKED]
    assert not twice, f"listed both as walked and not: {twice}"
    unwalked = [
        key
        for key in PUBLIC
        if not any(key in call.functions for call in CALLS) and (HAS_TORCHAO or key not in TORCHAO_FUNCTIONS)
    ]
    assert not unwalked, f"in PUBLIC but fed by no call: {unwalked}"
