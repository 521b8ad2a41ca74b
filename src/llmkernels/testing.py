"""Helpers shared by the tests, the benchmarks and the demo: devices, random inputs, poison, errors."""

from __future__ import annotations

import torch

from .runtime import interpreting

__all__ = ["default_device", "on_gpu", "poison", "relative_error", "assert_close_relative", "random_group_offsets"]


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() and not interpreting() else torch.device("cpu")


def on_gpu() -> bool:
    return default_device().type == "cuda"


def poison(tensor: torch.Tensor) -> torch.Tensor:
    """Fills ``tensor`` with NaN (floating) or a sentinel (integer) so that unwritten elements show."""
    if tensor.is_floating_point():
        return tensor.fill_(float("nan"))
    return tensor.fill_(-0x5A5A)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """‖actual − expected‖ / ‖expected‖ in float64; NaN anywhere in ``actual`` gives inf."""
    actual, expected = actual.double(), expected.double()
    if not torch.isfinite(actual).all():
        return float("inf")
    denominator = expected.norm().item()
    numerator = (actual - expected).norm().item()
    if denominator == 0.0:
        return 0.0 if numerator == 0.0 else float("inf")
    return numerator / denominator


def assert_close_relative(actual: torch.Tensor, expected: torch.Tensor, tolerance: float, what: str = "") -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    error = relative_error(actual, expected)
    assert error <= tolerance, f"{what}: relative error {error:.3e} > {tolerance:.1e}"


def random_group_offsets(sizes, device=None) -> torch.Tensor:
    """int32 ``[G + 1]`` prefix sums of ``sizes`` (a list of group sizes)."""
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + int(size))
    return torch.tensor(offsets, dtype=torch.int32, device=device)
