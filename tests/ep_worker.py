"""The ranks of tests/test_expert_parallel.py: ``python tests/ep_worker.py WORLD PORT CASE FORMAT CAPACITY OUT
[VARIANTS]``
spawns WORLD processes on the CPU (gloo, Triton's interpreter); each builds the expert-parallel MoE block with its
own experts and the single-process block with all of them, runs its own tokens through both, and writes what it
found to ``OUT.<rank>.json``: the bounded mode must give the single-process block's bits, the exact mode those of
:func:`_exact_expected` (the same expert outputs, each other rank's partial sum rounded to bf16 once). With ``EP_DEVICE=cuda`` the ranks run on GPUs through NCCL (rank r on GPU r) and the
compiled kernels instead.

Cases: ``balanced`` (random routing), ``skewed`` (one hot expert), ``no-tokens`` (rank 0 has no token),
``idle-experts`` (no token goes to the last rank's experts), ``disagree`` (rank 0 is built with another top_k: every
rank must raise the same ValueError at construction), ``bad-inputs`` (errors raised before any collective),
``graph`` (GPUs only: the bounded block captured in a CUDA graph and replayed on new tokens equals the eager block).

VARIANTS (optional, comma-separated ``FORMAT/DISPATCH``, e.g. ``fp8/auto``): more exact-mode blocks run in the same
processes on the same tokens, each against the one-process block of its weight format (``auto``: the default
dispatch_format; ``fp8`` dispatch of bf16 activations: against the one-process block's experts on the tokens rounded
through fp8 (1, 128) blocks, and its error against the bf16 result).
"""

import json
import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

NUM_EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 8, 64, 32, 2
TOKENS_PER_RANK = 12


def _problem(world: int, case: str):
    """The same weights and tokens on every rank (one seed): router, w_gate_up, w_down, x of every rank."""
    generator = torch.Generator().manual_seed(1234)
    router = torch.randn(NUM_EXPERTS, HIDDEN, generator=generator)
    w_gate_up = torch.randn(NUM_EXPERTS, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5
    w_down = torch.randn(NUM_EXPERTS, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5
    counts = [0 if case == "no-tokens" and rank == 0 else TOKENS_PER_RANK + 3 * rank for rank in range(world)]
    x = torch.randn(sum(counts), HIDDEN, generator=generator)
    if case in ("skewed", "idle-experts"):  # every token leans towards expert 0
        x = x + 4 * router[0] / router[0].norm()
    if case == "idle-experts":  # the last rank's experts point away from every token
        per_rank = NUM_EXPERTS // world
        router[NUM_EXPERTS - per_rank :] = -router[0].abs().sum() * router[0] / router[0].norm() ** 2
    return router, w_gate_up, w_down, list(torch.split(x.to(torch.bfloat16), counts))


def _kept_copies(router, xs, rank: int, world: int, capacity: int | None):
    """bool ``[T, k]``: the copies of ``rank``'s tokens that the bounded mode keeps (the first ``capacity`` copies to
    each destination in (token, slot) order), from the same top-k the block computes."""
    logits = xs[rank].float() @ router.float().t()
    expert_ids = torch.topk(logits, TOP_K, dim=-1).indices
    dest = (expert_ids // (NUM_EXPERTS // world)).reshape(-1)
    kept = torch.ones_like(dest, dtype=torch.bool)
    if capacity is not None:
        for d in range(world):
            where = (dest == d).nonzero().flatten()
            kept[where[capacity:]] = False
    return kept.view(-1, TOP_K)


def _copies_to(router, x, world: int) -> list:
    """How many of x's (token, slot) copies go to each rank (the top-k the block computes)."""
    expert_ids = torch.topk(x.float() @ router.float().t(), TOP_K, dim=-1).indices
    return torch.bincount((expert_ids // (NUM_EXPERTS // world)).flatten(), minlength=world).tolist()


def _bad_inputs(router, w_gate_up, w_down, mine, x) -> list:
    """The messages of the ValueErrors that bad arguments raise; each before any collective (a collective
    reached by one rank only would hang this process, and the test's timeout would fail it)."""
    from llmkernels.moe import MoEFeedForward

    group = dist.group.WORLD
    attempts = [
        lambda: MoEFeedForward.from_float(
            router[:7], w_gate_up[:3], w_down[:3], TOP_K, weight_format="bf16", process_group=group
        ),  # 7 experts over 2 ranks
        lambda: MoEFeedForward.from_float(
            router, w_gate_up, w_down, TOP_K, weight_format="bf16", process_group=group
        ),  # every expert given to one rank
        lambda: MoEFeedForward.from_float(
            router, w_gate_up[mine], w_down[mine], TOP_K, weight_format="bf16", process_group=group, capacity=0
        ),
        lambda: MoEFeedForward.from_float(router, w_gate_up, w_down, TOP_K, weight_format="bf16", capacity=4),
        lambda: MoEFeedForward.from_float(
            router,
            w_gate_up[mine],
            w_down[mine],
            TOP_K,
            weight_format="bf16",
            process_group=group,
            dispatch_format="int8",
        ),
        lambda: MoEFeedForward.from_float(
            router,
            w_gate_up[mine],
            w_down[mine],
            TOP_K,
            weight_format="mxfp8",
            process_group=group,
            dispatch_format="fp8",
        ),  # mxfp8 activations rounded again
        lambda: MoEFeedForward.from_float(
            router, w_gate_up, w_down, TOP_K, weight_format="bf16", dispatch_format="bf16"
        ),  # without a group
    ]
    errors = []
    for attempt in attempts:
        try:
            attempt()
            errors.append(None)
        except ValueError as error:
            errors.append(str(error))
    block = MoEFeedForward.from_float(
        router, w_gate_up[mine], w_down[mine], TOP_K, weight_format="bf16", process_group=group
    )  # a good block (its construction check is collective)
    try:
        block(x[:, :-1])
        errors.append(None)
    except ValueError as error:
        errors.append(str(error))
    return errors


def _graph_replay(block, x: torch.Tensor) -> torch.Tensor:
    """``block(x)`` captured in a CUDA graph on other tokens of x's shape, then replayed on x's."""
    static = torch.randn_like(x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        block(static)  # warm-up outside the capture: compiles, allocates, opens the communicator
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = block(static)
    static.copy_(x)
    graph.replay()
    return static_out.clone()


def _exact_expected(whole, router, x, rank: int, world: int, rows=None):
    """The exact mode's result on this rank's tokens x from the one-process block's expert outputs (on ``rows``, x
    rounded through the dispatch format, when given; routed on x), summed as the exchange sums them, by the
    library's combine (which rounds to bf16 as the platform's kernels do): each other rank's copies weighted into
    one bf16 row per token, then the token's own-rank copies (weighted) and those rows (weight 1) in rank order."""
    from llmkernels.moe import combine, dispatch, select_experts

    weights, expert_ids = select_experts(x.float() @ router.float().t(), TOP_K)
    token_of_row, a_offsets, row_of_copy = dispatch(expert_ids, NUM_EXPERTS)
    y = whole._projections(whole._activations(x if rows is None else rows, token_of_row), a_offsets, whole.expert_ids)
    dest = expert_ids // (NUM_EXPERTS // world)
    results, columns = [y], [torch.where(dest == rank, row_of_copy, -1)]
    for d in range(world):
        holds = (dest == d).any(1) & (d != rank)
        columns.append(torch.where(holds, sum(map(len, results)) + torch.arange(len(x), device=x.device), -1))
        results.append(combine(y, torch.where(dest == d, row_of_copy, -1), weights, torch.bfloat16))
    table = torch.stack([columns[0][:, slot] for slot in range(TOP_K)] + columns[1:], 1)
    return combine(
        torch.cat(results), table, torch.cat([weights, torch.ones_like(weights[:, :1]).expand(-1, world)], 1), x.dtype
    )


def _relative(got, expected) -> float:
    return (got.float() - expected.float()).norm().item() / max(expected.float().norm().item(), 1e-30)


def _variants(router, w_gate_up, w_down, mine, x, variants: str, wholes: dict, rank: int, world: int) -> dict:
    """The reports of the exact-mode variants (``FORMAT/DISPATCH``) on this rank's tokens x; ``wholes``: weight
    format -> (the one-process block, its output on x), filled as needed."""
    from llmkernels.formats import dequantize
    from llmkernels.moe import MoEFeedForward
    from llmkernels.ops import quantize

    reports = {}
    for variant in filter(None, variants.split(",")):
        weight_format, dispatch_format = variant.split("/")
        block = MoEFeedForward.from_float(
            router,
            w_gate_up[mine],
            w_down[mine],
            TOP_K,
            weight_format=weight_format,
            process_group=dist.group.WORLD,
            dispatch_format=None if dispatch_format == "auto" else dispatch_format,
        )
        if weight_format not in wholes:
            whole = MoEFeedForward.from_float(router, w_gate_up, w_down, TOP_K, weight_format=weight_format)
            wholes[weight_format] = whole, whole(x)
        whole, whole_out = wholes[weight_format]
        got = block(x)
        report = {"dispatch_format": block.dispatch_format, "finite": bool(torch.isfinite(got).all())}
        rows = None
        if block.dispatch_format == "fp8" and block.activation_format == "bf16":
            report["rel_error_vs_bf16"] = _relative(got, whole_out)
            rows = dequantize(quantize(x, "fp8", block=(1, 128))).to(torch.bfloat16)  # what the experts run on
        else:
            report["rel_error_vs_one_process"] = _relative(got, whole_out)
        if block.activation_format == "nvfp4":  # one global scale per quantized set of rows: no bits to match
            reports[variant] = report
            continue
        expected = _exact_expected(whole, router, x, rank, world, rows)
        report["bit_equal"] = bool(torch.equal(got, expected)) and got.shape == x.shape
        report["rel_error"] = _relative(got, expected)
        reports[variant] = report
    return reports


def _run(
    rank: int,
    world: int,
    port: int,
    case: str,
    weight_format: str,
    capacity: int | None,
    out: str,
    variants: str = "",
):
    on_gpu = os.environ.get("EP_DEVICE", "cpu") == "cuda"
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if on_gpu:
        torch.cuda.set_device(rank)
    else:
        os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group(
        "nccl" if on_gpu else "gloo",
        rank=rank,
        world_size=world,
        device_id=torch.device("cuda", rank) if on_gpu else None,
    )
    from llmkernels.moe import MoEFeedForward

    device = torch.device("cuda", rank) if on_gpu else torch.device("cpu")
    router, w_gate_up, w_down, xs = (
        tensor.to(device) if isinstance(tensor, torch.Tensor) else [x.to(device) for x in tensor]
        for tensor in _problem(world, case)
    )
    per_rank = NUM_EXPERTS // world
    mine = slice(rank * per_rank, (rank + 1) * per_rank)
    report = {"rank": rank}
    if case == "bad-inputs":
        report["errors"] = _bad_inputs(router, w_gate_up, w_down, mine, xs[rank])
        _finish(report, out, rank)
        return
    try:
        top_k = TOP_K + 1 if case == "disagree" and rank == 0 else TOP_K
        block = MoEFeedForward.from_float(
            router,
            w_gate_up[mine],
            w_down[mine],
            top_k,
            weight_format=weight_format,
            process_group=dist.group.WORLD,
            capacity=capacity,
        )
    except ValueError as error:
        report["error"] = str(error)
    else:
        whole = MoEFeedForward.from_float(router, w_gate_up, w_down, TOP_K, weight_format=weight_format)
        x = xs[rank]
        whole_out = whole(x)
        got = block(x).float()
        expected = (whole_out if capacity is not None else _exact_expected(whole, router, x, rank, world)).float()
        if case == "graph":
            report["graph_equal"] = bool(torch.equal(_graph_replay(block, xs[rank]).float(), got))
        kept_copies = _kept_copies(router, xs, rank, world, capacity)
        kept = kept_copies.all(dim=1)  # tokens with every copy computed
        difference = (got[kept] - expected[kept]).norm().item()
        report.update(
            bit_equal=bool(torch.equal(got[kept], expected[kept])),
            tokens=x.shape[0],
            tokens_whole=int(kept.sum()),
            finite=bool(torch.isfinite(got).all()),
            rel_error=difference / max(expected[kept].norm().item(), 1e-30),
            shape_ok=got.shape == x.shape,
            dropped=None if block.exchange.dropped is None else int(block.exchange.dropped),
            dropped_expected=int((~kept_copies).sum()),
            copies_to=_copies_to(router, x, world),
            rel_error_vs_one_process=_relative(got, whole_out),
            variants=_variants(
                router, w_gate_up, w_down, mine, x, variants, {weight_format: (whole, whole_out)}, rank, world
            ),
        )
    _finish(report, out, rank)


def _finish(report: dict, out: str, rank: int) -> None:
    """Writes the report, waits for every rank to have written its own, and exits at once. The process group is
    not torn down: gloo's teardown aborted a rank now and then ("terminate called without an active exception",
    after its report was written; again in a CI run of session 18), and the parent reads only the reports."""
    with open(f"{out}.{rank}.json", "w") as file:
        json.dump(report, file)
    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    world, port, case, weight_format, capacity, out = sys.argv[1:7]
    variants = sys.argv[7] if len(sys.argv) > 7 else ""
    mp.spawn(
        _run,
        args=(int(world), int(port), case, weight_format, None if capacity == "none" else int(capacity), out, variants),
        nprocs=int(world),
    )
