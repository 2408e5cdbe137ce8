"""Apex's ``amp_C`` extension module, with Apex's signatures, on mpnb's kernels.

Code that calls ``amp_C.multi_tensor_l2norm(chunk_size, noop_flag, [tensors], per_tensor)``
directly (Megatron does) runs unchanged against ``mpnb.amp_C``. ``chunk_size`` is accepted for
compatibility; the CPU kernels use their own cache-sized chunks, so results do not depend on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops import multi_tensor as _mt

__all__ = [
    "multi_tensor_scale",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_check_finite",
    "update_scale_hysteresis",
]

TensorLists = Sequence[Sequence[torch.Tensor]]


def _lists(op: str, tensor_lists: TensorLists, n: int) -> list[list[torch.Tensor]]:
    if len(tensor_lists) != n:
        raise ValueError(
            f"amp_C.{op}: expected {n} tensor list(s) in tensor_lists, got {len(tensor_lists)}; "
            f"pass [{', '.join(f'list{i}' for i in range(n))}]."
        )
    return [list(t) for t in tensor_lists]


def multi_tensor_scale(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, scale: float) -> None:
    """``tensor_lists = [src, dst]``: ``dst = src * scale``, flag non-finite ``src`` values."""
    src, dst = _lists("multi_tensor_scale", tensor_lists, 2)
    _mt.multi_tensor_scale(noop_flag, src, dst, scale)


def multi_tensor_axpby(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, a: float, b: float, arg_to_check: int
) -> None:
    """``tensor_lists = [x, y, out]``: ``out = a*x + b*y``; ``arg_to_check`` -1/0/1 as in Apex."""
    x, y, out = _lists("multi_tensor_axpby", tensor_lists, 3)
    _mt.multi_tensor_axpby(noop_flag, x, y, out, a, b, arg_to_check)


def multi_tensor_l2norm(
    chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists, per_tensor: bool | None = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``tensor_lists = [tensors]``: ``(global_norm[1], per_tensor_norms[n or 0])``."""
    (x,) = _lists("multi_tensor_l2norm", tensor_lists, 1)
    return _mt.multi_tensor_l2norm(noop_flag, x, bool(per_tensor))


def multi_tensor_unscale_l2norm(
    chunk_size: int,
    noop_flag: torch.Tensor,
    tensor_lists: TensorLists,
    inv_scale: torch.Tensor,
    per_tensor: bool | None = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Norms of ``tensors * inv_scale`` without modifying the tensors (grad clipping under amp)."""
    (x,) = _lists("multi_tensor_unscale_l2norm", tensor_lists, 1)
    if not isinstance(inv_scale, torch.Tensor):
        inv_scale = torch.tensor([float(inv_scale)], dtype=torch.float32)
    return _mt.multi_tensor_l2norm(noop_flag, x, bool(per_tensor), inv_scale)


def multi_tensor_check_finite(chunk_size: int, noop_flag: torch.Tensor, tensor_lists: TensorLists) -> None:
    """``tensor_lists = [tensors]``: read-only inf/NaN check (an mpnb addition to amp_C)."""
    (x,) = _lists("multi_tensor_check_finite", tensor_lists, 1)
    _mt.multi_tensor_check_finite(noop_flag, x)


def update_scale_hysteresis(
    current_scale: torch.Tensor,
    growth_tracker: torch.Tensor,
    hysteresis_tracker: torch.Tensor,
    found_inf: torch.Tensor,
    growth_factor: float,
    backoff_factor: float,
    growth_interval: int,
    hysteresis: int,
) -> torch.Tensor:
    """Apex's loss-scale update with hysteresis, in place; returns ``current_scale``."""
    return _mt.update_scale_hysteresis(
        current_scale, growth_tracker, hysteresis_tracker, found_inf,
        growth_factor, backoff_factor, growth_interval, hysteresis,
    )
