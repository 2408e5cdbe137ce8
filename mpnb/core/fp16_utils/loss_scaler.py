"""Apex's legacy ``fp16_utils`` loss scalers (host-side scale, Python API of Apex).

``has_overflow`` checks every grad in one ``multi_tensor_check_finite`` pass and reads the
flag once (its host sync). New code should prefer :class:`mpnb.amp.LossScaler`.
"""

from __future__ import annotations

import difflib
import inspect
from collections.abc import Mapping

import torch

from mpnb.core._numbers import positive_finite
from mpnb.core.ops import multi_tensor_check_finite

__all__ = ["LossScaler", "DynamicLossScaler"]


def _grads_overflow(params) -> bool:
    grads = [p.grad for p in params if p.grad is not None]
    if not grads:
        return False
    flag = torch.zeros(1, dtype=torch.int32, device=grads[0].device)
    for dt in {g.dtype for g in grads}:
        multi_tensor_check_finite(flag, [g.contiguous() for g in grads if g.dtype == dt])
    return bool(flag.item())


class LossScaler:
    """A static loss scale (Apex's ``fp16_utils.LossScaler``).

    Args:
        scale: the fixed factor.

    Example::

        >>> s = LossScaler(128.0); s.backward(loss)   # (loss * 128).backward()
    """

    def __init__(self, scale: float = 1.0):
        self.cur_scale = positive_finite(scale, "scale", owner="LossScaler")

    @property
    def loss_scale(self) -> float:
        """The current scale."""
        return self.cur_scale

    def has_overflow(self, params) -> bool:
        """Static scaling never reports an overflow (as in Apex)."""
        return False

    def update_scale(self, overflow: bool) -> None:
        """Nothing to update for a static scale."""

    def scale_gradient(self, module, grad_in, grad_out):
        """Backward-hook helper: multiply ``grad_in`` by the scale."""
        return tuple(self.loss_scale * g for g in grad_in)

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        """``(loss * scale).backward()``."""
        (loss.float() * self.loss_scale).backward(retain_graph=retain_graph)


class DynamicLossScaler(LossScaler):
    """Apex's dynamic scaler: halve on overflow (not below 1), double every ``scale_window``.

    Args:
        init_scale: the first scale (Apex: 2**32).
        scale_factor: growth and backoff factor (> 1).
        scale_window: clean iterations between growths.
        max_skips_at_min: ``FP16_Optimizer`` raises
            :class:`~mpnb.core.amp.LossScaleCollapseError` after this many consecutive skipped
            steps at the floor scale 1 (None: never).

    Example::

        >>> s = DynamicLossScaler(init_scale=2.0**16, scale_window=1000)
        >>> s.update_scale(s.has_overflow(model.parameters()))
    """

    def __init__(
        self,
        init_scale: float = 2.0**32,
        scale_factor: float = 2.0,
        scale_window: int = 1000,
        max_skips_at_min: int | None = 100,
    ):
        super().__init__(positive_finite(init_scale, "init_scale", owner="DynamicLossScaler"))
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = positive_finite(scale_factor, "scale_factor", owner="DynamicLossScaler")
        if self.scale_factor <= 1:
            raise ValueError(
                f"DynamicLossScaler: scale_factor={scale_factor!r} must be > 1 (it is both the "
                "growth and the inverse backoff factor)."
            )
        if isinstance(scale_window, bool) or not isinstance(scale_window, int) or scale_window < 1:
            raise ValueError(
                f"DynamicLossScaler: scale_window={scale_window!r} must be a positive int."
            )
        self.scale_window = scale_window
        self.max_skips_at_min = max_skips_at_min

    @classmethod
    def from_args(cls, args, owner: str = "FP16_Optimizer") -> DynamicLossScaler:
        """The scaler of ``owner``'s ``dynamic_loss_args`` (a dict of this constructor's
        keywords, or None), with a TypeError naming the valid keys for anything else.

        Example::

            >>> DynamicLossScaler.from_args({"init_scale": 2.0**16}).cur_scale
            65536.0
        """
        valid = [k for k in inspect.signature(cls.__init__).parameters if k != "self"]
        if args is None:
            return cls()
        form = "dynamic_loss_args={'init_scale': 2.0**16, 'scale_window': 1000}"
        if not isinstance(args, Mapping):
            raise TypeError(
                f"{owner}: dynamic_loss_args must be a dict of DynamicLossScaler's keywords "
                f"({', '.join(valid)}), got {type(args).__name__} {args!r}; e.g. {form}."
            )
        unknown = [k for k in args if k not in valid]
        if unknown:
            close = difflib.get_close_matches(str(unknown[0]), valid, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise TypeError(
                f"{owner}: dynamic_loss_args has no key {unknown[0]!r}{hint}; the valid keys "
                f"are {', '.join(valid)}, e.g. {form}."
            )
        return cls(**args)

    def has_overflow(self, params) -> bool:
        """True when any grad of ``params`` holds inf or NaN (one pass, one host sync)."""
        return _grads_overflow(list(params))

    def update_scale(self, overflow: bool) -> None:
        """Apex's rule: on overflow halve (floor 1); else grow every ``scale_window`` iters."""
        if overflow:
            self.cur_scale = max(self.cur_scale / self.scale_factor, 1.0)
            self.last_overflow_iter = self.cur_iter
        elif (self.cur_iter - self.last_overflow_iter) % self.scale_window == 0:
            self.cur_scale *= self.scale_factor
        self.cur_iter += 1
