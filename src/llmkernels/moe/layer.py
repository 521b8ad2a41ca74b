"""MoEFeedForward: router, dispatch, gate/up grouped matmul with fused SwiGLU, down grouped matmul,
weighted combine; everything on the device, no host sync."""

from __future__ import annotations

import hashlib

import torch
import torch.distributed as dist
from torch import nn

from ..formats import FORMATS, ScaledTensor, dequantize, unwrap_torchao
from ..formats.layouts import HOPPER, ROW, Layout, as_layout
from ..formats.spec import format_spec
from ..grouped_matmul import prefers_hopper_layout
from ..ops import combine, dispatch, grouped_matmul, quantize
from ..routing import check_routing, route, select_experts
from ..routing.exchange import gather_rows
from ..runtime import forward_only
from .expert_parallel import ExpertExchange

__all__ = ["MoEFeedForward", "prefers_hopper_layout"]


def _is_process_group(group) -> bool:
    return dist.is_available() and isinstance(group, dist.ProcessGroup)


def _local_expert_count(process_group, capacity, num_experts: int) -> int:
    """E without a process group, else E / W; checks the expert-parallel arguments before any collective."""
    if process_group is not None and not _is_process_group(process_group):
        raise TypeError(
            f"process_group must be None or a torch.distributed ProcessGroup, got {type(process_group).__name__}"
        )
    if capacity is not None and (isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1):
        raise ValueError(f"capacity must be None (exact mode) or an int >= 1, got {capacity!r}")
    if process_group is None:
        if capacity is not None:
            raise ValueError("capacity needs a process_group (expert parallelism)")
        return num_experts
    world = dist.get_world_size(process_group)
    if num_experts % world:
        raise ValueError(f"the process group's {world} ranks must divide the E = {num_experts} experts")
    return num_experts // world


ROW_LOCAL = ("fp8", "mxfp8", "mxfp4")  # activation formats whose rows quantize alone (nvfp4: one global scale)
DISPATCH_FORMATS = ("bf16", "fp8")


def _dispatch_format(process_group, dispatch_format, activation_format: str) -> str | None:
    """The format the exchange moves rows in (None without a process group), after checking ``dispatch_format``
    (before any collective): None picks the activations' own format where its rows quantize alone (fp8, mxfp8,
    mxfp4), bf16 otherwise; in both modes."""
    if dispatch_format is not None and dispatch_format not in DISPATCH_FORMATS:
        raise ValueError(f"dispatch_format must be None or one of {DISPATCH_FORMATS}, got {dispatch_format!r}")
    if process_group is None and dispatch_format is not None:
        raise ValueError("dispatch_format needs a process_group (expert parallelism)")
    if dispatch_format == "fp8" and activation_format not in ("bf16", "fp8"):
        raise ValueError(
            f"dispatch_format 'fp8' goes with bf16 or fp8 activations (it would round {activation_format} "
            "activations twice); their own format is the default dispatch"
        )
    if process_group is None:
        return None
    if dispatch_format is not None:
        return dispatch_format
    return activation_format if activation_format in ROW_LOCAL else "bf16"


def _check_same_config_on_every_rank(process_group, block, device: torch.device) -> None:
    """One small all_gather at construction: ranks built with different sizes, formats or modes all raise
    (the same ValueError on every rank, never a hang in a later all-to-all)."""
    formats = (block.activation_format, block._weight_formats["w_gate_up"], block._weight_formats["w_down"])
    signature = [
        block.num_experts,
        block.hidden,
        block.intermediate,
        block.top_k,
        -1 if block.exchange.capacity is None else block.exchange.capacity,
        int.from_bytes(
            hashlib.sha256(repr((formats, block.routing, block.dispatch_format)).encode()).digest()[:7], "little"
        ),
    ]
    mine = torch.tensor(signature, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(block.exchange.world)]
    dist.all_gather(every, mine, group=process_group)
    names = ("E", "H", "I", "top_k", "capacity", "formats, routing and dispatch_format")
    for rank, theirs in enumerate(torch.stack(every).tolist()):  # one read of the gathered signatures
        differ = [name for name, a, b in zip(names, signature, theirs) if a != b]
        if differ:
            raise ValueError(
                f"expert-parallel ranks disagree: rank {rank} has another {', '.join(differ)} than "
                f"rank {block.exchange.rank}"
            )


PLAIN = ("bf16",)
FP8_WEIGHT_BLOCK = (128, 128)  # DeepSeek-V3 / Qwen3-FP8 checkpoints: one float32 scale per 128x128 weight tile
FP8_ACTIVATION_BLOCK = (1, 128)  # and one per token and 128 columns of the activations, made on the fly
_ROUTING_ARGUMENTS = ("scoring", "renormalize", "num_groups", "topk_groups", "correction_bias")
_FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what quantize takes


def _weight_format(name: str, weight) -> str:
    """The format of a constructor weight, checked: a valid ScaledTensor's (row or hopper layout), or "bf16"
    for a bf16 tensor."""
    if isinstance(weight, ScaledTensor):
        weight.validate()
        if weight.scale_layout not in (ROW, HOPPER):
            raise ValueError(
                f"{name} must have row-major scales or be in the hopper layout, got {weight.scale_layout!r}"
            )
        if weight.format == "fp8" and tuple(weight.block) != FP8_WEIGHT_BLOCK:
            raise ValueError(f"{name} in fp8 must have block={FP8_WEIGHT_BLOCK} (weights), got block={weight.block}")
        return weight.format
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16:
        raise TypeError(
            f"{name} must be a ScaledTensor or a bf16 tensor, got {getattr(weight, 'dtype', type(weight).__name__)}"
        )
    return "bf16"


def format_family(format: str) -> str:
    """What a quantized format pairs with in the grouped matmul: ``"nvfp4"``, ``"fp8"`` (blocks) or ``"mx"``."""
    return format if format in ("nvfp4", "fp8") else "mx"


def _check_format_pair(activation_format: str, weight_formats: dict) -> None:
    """The pairs the grouped matmul takes: plain bf16 activations with any weights (fp8 weights quantize them to
    fp8 inside the call); quantized activations with quantized weights of their family (nvfp4 with nvfp4 only,
    fp8 with fp8 only)."""
    if activation_format not in PLAIN + tuple(FORMATS):
        raise ValueError(f"activation_format must be 'bf16' or one of {tuple(FORMATS)}, got {activation_format!r}")
    if activation_format in PLAIN:
        return
    for name, weight_format in weight_formats.items():
        if weight_format in PLAIN or format_family(weight_format) != format_family(activation_format):
            raise ValueError(
                f"activation_format {activation_format!r} does not pair with {weight_format} {name}: "
                f"quantized activations need quantized weights of their family (nvfp4 pairs only with nvfp4, "
                f"fp8 only with fp8)"
            )


def _check_block_arguments(
    router_weight,
    w_gate_up,
    w_down,
    top_k,
    activation_format: str,
    weight_formats: dict,
    process_group,
    capacity,
    routing: dict,
    dispatch_format: str | None = None,
) -> tuple[int, int, int, int, str | None]:
    """Every argument of the block (the weights' types excepted) before anything is quantized, copied or
    gathered; returns ``(E, H, I, local E, the dispatch's format)``.

    Raises:
        TypeError / ValueError: naming the argument (shapes, format pairs, blocks, routing, devices, group).
    """
    if not isinstance(router_weight, torch.Tensor) or not router_weight.is_floating_point():
        raise TypeError(f"router_weight must be a floating [E, H] tensor, got {type(router_weight).__name__}")
    if router_weight.dim() != 2:
        raise ValueError(f"router_weight must be [E, H], got shape {tuple(router_weight.shape)}")
    num_experts, hidden = router_weight.shape
    num_local = _local_expert_count(process_group, capacity, num_experts)
    local = "" if process_group is None else " (this rank's experts: E / world size)"
    if (
        len(w_gate_up.shape) != 3
        or w_gate_up.shape[0] != num_local
        or w_gate_up.shape[2] != hidden
        or w_gate_up.shape[1] % 2
    ):
        raise ValueError(f"w_gate_up must be [{num_local}{local}, 2I, H={hidden}], got {tuple(w_gate_up.shape)}")
    intermediate = w_gate_up.shape[1] // 2
    if tuple(w_down.shape) != (num_local, hidden, intermediate):
        raise ValueError(
            f"w_down must be [E, H, I] = [{num_local}{local}, {hidden}, {intermediate}], got {tuple(w_down.shape)}"
        )
    _check_format_pair(activation_format, weight_formats)
    exchanged = _dispatch_format(process_group, dispatch_format, activation_format)
    for fmt in {activation_format, *weight_formats.values()} - set(PLAIN) - {"fp8"}:  # fp8: partial tiles
        block = format_spec(fmt).block
        if hidden % block or intermediate % block:
            raise ValueError(f"{fmt} quantizes blocks of {block} along H and I, got H = {hidden}, I = {intermediate}")
    check_routing(
        num_experts,
        top_k,
        routing["scoring"],
        routing["num_groups"],
        routing["topk_groups"],
        routing["correction_bias"],
        router_weight.device,
    )
    for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if weight.device != router_weight.device:
            raise ValueError(f"{name} is on {weight.device} but router_weight on {router_weight.device}")
    return num_experts, hidden, intermediate, num_local, exchanged


class MoEFeedForward(nn.Module):
    """A Mixture-of-Experts feed-forward block on block-scaled expert weights.

    ``forward(hidden_states [..., H]) -> [..., H]`` (same dtype): route each token to ``top_k`` of
    ``E`` experts, run ``down(silu(gate(x)) · up(x))`` of each expert on its tokens with two grouped
    matmuls (SwiGLU fused into the first), and sum the experts' outputs weighted by the router.

    Build it from float weights with :meth:`from_float`. Weights: ``router_weight`` ``[E, H]``,
    ``w_gate_up`` ``[E, 2I, H]`` (``[gate | up]`` rows) and ``w_down`` ``[E, H, I]``, quantized to
    ``weight_format`` (or bf16) and kept as byte buffers (``.to(device)`` moves them; dtype casts of
    the module leave them alone); activations are quantized to ``activation_format`` before each
    grouped matmul (``"bf16"``: none, weight-only quantization), which needs weights of its family.

    fp8 blocks (DeepSeek-V3 / Qwen3-FP8 checkpoints): weights are fp8 ScaledTensors with ``block=(128, 128)``
    (one float32 scale per 128x128 tile of each expert's ``[N, K]``), activations fp8 with ``block=(1, 128)``
    (one scale per token and 128 columns), quantized in the dispatch's gather (``quantize(..., rows=)``: no
    ``[T·k, H]`` copy of x) and after the SwiGLU; H and I need not be multiples of 128 (partial tiles).

    With a ``process_group`` (expert parallelism, :mod:`llmkernels.moe.expert_parallel`), ``capacity`` and
    ``dispatch_format`` choose how the tokens travel (:meth:`from_float`); both modes move fp8, mxfp8 and mxfp4
    activations quantized, once per token.

    The constructor checks every argument (shapes, format pairs, blocks, routing, devices, the process group)
    before it copies anything, and raises TypeError / ValueError naming it.
    """

    def __init__(
        self,
        router_weight: torch.Tensor,
        w_gate_up,
        w_down,
        top_k: int,
        *,
        activation_format: str = "bf16",
        scoring: str = "softmax",
        renormalize: bool = True,
        num_groups: int | None = None,
        topk_groups: int | None = None,
        correction_bias: torch.Tensor | None = None,
        process_group=None,
        capacity: int | None = None,
        dispatch_format: str | None = None,
    ):
        super().__init__()
        self._weight_formats = {}
        self._weight_layouts = {}  # name -> (scale_layout, logical shape)
        self._weight_views = {}  # name -> (the buffers it was made of, the view)
        w_gate_up, w_down = unwrap_torchao(w_gate_up), unwrap_torchao(w_down)  # torchao tensors: as ScaledTensors
        weight_formats = {
            name: _weight_format(name, weight) for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down))
        }
        self.routing = dict(scoring=scoring, renormalize=renormalize, num_groups=num_groups, topk_groups=topk_groups)
        num_experts, hidden, intermediate, num_local, self.dispatch_format = _check_block_arguments(
            router_weight,
            w_gate_up,
            w_down,
            top_k,
            activation_format,
            weight_formats,
            process_group,
            capacity,
            {**self.routing, "correction_bias": correction_bias},
            dispatch_format,
        )
        # The buffers are dense copies of whatever views were given: the forward then never re-copies them.
        self.register_buffer("router_weight", router_weight.detach().contiguous())
        self._register_weight("w_gate_up", w_gate_up)
        self._register_weight("w_down", w_down)
        self.num_experts, self.hidden, self.intermediate, self.top_k = num_experts, hidden, intermediate, top_k
        self.activation_format = activation_format
        self.register_buffer(
            "correction_bias", None if correction_bias is None else correction_bias.detach().contiguous()
        )
        self.register_buffer("expert_ids", torch.arange(num_local, dtype=torch.int32, device=router_weight.device))
        self.exchange = None
        if process_group is not None:
            row_local = activation_format in PLAIN + ROW_LOCAL  # not nvfp4: its global scale spans the rows
            self.exchange = ExpertExchange(
                process_group, num_experts, capacity, router_weight.device, pad_rows=row_local
            )
            _check_same_config_on_every_rank(process_group, self, router_weight.device)

    def _register_weight(self, name: str, weight) -> None:
        """Buffers of the weight's bytes: ``.to(device)`` moves them, and ``.half()`` and friends
        cannot cast quantized data (uint8 and int32 bit views are not floating point)."""
        if isinstance(weight, ScaledTensor):  # checked by _weight_format
            parts = (
                weight.data.contiguous().view(torch.uint8),
                weight.scales.contiguous().view(torch.uint8),
                weight.global_scale.reshape(1).contiguous().view(torch.int32)
                if weight.global_scale is not None
                else None,
            )
            self._weight_formats[name] = weight.format
            self._weight_layouts[name] = (weight.scale_layout, tuple(weight.shape), tuple(weight.block))
        else:
            parts = (weight.detach().contiguous().view(torch.int16), None, None)
            self._weight_formats[name] = "bf16"
        for suffix, part in zip(("data", "scales", "global_scale_bits"), parts):
            self.register_buffer(f"{name}_{suffix}", part)

    def weight(self, name: str):
        """``"w_gate_up"`` or ``"w_down"`` as the grouped matmul takes it (a view of the buffers, made again
        when a buffer was replaced, e.g. by ``.to()``)."""
        parts = (
            getattr(self, f"{name}_data"),
            getattr(self, f"{name}_scales"),
            getattr(self, f"{name}_global_scale_bits"),
        )
        cached = self._weight_views.get(name)
        if cached is not None and all(a is b for a, b in zip(cached[0], parts)) and not torch.compiler.is_compiling():
            return cached[1]
        data, scales, global_scale_bits = parts
        format = self._weight_formats[name]
        if format == "bf16":
            view = data.view(torch.bfloat16)
        else:
            global_scale = global_scale_bits.view(torch.float32).reshape(()) if global_scale_bits is not None else None
            spec = format_spec(format)
            # The parts were checked at registration and keep their shapes (``.to()`` and state dicts copy
            # them whole); the grouped matmul checks them again whenever it plans.
            layout, shape, block = self._weight_layouts[name]
            view = ScaledTensor.unchecked(
                data.view(spec.data_dtype),
                scales.view(spec.scale_dtype),
                format,
                global_scale,
                layout,
                logical_shape=shape if layout.rearranges_data else None,
                block=block,
            )
        self._weight_views[name] = (parts, view)
        return view

    @property
    def w_gate_up(self):
        return self.weight("w_gate_up")

    @property
    def w_down(self):
        return self.weight("w_down")

    @classmethod
    def from_float(
        cls,
        router_weight: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        top_k: int,
        *,
        weight_format: str = "mxfp8",
        activation_format: str | None = None,
        weight_layout: Layout | str | None = None,
        process_group=None,
        capacity: int | None = None,
        dispatch_format: str | None = None,
        **routing,
    ) -> MoEFeedForward:
        """Quantizes float expert weights once.

        Args:
            router_weight: ``[E, H]``; w_gate_up: ``[E, 2I, H]`` (``[gate | up]``); w_down: ``[E, H, I]``. With a
                ``process_group`` of W ranks, w_gate_up and w_down hold only this rank's ``E / W`` experts
                (rank r: experts ``r·E/W … (r+1)·E/W − 1``) while router_weight stays the full ``[E, H]``.
            weight_format: ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"``, ``"fp8"`` (128x128 blocks, float32 scales:
                ``quantize(w, "fp8", block=(128, 128))``) or ``"bf16"``.
            activation_format: default: mxfp8 activations for mxfp8 weights, nvfp4 for nvfp4, fp8 (1x128
                blocks) for fp8, bf16 otherwise (mxfp4 weights run weight-only, as gpt-oss does on Hopper).
                ``"bf16"`` with fp8 weights gives the same result: the grouped matmul quantizes them to fp8
                inside the call (a separate pass over the dispatched copies).
            weight_layout: the row layout (the only one of fp8) or the Hopper layout (mxfp4 and nvfp4), as a
                :class:`~llmkernels.formats.layouts.Layout` or its name (:meth:`ScaledTensor.to_layout`). Default:
                the Hopper layout for mxfp4 and nvfp4 weights where :func:`prefers_hopper_layout` (on the router
                weight's device; not chosen again by ``.to()``), the row layout otherwise.
            process_group: None (one process holds every expert), or a ``torch.distributed`` group: expert
                parallelism (:mod:`llmkernels.moe.expert_parallel`); ``forward`` then takes this rank's own tokens
                and returns their outputs in their order. Every rank must build the block with the same sizes,
                formats, routing and capacity (checked by one all_gather here; a mismatch raises ValueError on
                every rank). Collectives wait for every rank: set the group's ``timeout`` (e.g.
                ``init_process_group(..., timeout=timedelta(minutes=2))``) so that a rank that died ends the
                others' wait with an error.
            capacity: with a process_group: None for the exact mode (the per-rank counts are read on the host:
                one sync per forward), or the rows each rank sends to each rank (bounded mode: no sync, CUDA-graph
                capturable; copies beyond it are dropped and counted in ``block.exchange.dropped``). The exact
                mode sums each token's copies on their expert rank (one bf16 rounding of each other rank's partial
                sum, :mod:`llmkernels.moe.expert_parallel`); the bounded mode returns every copy.
            dispatch_format: the format the tokens travel in (both modes). None: the activations' own format
                where each row quantizes alone (fp8 (1, 128), mxfp8, mxfp4: quantized once per token on the sender,
                never again on the receiver; same bits as bf16 rows), bf16 otherwise (bf16 activations, nvfp4 whose
                global scale spans the rows). ``"bf16"``: bf16 rows, the receiver quantizes. ``"fp8"`` (bf16 or fp8
                activations): fp8 (1, 128) rows decoded to bf16 on receipt, half the bytes of bf16; the experts then
                run on the tokens rounded to fp8 (routing still reads the bf16 tokens), an output error within
                2^-4 relative (norm) of bf16 rows, measured 0.037-0.038 at the tests' sizes.
            routing: keyword arguments of :func:`llmkernels.moe.route`.

        Every argument is checked before anything is quantized (no launch before an error). Weights that
        require grad are detached, as the constructor keeps its weights (inference buffers).

        Raises:
            TypeError: process_group not a ``torch.distributed`` ProcessGroup, weights that are not float
                tensors (bf16 / fp16 / fp32 for a quantized weight_format), an unknown routing keyword, and
                what :func:`llmkernels.moe.route` raises for the routing types.
            ValueError: an unknown weight_format, activation_format or weight_layout, the Hopper layout for mxfp8,
                fp8 or bf16 weights, formats that do not pair (quantized activations need weights of their family),
                H or I not a multiple of a format's block (fp8 takes partial tiles), shapes that do not fit, a
                world size that does not divide E, local weights of another expert count, a capacity below 1 or
                without a group, an unknown dispatch_format, one without a group, ``"fp8"`` with activations other than bf16 and fp8, routing
                values that do not fit (top_k, scoring, groups, a correction_bias not
                ``[E]``), tensors on other devices, ranks that disagree.
        """
        if weight_format not in PLAIN + tuple(FORMATS):
            raise ValueError(f"weight_format must be 'bf16' or one of {tuple(FORMATS)}, got {weight_format!r}")
        if activation_format is None:
            activation_format = weight_format if weight_format in ("mxfp8", "nvfp4", "fp8") else "bf16"
        unknown = sorted(set(routing) - set(_ROUTING_ARGUMENTS))
        if unknown:
            raise TypeError(f"from_float got unknown routing keywords {unknown}: expected {_ROUTING_ARGUMENTS}")
        for name, weight in (("router_weight", router_weight), ("w_gate_up", w_gate_up), ("w_down", w_down)):
            if not isinstance(weight, torch.Tensor) or weight.dtype not in _FLOAT_DTYPES:
                raise TypeError(
                    f"{name} must be a bf16, fp16 or fp32 tensor, got {getattr(weight, 'dtype', type(weight).__name__)}"
                )
        in_layout = HOPPER.holds(weight_format)
        if weight_layout is None:
            weight_layout = HOPPER if in_layout and prefers_hopper_layout(router_weight.device) else ROW
        if weight_layout not in (ROW, HOPPER) or (weight_layout == HOPPER and not in_layout):
            raise ValueError(
                f"weight_layout must be {ROW!r}, or {HOPPER!r} for "
                f"{' and '.join(sorted(HOPPER.formats))} weights, got {weight_layout!r} for "
                f"{weight_format}"
            )
        weight_layout = as_layout(weight_layout)
        routing_arguments = {
            "scoring": "softmax",
            "renormalize": True,
            "num_groups": None,
            "topk_groups": None,
            "correction_bias": None,
            **routing,
        }
        _check_block_arguments(
            router_weight,
            w_gate_up,
            w_down,
            top_k,
            activation_format,
            {"w_gate_up": weight_format, "w_down": weight_format},
            process_group,
            capacity,
            routing_arguments,
            dispatch_format,
        )

        def convert(w):
            w = w.detach()
            if weight_format == "bf16":
                return w.to(torch.bfloat16)
            if weight_format == "fp8":
                return quantize(w.contiguous(), "fp8", block=FP8_WEIGHT_BLOCK)
            return quantize(w.contiguous(), weight_format, scale_layout=weight_layout)

        return cls(
            router_weight,
            convert(w_gate_up),
            convert(w_down),
            top_k,
            activation_format=activation_format,
            process_group=process_group,
            capacity=capacity,
            dispatch_format=dispatch_format,
            **routing,
        )

    def _activations(self, x: torch.Tensor, rows: torch.Tensor | None = None):
        """``x`` (or ``x[rows]``) as the grouped matmul's A: bf16, or quantized with the gather
        inside the quantize kernel (no ``[T·k, H]`` copy of x)."""
        if self.activation_format == "bf16":
            return x if rows is None else x[rows]
        if self.activation_format == "fp8":
            return quantize(x, "fp8", block=FP8_ACTIVATION_BLOCK, rows=rows)
        return quantize(x, self.activation_format, rows=rows)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """``[..., H]`` bf16/fp16/fp32 (any strides) → ``[..., H]`` of the same dtype.

        Raises:
            TypeError: hidden_states not a floating tensor.
            ValueError: its last dim is not H, or it requires grad (the block is forward-only).
        """
        if not isinstance(hidden_states, torch.Tensor) or not hidden_states.is_floating_point():
            raise TypeError(f"hidden_states must be a floating tensor, got {type(hidden_states).__name__}")
        forward_only("MoEFeedForward", hidden_states=hidden_states)
        if hidden_states.dim() < 1 or hidden_states.shape[-1] != self.hidden:
            raise ValueError(f"hidden_states must end in H = {self.hidden}, got {tuple(hidden_states.shape)}")
        x = hidden_states.reshape(-1, self.hidden).contiguous()  # the router matmul rounds by layout
        logits = x.float() @ self.router_weight.float().t()
        if self.routing["num_groups"] is None and not torch.compiler.is_compiling():
            weights, expert_ids = select_experts(
                logits,
                self.top_k,
                scoring=self.routing["scoring"],
                renormalize=self.routing["renormalize"],
                correction_bias=self.correction_bias,
            )
        else:
            weights, expert_ids = route(logits, self.top_k, correction_bias=self.correction_bias, **self.routing)
        if self.exchange is None:
            y, row_of_copy = self._experts(x.to(torch.bfloat16), expert_ids)
            return combine(y, row_of_copy, weights, hidden_states.dtype).reshape(hidden_states.shape)
        if self.exchange.capacity is None:
            return self.exchange.exact(
                self._dispatched(x.to(torch.bfloat16)),
                expert_ids,
                weights,
                self._received,
                self._projections,
                self.hidden,
                hidden_states.dtype,
            ).reshape(hidden_states.shape)
        rows, local_ids, state = self.exchange.send(self._dispatched(x.to(torch.bfloat16)), expert_ids)
        token_of_row, a_offsets, row_of_row = dispatch(local_ids.view(-1, 1), len(self.expert_ids))
        y = self._projections(self._received(rows, token_of_row), a_offsets, self.expert_ids)
        results, row_of_copy = self.exchange.receive(y[row_of_row.view(-1)], state)  # rows in arrival order
        return combine(results, row_of_copy.view(weights.shape), weights, hidden_states.dtype).reshape(
            hidden_states.shape
        )

    def _dispatched(self, x: torch.Tensor) -> list:
        """The exact mode's payload of bf16 ``x [T, H]``: ``[x]``, or each row quantized once to the dispatch
        format, as ``[data (uint8 bytes), scales (float32 or uint8 bytes)]``."""
        if self.dispatch_format == "bf16":
            return [x]
        if self.dispatch_format == self.activation_format:
            q = self._activations(x)
        else:  # fp8 rows for bf16 activations
            q = quantize(x, "fp8", block=FP8_ACTIVATION_BLOCK)
        scales = q.scales if q.scales.dtype == torch.float32 else q.scales.view(torch.uint8)
        return [q.data.view(torch.uint8), scales]

    def _received(self, rows: list, token_of_row: torch.Tensor, count: torch.Tensor | None = None):
        """The grouped matmul's A from the rows ``token_of_row`` of received payload ``rows`` (:meth:`_dispatched`'s
        parts, ``[R, ...]``): quantized rows are read as they arrived (never quantized again), fp8 rows for bf16
        activations are decoded to bf16, bf16 rows are quantized as the activations are. With ``count`` (a device
        scalar) the rows from ``count`` on are padding: copies of payload rows are made below it only."""
        if self.dispatch_format == "bf16":
            if self.activation_format == "bf16" and count is not None:
                return gather_rows(rows[0], token_of_row, count)
            return self._activations(rows[0], token_of_row)
        if count is None:
            rows = [part.index_select(0, token_of_row) for part in rows]
        else:
            rows = [gather_rows(part, token_of_row, count) for part in rows]
        spec = format_spec(self.dispatch_format)
        block = FP8_ACTIVATION_BLOCK if self.dispatch_format == "fp8" else None
        a = ScaledTensor.unchecked(
            rows[0].view(spec.data_dtype), rows[1].view(spec.scale_dtype), self.dispatch_format, block=block
        )
        return dequantize(a).to(torch.bfloat16) if self.activation_format == "bf16" else a

    def _experts(self, x: torch.Tensor, expert_ids: torch.Tensor):
        """The one-process block's experts on bf16 ``x [T, H]`` routed by ``expert_ids [T, k]``: ``(y, row_of_copy)``,
        the outputs in expert-sorted rows and the row of each (token, slot) copy."""
        token_of_row, a_offsets, row_of_copy = dispatch(expert_ids, self.num_experts)
        return self._projections(self._activations(x, token_of_row), a_offsets, self.expert_ids), row_of_copy

    def _projections(self, a, a_offsets: torch.Tensor, expert_ids: torch.Tensor, out: torch.Tensor | None = None):
        """gate_up with the SwiGLU, then down, on the grouped matmul's A ``a [R, H]`` (groups of ``a_offsets``, local
        expert ``expert_ids[g]``): bf16 ``[R, H]`` (written into ``out`` when given)."""
        h = grouped_matmul(a, self.w_gate_up, a_offsets, expert_ids, epilogue="swiglu")
        return grouped_matmul(self._activations(h), self.w_down, a_offsets, expert_ids, out=out)
