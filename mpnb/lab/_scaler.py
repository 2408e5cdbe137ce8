"""The lab's loss scaler: GradScaler-style settings on amp's scaler, and a timed update.

``amp.initialize`` takes Apex's loss-scale arguments (``"dynamic"`` or a number); the lab also
accepts ``torch.amp.GradScaler``'s four (:class:`~mpnb.lab.config.LossScaleSpec`), including a
``backoff_factor`` that is not ``1 / growth_factor``. :func:`install` puts a :class:`LabScaler`
into the handle right after ``initialize``, before the first ``scale_loss``: the handle is
an explicit object, so no global state changes.
"""

from __future__ import annotations

import torch
from torch.utils import benchmark

from mpnb.core.amp import AmpHandle, LossScaler
from mpnb.core.ops import update_scale_hysteresis
from mpnb.lab.config import LossScaleSpec

__all__ = ["LabScaler", "install"]


class LabScaler(LossScaler):
    """A dynamic :class:`LossScaler` with its own backoff factor; times its updates if asked.

    Args:
        spec: the four GradScaler settings.
        device: where the scale lives.
        timed: record the duration of each :meth:`update` in ``update_seconds``
            (a synchronizing clock: use for profiling only).

    Example::

        >>> s = LabScaler(LossScaleSpec(init_scale=1024.0, backoff_factor=0.25))
    """

    def __init__(self, spec: LossScaleSpec, device="cpu", timed: bool = False):
        super().__init__(
            "dynamic",
            init_scale=spec.init_scale,
            scale_factor=spec.growth_factor,
            scale_window=spec.growth_interval,
            device=device,
        )
        self.backoff_factor = spec.backoff_factor
        self.timed = timed
        self.update_seconds: list[float] = []

    def update(self, found_inf: torch.Tensor | None = None) -> None:
        """Grow by ``growth_factor`` after ``growth_interval`` clean steps, back off on inf/NaN."""
        t0 = benchmark.timer() if self.timed else 0.0
        flag = self.found_inf if found_inf is None else found_inf
        update_scale_hysteresis(
            self.scale,
            self.growth_tracker,
            self.hysteresis_tracker,
            flag,
            self.scale_factor,
            self.backoff_factor,
            self.scale_window,
            1,
        )
        self.scale.clamp_(0.0, float(self.max_loss_scale))
        torch.reciprocal(self.scale, out=self.inv_scale)
        if self.timed:
            self.update_seconds.append(benchmark.timer() - t0)


def install(handle: AmpHandle, loss_scale, device, timed: bool = False) -> LossScaler:
    """Give ``handle`` a :class:`LabScaler` when ``loss_scale`` is a spec; return the scaler.

    With a static number or None the handle keeps amp's own scaler (made by ``initialize``),
    except that ``timed=True`` swaps a dynamic one for a timed :class:`LabScaler` with the
    same (Apex default) settings.
    """
    if isinstance(loss_scale, LossScaleSpec) or (timed and handle.scalers[0].dynamic):
        spec = loss_scale if isinstance(loss_scale, LossScaleSpec) else LossScaleSpec()
        handle.scalers[0] = LabScaler(spec, device, timed)
    return handle.scalers[0]
