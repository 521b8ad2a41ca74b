"""MoEFeedForward: router, dispatch, gate/up grouped matmul with fused SwiGLU, down grouped matmul,
weighted combine; everything on the device, no host sync."""
from __future__ import annotations

import torch
from torch import nn

from .._runtime import cuda_capability, forward_only, interpreting
from ..formats import FORMATS, HOPPER_FORMATS, ScaledTensor, unwrap_torchao
from ..formats.spec import format_spec
from ..ops import combine, dispatch, grouped_matmul, quantize
from ..routing import check_correction_bias, route, select_experts

__all__ = ["MoEFeedForward"]


def _is_hopper(device: torch.device) -> bool:
    return device.type == "cuda" and not interpreting() and cuda_capability(device)[0] == 9

PLAIN = ("bf16",)


class MoEFeedForward(nn.Module):
    """A Mixture-of-Experts feed-forward block on block-scaled expert weights.

    ``forward(hidden_states [..., H]) -> [..., H]`` (same dtype): route each token to ``top_k`` of
    ``E`` experts, run ``down(silu(gate(x)) · up(x))`` of each expert on its tokens with two grouped
    matmuls (SwiGLU fused into the first), and sum the experts' outputs weighted by the router.

    Build it from float weights with :meth:`from_float`. Weights: ``router_weight`` ``[E, H]``,
    ``w_gate_up`` ``[E, 2I, H]`` (``[gate | up]`` rows) and ``w_down`` ``[E, H, I]``, quantized to
    ``weight_format`` (or bf16) and kept as byte buffers (``.to(device)`` moves them; dtype casts of
    the module leave them alone); activations are quantized to ``activation_format`` before each
    grouped matmul (``"bf16"``: none, weight-only quantization).
    """

    def __init__(self, router_weight: torch.Tensor, w_gate_up, w_down, top_k: int, *,
                 activation_format: str = "bf16", scoring: str = "softmax", renormalize: bool = True,
                 num_groups: int | None = None, topk_groups: int | None = None,
                 correction_bias: torch.Tensor | None = None):
        super().__init__()
        self._weight_formats = {}
        self._weight_layouts = {}  # name -> (scale_layout, logical shape)
        self._weight_views = {}  # name -> (the buffers it was made of, the view)
        if activation_format not in PLAIN + tuple(FORMATS):
            raise ValueError(f"activation_format must be 'bf16' or one of {tuple(FORMATS)}, got {activation_format!r}")
        if not isinstance(router_weight, torch.Tensor) or not router_weight.is_floating_point():
            raise TypeError(f"router_weight must be a floating [E, H] tensor, got {type(router_weight).__name__}")
        if router_weight.dim() != 2:
            raise ValueError(f"router_weight must be [E, H], got shape {tuple(router_weight.shape)}")
        num_experts, hidden = router_weight.shape
        w_gate_up, w_down = unwrap_torchao(w_gate_up), unwrap_torchao(w_down)  # torchao tensors: as ScaledTensors
        for name, weight in (("w_gate_up", w_gate_up), ("w_down", w_down)):
            if not isinstance(weight, (torch.Tensor, ScaledTensor)):
                raise TypeError(f"{name} must be a ScaledTensor or a bf16 tensor, got {type(weight).__name__}")
        if (len(w_gate_up.shape) != 3 or w_gate_up.shape[0] != num_experts or w_gate_up.shape[2] != hidden
                or w_gate_up.shape[1] % 2):
            raise ValueError(f"w_gate_up must be [E={num_experts}, 2I, H={hidden}], got {tuple(w_gate_up.shape)}")
        intermediate = w_gate_up.shape[1] // 2
        if tuple(w_down.shape) != (num_experts, hidden, intermediate):
            raise ValueError(f"w_down must be [E, H, I] = [{num_experts}, {hidden}, {intermediate}], "
                             f"got {tuple(w_down.shape)}")
        if isinstance(top_k, bool) or not isinstance(top_k, int) or not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be an int in [1, E={num_experts}], got {top_k!r}")
        check_correction_bias(correction_bias, num_experts)
        self.routing = dict(scoring=scoring, renormalize=renormalize, num_groups=num_groups, topk_groups=topk_groups)
        # The buffers are dense copies of whatever views were given: the forward then never re-copies them.
        self.register_buffer("router_weight", router_weight.detach().contiguous())
        self._register_weight("w_gate_up", w_gate_up)
        self._register_weight("w_down", w_down)
        self.num_experts, self.hidden, self.intermediate, self.top_k = num_experts, hidden, intermediate, top_k
        self.activation_format = activation_format
        self.register_buffer("correction_bias", None if correction_bias is None else correction_bias.detach().contiguous())
        self.register_buffer("expert_ids", torch.arange(num_experts, dtype=torch.int32, device=router_weight.device))

    def _register_weight(self, name: str, weight) -> None:
        """Buffers of the weight's bytes: ``.to(device)`` moves them, and ``.half()`` and friends
        cannot cast quantized data (uint8 and int32 bit views are not floating point)."""
        if isinstance(weight, ScaledTensor):
            weight.validate()
            if weight.scale_layout not in ("row", "hopper"):
                raise ValueError(f"{name} must have row-major scales or be in the hopper layout, got "
                                 f"{weight.scale_layout!r}")
            parts = (weight.data.contiguous().view(torch.uint8), weight.scales.contiguous().view(torch.uint8),
                     weight.global_scale.reshape(1).contiguous().view(torch.int32)
                     if weight.global_scale is not None else None)
            self._weight_formats[name] = weight.format
            self._weight_layouts[name] = (weight.scale_layout, tuple(weight.shape))
        else:
            if not isinstance(weight, torch.Tensor) or weight.dtype != torch.bfloat16:
                raise TypeError(f"{name} must be a ScaledTensor or a bf16 tensor, "
                                f"got {getattr(weight, 'dtype', type(weight).__name__)}")
            parts = (weight.detach().contiguous().view(torch.int16), None, None)
            self._weight_formats[name] = "bf16"
        for suffix, part in zip(("data", "scales", "global_scale_bits"), parts):
            self.register_buffer(f"{name}_{suffix}", part)

    def weight(self, name: str):
        """``"w_gate_up"`` or ``"w_down"`` as the grouped matmul takes it (a view of the buffers, made again
        when a buffer was replaced, e.g. by ``.to()``)."""
        parts = (getattr(self, f"{name}_data"), getattr(self, f"{name}_scales"),
                 getattr(self, f"{name}_global_scale_bits"))
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
            layout, shape = self._weight_layouts[name]
            view = ScaledTensor.unchecked(data.view(spec.data_dtype), scales.view(spec.scale_dtype), format,
                                          global_scale, layout, logical_shape=shape if layout == "hopper" else None)
        self._weight_views[name] = (parts, view)
        return view

    @property
    def w_gate_up(self):
        return self.weight("w_gate_up")

    @property
    def w_down(self):
        return self.weight("w_down")

    @classmethod
    def from_float(cls, router_weight: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, *,
                   weight_format: str = "mxfp8", activation_format: str | None = None, weight_layout: str | None = None,
                   **routing) -> "MoEFeedForward":
        """Quantizes float expert weights once.

        Args:
            router_weight: ``[E, H]``; w_gate_up: ``[E, 2I, H]`` (``[gate | up]``); w_down: ``[E, H, I]``.
            weight_format: ``"mxfp8"``, ``"mxfp4"``, ``"nvfp4"`` or ``"bf16"``.
            activation_format: default: mxfp8 activations for mxfp8 weights, nvfp4 for nvfp4, bf16
                otherwise (mxfp4 weights run weight-only, as gpt-oss does on Hopper).
            weight_layout: ``"row"`` or ``"hopper"`` (mxfp4 and nvfp4: :meth:`ScaledTensor.to_layout`). Default:
                ``"hopper"`` for mxfp4 and nvfp4 weights on a Hopper GPU (compute capability 9.x; the layout is
                chosen on the router weight's device, not again by ``.to()``), ``"row"`` otherwise.
            routing: keyword arguments of :func:`llmkernels.moe.route`.

        Raises:
            ValueError: an unknown weight_layout, or ``"hopper"`` for mxfp8 or bf16 weights.
        """
        if activation_format is None:
            activation_format = weight_format if weight_format in ("mxfp8", "nvfp4") else "bf16"
        in_layout = weight_format in HOPPER_FORMATS
        if weight_layout is None:
            weight_layout = "hopper" if in_layout and _is_hopper(router_weight.device) else "row"
        if weight_layout not in ("row", "hopper") or (weight_layout == "hopper" and not in_layout):
            raise ValueError(f"weight_layout must be 'row', or 'hopper' for mxfp4 and nvfp4 weights, got "
                             f"{weight_layout!r} for {weight_format}")

        def convert(w):
            if weight_format == "bf16":
                return w.to(torch.bfloat16)
            return quantize(w.contiguous(), weight_format, scale_layout=weight_layout)
        return cls(router_weight, convert(w_gate_up), convert(w_down), top_k,
                   activation_format=activation_format, **routing)

    def _activations(self, x: torch.Tensor, rows: torch.Tensor | None = None):
        """``x`` (or ``x[rows]``) as the grouped matmul's A: bf16, or quantized with the gather
        inside the quantize kernel (no ``[T·k, H]`` copy of x)."""
        if self.activation_format == "bf16":
            return x if rows is None else x[rows]
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
            weights, expert_ids = select_experts(logits, self.top_k, scoring=self.routing["scoring"],
                                                 renormalize=self.routing["renormalize"],
                                                 correction_bias=self.correction_bias)
        else:
            weights, expert_ids = route(logits, self.top_k, correction_bias=self.correction_bias, **self.routing)
        token_of_row, a_offsets, row_of_copy = dispatch(expert_ids, self.num_experts)
        a = self._activations(x.to(torch.bfloat16), token_of_row)
        h = grouped_matmul(a, self.w_gate_up, a_offsets, self.expert_ids, epilogue="swiglu")
        y = grouped_matmul(self._activations(h), self.w_down, a_offsets, self.expert_ids)
        return combine(y, row_of_copy, weights, hidden_states.dtype).reshape(hidden_states.shape)
