"""The lab's per-step log, kept on the device and read a batch of steps at a time.

A training step leaves its loss, overflow flag and loss scale on the device; :class:`StepLog`
copies the three into one small device tensor per step (a copy: the scaler updates its scale
in place) and reads the pending steps on the host together, once every :data:`READ_EVERY`
steps and at the end of a run. So a step itself never waits for the device: the host stays
ahead and queues the next step while the device computes this one.

Example::

    >>> log = StepLog()
    >>> log.add(0, "warmup", loss, step.found_inf, step.scale, 0.012, 64)
    >>> log.due
    False
    >>> log.read(skips=True)[0]["loss"]
    2.31
"""

from __future__ import annotations

import math

import torch

__all__ = ["READ_EVERY", "StepLog"]

#: Steps between two host reads of the log: often enough that a NaN divergence ends a run soon
#: after it happens (the error still names its first step), rarely enough that the read's wait
#: for the device is paid once per this many steps, not every step.
READ_EVERY = 10


class StepLog:
    """Steps recorded on the device, read as history entries (see the module docstring).

    Args:
        every: read once this many steps are pending (:attr:`due`).
    """

    def __init__(self, every: int = READ_EVERY):
        self.every = every
        self._values: list[torch.Tensor] = []
        self._meta: list[tuple[int, str, float, int]] = []

    def add(self, step: int, phase: str, loss, found_inf, scale, seconds: float, samples: int):
        """Record step ``step`` (its ``phase``, wall time and batch size on the host; its
        ``loss``, ``found_inf`` and ``scale`` tensors copied on the device, nothing read)."""
        parts = [t.detach().float().reshape(1) for t in (loss, found_inf, scale)]
        self._values.append(torch.cat(parts))
        self._meta.append((step, phase, seconds, samples))

    @property
    def due(self) -> bool:
        """True once :attr:`every` steps are pending."""
        return len(self._values) >= self.every

    def __len__(self) -> int:
        return len(self._values)

    def read(self, skips: bool) -> list[dict]:
        """The pending steps as history entries, read with one host sync, in step order.

        Args:
            skips: whether a set overflow flag means the step was skipped (a dynamic scale).

        Each entry has ``step``, ``loss``, ``loss_scale``, ``step_time_ms``, ``skipped``,
        ``skip_reason``, ``phase`` and ``samples``.
        """
        if not self._values:
            return []
        values = torch.stack(self._values).tolist()  # the one host read of these steps
        meta, self._values, self._meta = self._meta, [], []
        out = []
        for (step, phase, seconds, samples), (loss, found, scale) in zip(meta, values, strict=True):
            skipped = found > 0 and skips
            why = ""
            if skipped:
                why = "loss is inf/NaN" if not math.isfinite(loss) else "inf/NaN in the gradients"
            out.append(
                dict(
                    step=step,
                    loss=loss,
                    loss_scale=scale,
                    step_time_ms=seconds * 1e3,
                    skipped=skipped,
                    skip_reason=why,
                    phase=phase,
                    samples=samples,
                )
            )
        return out

    def clear(self) -> None:
        """Forget the pending steps (the run failed: nothing more is read)."""
        self._values, self._meta = [], []
