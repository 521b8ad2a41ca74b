"""Hostile metadata never corrupts memory: cu_seqlens past the total or decreasing, seqlens past the block
table or negative, block-table entries outside [0, num_pages). With ``validate=True`` each raises a
ValueError naming the argument and its first bad index; without, the kernels clamp (the semantics of
``attention``'s docstring): inputs sit between NaN guard regions (a read outside them poisons the output),
every buffer the API allocates sits between sentinel guards (a write outside it shows), rows of sequences
the hostile entry does not touch are bit-equal to a clean run, and the rest match the reference run on
the clamped metadata. Tiny shapes for the CPU interpreter; one-pass and split-KV (num_splits > 1)."""

from dataclasses import dataclass, field

import pytest
import torch
from test_attention import TOLERANCE, _cu_seqlens

import llmkernels as lk
from llmkernels import runtime
from llmkernels.attention.api import attention
from llmkernels.attention.config import FA4Config
from llmkernels.attention.paged import PagedKVCache
from llmkernels.attention.reference import attention_reference
from llmkernels.testing import assert_close_relative

# The interpreter evaluates both sides of tl.where: -inf - -inf of fully masked rows warns in numpy.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

CONFIG = FA4Config(BM=16, BN=16, num_kv_stages=1)
HEADS, KV_HEADS, HEAD_DIM, DTYPE = 4, 2, 16, torch.float16
GUARD_ROWS = 32  # NaN rows (ragged) or pages (paged) before and after every input
GUARD_ELEMENTS = 8192  # sentinel elements before and after every buffer the API allocates
SENTINEL = 1234.0  # exact in fp16 and float32


class GuardedBuffers:
    """Stands in for ``runtime.new_buffer``: each buffer is a NaN-poisoned view into a larger one whose ends hold
    ``SENTINEL``, so an element left unwritten is NaN and a write outside the buffer changes a guard."""

    def __init__(self):
        self.storages = []

    def __call__(self, shape, dtype, device):
        numel = 1
        for size in shape:
            numel *= size
        storage = torch.full((numel + 2 * GUARD_ELEMENTS,), SENTINEL, dtype=dtype, device=device)
        storage[GUARD_ELEMENTS : GUARD_ELEMENTS + numel] = float("nan")
        self.storages.append(storage)
        return storage[GUARD_ELEMENTS : GUARD_ELEMENTS + numel].view(shape)

    def assert_intact(self):
        for storage in self.storages:
            guards = torch.cat([storage[:GUARD_ELEMENTS], storage[-GUARD_ELEMENTS:]])
            assert torch.all(guards == SENTINEL), "a kernel wrote outside a buffer it was given"


@pytest.fixture
def buffers(monkeypatch):
    guarded = GuardedBuffers()
    monkeypatch.setattr(runtime, "new_buffer", guarded)
    return guarded


def _guarded(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as a view into a larger tensor with ``GUARD_ROWS`` NaN slabs before and after along dim 0."""
    rows = tensor.shape[0]
    storage = torch.full(
        (rows + 2 * GUARD_ROWS, *tensor.shape[1:]), float("nan"), dtype=tensor.dtype, device=tensor.device
    )
    storage[GUARD_ROWS : GUARD_ROWS + rows] = tensor
    return storage[GUARD_ROWS : GUARD_ROWS + rows]


def _assert_guards_nan(view: torch.Tensor):
    """The NaN slabs around a :func:`_guarded` view are still NaN (nothing wrote into the inputs' neighbours)."""
    storage = view._base
    assert torch.isnan(storage[:GUARD_ROWS]).all() and torch.isnan(storage[-GUARD_ROWS:]).all()


def _effective_cu(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """The documented reading of untrusted prefix sums: ``clamp(cummax(cu_seqlens), 0, total)``."""
    return torch.cummax(cu_seqlens.long(), 0).values.clamp(0, total).to(torch.int32)


def _effective_cache(cache: PagedKVCache) -> PagedKVCache:
    """The documented reading of an untrusted cache: seqlens clamped to the table, entries to the pages."""
    seqlens = cache.seqlens.clamp(0, cache.max_seqlen_bound)
    return PagedKVCache(cache.k_pages, cache.v_pages, cache.block_table.clamp(0, cache.num_pages - 1), seqlens)


def _compare(out, lse, ref_out, ref_lse, rows, what):
    """``rows``: bool mask over q's token rows (ragged) or batch entries (dense q) that must be right."""
    lse_rows = lse[:, rows] if lse.dim() == 2 else lse[rows]
    ref_lse_rows = ref_lse[:, rows] if lse.dim() == 2 else ref_lse[rows]
    assert torch.isfinite(out[rows]).all(), f"{what}: NaN/inf in the output of a covered row"
    assert not torch.isnan(lse_rows).any(), f"{what}: NaN in the LSE of a covered row"
    assert_close_relative(out[rows], ref_out[rows], TOLERANCE[DTYPE], f"{what} out")
    assert torch.equal(torch.isinf(lse_rows), torch.isinf(ref_lse_rows)), f"{what}: -inf LSE rows differ"
    finite = torch.isfinite(ref_lse_rows)
    if finite.any():
        assert_close_relative(lse_rows[finite], ref_lse_rows[finite], TOLERANCE["lse"], f"{what} lse")


def _sequence_rows(cu_seqlens: torch.Tensor, sequences, total: int) -> torch.Tensor:
    rows = torch.zeros(total, dtype=torch.bool)
    for b in sequences:
        rows[int(cu_seqlens[b]) : int(cu_seqlens[b + 1])] = True
    return rows


# --------------------------------------------------------------------------- ragged q and k


@dataclass
class RaggedCase:
    cu_q: list
    cu_k: list
    error: str  # regex of the validate=True message
    total_q: int = 12
    total_k: int = 45
    untouched: list = field(default_factory=list)  # sequences whose bounds the hostile entries leave alone
    clean_cu_q: list | None = None  # valid metadata giving the untouched sequences the same bounds
    clean_cu_k: list | None = None
    max_seqlen_q: int | None = None
    max_seqlen_k: int | None = None


RAGGED_CASES = {
    "cu_k_last_past_total": RaggedCase(
        [0, 5, 9, 12],
        [0, 20, 30, 90],
        r"cu_seqlens_k\[3\] = 90 > total keys 45",
        untouched=[0, 1],
        clean_cu_k=[0, 20, 30, 45],
    ),
    "cu_k_middle_past_total": RaggedCase(
        [0, 5, 9, 12],
        [0, 20, 90, 45],
        r"cu_seqlens_k\[2\] = 90 > total keys 45",
        untouched=[0],
        clean_cu_k=[0, 20, 30, 45],
    ),
    "cu_k_negative": RaggedCase(
        [0, 5, 9, 12],
        [0, -8, 30, 45],
        r"cu_seqlens_k must be non-decreasing: "
        r"cu_seqlens_k\[1\] = -8 < cu_seqlens_k\[0\] = 0",
        untouched=[2],
        clean_cu_k=[0, 10, 30, 45],
    ),
    "cu_q_decreasing": RaggedCase(
        [0, 7, 5, 12],
        [0, 20, 30, 45],
        r"cu_seqlens_q must be non-decreasing: "
        r"cu_seqlens_q\[2\] = 5 < cu_seqlens_q\[1\] = 7",
        untouched=[0],
        clean_cu_q=[0, 7, 9, 12],
    ),
    "cu_q_past_total": RaggedCase(
        [0, 5, 9, 40],
        [0, 20, 30, 45],
        r"cu_seqlens_q\[3\] = 40 > total queries 12",
        untouched=[0, 1],
        clean_cu_q=[0, 5, 9, 12],
    ),
    "cu_q_huge_early": RaggedCase([0, 1000, 5, 12], [0, 20, 30, 45], r"cu_seqlens_q\[1\] = 1000 > total queries 12"),
    "cu_q_first_not_zero": RaggedCase(
        [2, 5, 9, 12], [0, 20, 30, 45], r"cu_seqlens_q\[0\] = 2 != 0", untouched=[1, 2], clean_cu_q=[0, 5, 9, 12]
    ),
    "max_seqlen_k_too_small": RaggedCase(
        [0, 5, 9, 12],
        [0, 20, 30, 45],
        r"cu_seqlens_k\[1\] - cu_seqlens_k\[0\] "
        r"= 20 > max_seqlen_k = 8",
        max_seqlen_k=8,
    ),
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_ragged_hostile(device, buffers, name, num_splits):
    case = RAGGED_CASES[name]
    q = _guarded(torch.randn(case.total_q, HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    k = _guarded(torch.randn(case.total_k, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    v = _guarded(torch.randn(case.total_k, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    cu_q, cu_k = _cu_seqlens_of(case.cu_q, device), _cu_seqlens_of(case.cu_k, device)
    kwargs = dict(
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen_q=case.max_seqlen_q,
        max_seqlen_k=case.max_seqlen_k,
        num_splits=num_splits,
        config=CONFIG,
    )
    with pytest.raises(ValueError, match=case.error):
        attention(q, k, v, validate=True, **kwargs)

    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    buffers.assert_intact()
    for tensor in (q, k, v):
        _assert_guards_nan(tensor)
    effective_q, effective_k = _effective_cu(cu_q.cpu(), case.total_q), _effective_cu(cu_k.cpu(), case.total_k)
    ref_out, ref_lse = attention_reference(
        q, k, v, cu_seqlens_q=effective_q.to(device), cu_seqlens_k=effective_k.to(device), return_lse=True
    )
    covered = _sequence_rows(effective_q, range(len(case.cu_q) - 1), case.total_q)
    _compare(out, lse, ref_out, ref_lse, covered, name)

    if case.clean_cu_q is not None or case.clean_cu_k is not None:
        clean_q = _cu_seqlens_of(case.clean_cu_q or case.cu_q, device)
        clean_k = _cu_seqlens_of(case.clean_cu_k or case.cu_k, device)
        clean_out, clean_lse = attention(
            q, k, v, return_lse=True, validate=True, **{**kwargs, "cu_seqlens_q": clean_q, "cu_seqlens_k": clean_k}
        )
        rows = _sequence_rows(clean_q.cpu(), case.untouched, case.total_q)
        assert torch.equal(out[rows], clean_out[rows]), f"{name}: an untouched sequence's output changed"
        assert torch.equal(lse[:, rows], clean_lse[:, rows]), f"{name}: an untouched sequence's LSE changed"


def _cu_seqlens_of(entries, device):
    return torch.tensor(entries, dtype=torch.int32, device=device)


@pytest.mark.parametrize("num_splits", [1, 3])
def test_max_seqlen_q_too_small(device, buffers, num_splits):
    """Only the first max_seqlen_q queries of a sequence are guaranteed: those match the reference, the
    call writes nothing outside its buffers; validate=True names the long sequence."""
    lengths_q, lengths_k, max_seqlen_q = [3, 40, 2], [10, 50, 7], 4
    q = _guarded(torch.randn(sum(lengths_q), HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    k = _guarded(torch.randn(sum(lengths_k), KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    v = _guarded(torch.randn(sum(lengths_k), KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    kwargs = dict(
        cu_seqlens_q=_cu_seqlens(lengths_q, device),
        cu_seqlens_k=_cu_seqlens(lengths_k, device),
        max_seqlen_q=max_seqlen_q,
        num_splits=num_splits,
        causal=True,
        config=CONFIG,
    )
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] - cu_seqlens_q\[1\] = 40 > max_seqlen_q = 4"):
        attention(q, k, v, validate=True, **kwargs)
    out, lse = attention(q, k, v, return_lse=True, **kwargs)
    buffers.assert_intact()
    ref_out, ref_lse = attention_reference(q, k, v, return_lse=True, **kwargs)
    starts = _cu_seqlens(lengths_q, "cpu")
    guaranteed = torch.zeros(q.shape[0], dtype=torch.bool)
    for b, length in enumerate(lengths_q):
        guaranteed[int(starts[b]) : int(starts[b]) + min(length, max_seqlen_q)] = True
    _compare(out, lse, ref_out, ref_lse, guaranteed, "max_seqlen_q")


# --------------------------------------------------------------------------- paged KV cache

PAGE_SIZE, MAX_PAGES, NUM_PAGES = 16, 4, 10
CLEAN_SEQLENS = [64, 20, 33]  # 4 + 2 + 3 pages of the 10


def _cache(device, seqlens=CLEAN_SEQLENS, num_pages=NUM_PAGES):
    """Pages between NaN guard pages, a shuffled block table whose unused entries are garbage (10**6)."""
    block_table = torch.full((len(seqlens), MAX_PAGES), 10**6, dtype=torch.int32)
    permutation, cursor = torch.randperm(num_pages).tolist(), 0
    for b, length in enumerate(seqlens):
        count = -(-max(length, 0) // PAGE_SIZE)
        block_table[b, :count] = torch.tensor(permutation[cursor : cursor + count], dtype=torch.int32)
        cursor += count
    shape = (num_pages, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    k_pages = _guarded(torch.randn(shape, dtype=DTYPE, device=device))
    v_pages = _guarded(torch.randn(shape, dtype=DTYPE, device=device))
    return PagedKVCache(
        k_pages, v_pages, block_table.to(device), torch.tensor(seqlens, dtype=torch.int32, device=device)
    )


def _with(cache, seqlens=None, entry=None):
    """``cache`` with other seqlens and/or one block-table entry ``((b, i), value)`` replaced."""
    block_table = cache.block_table.clone()
    if entry is not None:
        block_table[entry[0]] = entry[1]
    seqlens = cache.seqlens if seqlens is None else torch.tensor(seqlens, dtype=torch.int32, device=cache.device)
    return PagedKVCache(cache.k_pages, cache.v_pages, block_table, seqlens)


# name: (seqlens, block-table entry, error regex, untouched sequences, max_seqlen_k)
PAGED_CASES = {
    "seqlens_past_table": (
        [70, 20, 33],
        None,
        r"kv_cache\.seqlens\[0\] = 70 > max_pages \* page_size = 64",
        [1, 2],
        None,
    ),
    "seqlens_negative": ([64, -5, 33], None, r"kv_cache\.seqlens\[1\] = -5 < 0", [0, 2], None),
    "seqlens_past_max_seqlen_k": (None, None, r"kv_cache\.seqlens\[0\] = 64 > max_seqlen_k = 32", [0, 1, 2], 32),
    "page_eq_num_pages": (
        None,
        ((2, 1), NUM_PAGES),
        r"kv_cache\.block_table\[2, 1\] = 10 not in \[0, num_pages=10\)",
        [0, 1],
        None,
    ),
    "page_negative": (
        None,
        ((1, 0), -1),
        r"kv_cache\.block_table\[1, 0\] = -1 not in \[0, num_pages=10\)",
        [0, 2],
        None,
    ),
    "page_huge": (
        None,
        ((0, 3), 2**30),
        r"kv_cache\.block_table\[0, 3\] = 1073741824 not in \[0, num_pages=10\)",
        [1, 2],
        None,
    ),
}


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("name", list(PAGED_CASES))
def test_paged_hostile(device, buffers, name, num_splits):
    seqlens, entry, error, untouched, max_seqlen_k = PAGED_CASES[name]
    clean = _cache(device)
    hostile = _with(clean, seqlens, entry)
    q = _guarded(torch.randn(3, 2, HEADS, HEAD_DIM, dtype=DTYPE, device=device))  # 2 new tokens per sequence
    kwargs = dict(causal=True, num_splits=num_splits, max_seqlen_k=max_seqlen_k, config=CONFIG)
    with pytest.raises(ValueError, match=error):
        attention(q, None, None, kv_cache=hostile, validate=True, **kwargs)

    out, lse = attention(q, None, None, kv_cache=hostile, return_lse=True, **kwargs)
    buffers.assert_intact()
    for tensor in (q, clean.k_pages, clean.v_pages):
        _assert_guards_nan(tensor)
    ref_out, ref_lse = attention_reference(q, None, None, kv_cache=_effective_cache(hostile), return_lse=True, **kwargs)
    _compare(out, lse, ref_out, ref_lse, torch.ones(3, dtype=torch.bool), name)
    if seqlens is not None and min(seqlens) < 0:
        empty = [b for b, n in enumerate(seqlens) if n < 0]
        assert torch.all(out[empty] == 0) and torch.all(lse[empty] == float("-inf"))

    clean_out, clean_lse = attention(
        q, None, None, kv_cache=clean, return_lse=True, validate=max_seqlen_k is None, **kwargs
    )
    assert torch.equal(out[untouched], clean_out[untouched]), f"{name}: an untouched sequence's output changed"
    assert torch.equal(lse[untouched], clean_lse[untouched]), f"{name}: an untouched sequence's LSE changed"


@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_ragged_q_decreasing(device, buffers, num_splits):
    """Ragged q against a paged cache: a decreasing cu_seqlens_q empties one sequence, the others are kept."""
    cache = _cache(device)
    q = _guarded(torch.randn(6, HEADS, HEAD_DIM, dtype=DTYPE, device=device))
    cu_q = _cu_seqlens_of([0, 3, 1, 6], device)
    kwargs = dict(cu_seqlens_q=cu_q, max_seqlen_q=3, causal=True, num_splits=num_splits, config=CONFIG)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 1 < cu_seqlens_q\[1\] = 3"):
        attention(q, None, None, kv_cache=cache, validate=True, **kwargs)
    out, lse = attention(q, None, None, kv_cache=cache, return_lse=True, **kwargs)
    buffers.assert_intact()
    _assert_guards_nan(q)
    effective = _effective_cu(cu_q.cpu(), 6)  # [0, 3, 3, 6]
    ref_out, ref_lse = attention_reference(
        q, None, None, kv_cache=cache, return_lse=True, **{**kwargs, "cu_seqlens_q": effective.to(device)}
    )
    _compare(out, lse, ref_out, ref_lse, torch.ones(6, dtype=torch.bool), "paged ragged q")


def test_validate_ignores_unused_block_table_entries(device, buffers):
    """Entries past a sequence's pages (garbage 10**6 here) are never read, so validate=True accepts them."""
    cache = _cache(device)
    assert (cache.block_table == 10**6).any()
    q = torch.randn(3, 1, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    checked = attention(q, None, None, kv_cache=cache, validate=True, num_splits=2, config=CONFIG)
    unchecked = attention(q, None, None, kv_cache=cache, num_splits=2, config=CONFIG)
    assert torch.equal(checked, unchecked)


def test_cache_without_pages(device, buffers):
    """A cache with no pages holds no keys: every row is fully masked whatever seqlens and the table say."""
    shape = (0, PAGE_SIZE, KV_HEADS, HEAD_DIM)
    cache = PagedKVCache(
        torch.empty(shape, dtype=DTYPE, device=device),
        torch.empty(shape, dtype=DTYPE, device=device),
        torch.zeros(2, MAX_PAGES, dtype=torch.int32, device=device),
        torch.tensor([20, 0], dtype=torch.int32, device=device),
    )
    q = torch.randn(2, 1, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    with pytest.raises(ValueError, match=r"kv_cache\.block_table\[0, 0\] = 0 not in \[0, num_pages=0\)"):
        attention(q, None, None, kv_cache=cache, validate=True, config=CONFIG)
    for num_splits in (1, 3):
        out, lse = attention(q, None, None, kv_cache=cache, return_lse=True, num_splits=num_splits, config=CONFIG)
        buffers.assert_intact()
        assert torch.all(out == 0) and torch.all(lse == float("-inf"))


# --------------------------------------------------------------------------- validate's argument and torch.compile


def test_validate_must_be_bool(device):
    q = torch.randn(1, 2, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    with pytest.raises(TypeError, match="validate"):
        attention(q, q[:, :, :KV_HEADS], q[:, :, :KV_HEADS], validate=1)


def test_validate_under_torch_compile(device):
    """validate=True stays on the Python path under torch.compile (and still raises); validate=False goes
    through the custom op, whose kernels clamp the same way as eager ones."""
    q = torch.randn(12, HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    k = torch.randn(45, KV_HEADS, HEAD_DIM, dtype=DTYPE, device=device)
    v = torch.randn_like(k)
    cu_q, cu_k = _cu_seqlens_of([0, 5, 9, 12], device), _cu_seqlens_of([0, 20, 30, 90], device)

    def call(q, k, v, cu_q, cu_k, validate):  # the public function: the one that knows the custom op
        return lk.attention(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, validate=validate)

    compiled = torch.compile(call, backend="eager")
    with pytest.raises(ValueError, match=r"cu_seqlens_k\[3\] = 90 > total keys 45"):
        compiled(q, k, v, cu_q, cu_k, True)
    assert torch.equal(compiled(q, k, v, cu_q, cu_k, False), call(q, k, v, cu_q, cu_k, False))
