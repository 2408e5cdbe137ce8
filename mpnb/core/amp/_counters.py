"""A loss scaler's step counters: counted on the device, seen by the host without waiting.

amp's step never reads a device value on the host (DESIGN.md: state lives in objects, on the
device). What the host must still learn from the steps (a static scale met inf/NaN, the scale
collapsed to its floor) is counted on the device by :class:`StepCounters`, and the host looks at
the counts through a :class:`HostView`: on a GPU, a copy into pinned host memory that is read
once its event has completed, a step or so later, and never waited for; on a CPU the counts are
host memory already. A reader that needs the counts now (``state_dict()``, a property) calls
:meth:`StepCounters.read`, which waits.
"""

from __future__ import annotations

import torch

__all__ = ["HostView", "StepCounters"]


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class HostView:
    """The host's latest view of a small device tensor, refreshed by copies that never wait.

    Args:
        src: the device tensor (a few elements).

    Example::

        >>> view = HostView(counts)
        >>> view.latest()          # None on a GPU until the first copy has landed
    """

    def __init__(self, src: torch.Tensor) -> None:
        self.src = src
        self._cuda = src.device.type == "cuda"
        self._buf = torch.empty(src.shape, dtype=src.dtype, pin_memory=True) if self._cuda else None
        self._event = None

    def latest(self) -> list | None:
        """The values as of the last copy that has landed, or None when none has yet; then
        starts the next copy (never two at once). On a CPU: the values now.

        No wait on the device: a copy still in flight is left for a later call. Nothing is
        copied while a CUDA graph is being captured (the graph's replays count on the device,
        and the next call outside the capture sees them).
        """
        if not self._cuda:
            return self.src.numpy().tolist()  # host memory: reading it waits for nothing
        if _capturing(self.src.device):
            return None
        out = None
        if self._event is not None and self._event.query():
            out, self._event = self._buf.numpy().tolist(), None
        if self._event is None:
            self._buf.copy_(self.src, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        return out

    def forget(self) -> None:
        """Drop a copy in flight (the counts were changed by the host)."""
        self._event = None


class StepCounters:
    """Per-scaler counts of optimizer steps, kept in one int64 device tensor.

    ``values`` holds ``[skipped, floor_run, taken]``:

    * ``skipped``: steps skipped for inf/NaN gradients (dynamic scaling);
    * ``floor_run``: consecutive skipped steps with the scale, after its update, at or below
      the rule's floor (what the collapse error counts);
    * ``taken``: steps that met inf/NaN gradients and were taken anyway (static scaling, Apex's
      rule: what the static-scale warning reports), counted on a step's first scaler.

    Args:
        device: where the counts live (the scaler's device).
    """

    SKIPPED, FLOOR_RUN, TAKEN = 0, 1, 2

    def __init__(self, device) -> None:
        self.values = torch.zeros(3, dtype=torch.int64, device=device)
        self.view = HostView(self.values)

    def note(
        self, found_inf: torch.Tensor, scale: torch.Tensor, floor: float, skip: bool, taken: bool
    ) -> None:
        """Count one step on the device (no host read).

        Args:
            found_inf: the step's overflow flag (nonzero: inf/NaN gradients).
            scale: the scale after this step's update.
            floor: the rule's collapse floor.
            skip: an overflowing step is skipped (a dynamic scaler of a step that skips).
            taken: an overflowing step is taken and counts here (static scaling, first scaler).
        """
        if not (skip or taken):
            return
        hit = found_inf.reshape(1).gt(0)
        v = self.values
        if skip:
            at_floor = scale.reshape(1).le(floor).logical_and_(hit)
            v[self.SKIPPED : self.SKIPPED + 1].add_(hit)
            v[self.FLOOR_RUN : self.FLOOR_RUN + 1].add_(1).mul_(at_floor)
        else:
            v[self.TAKEN : self.TAKEN + 1].add_(hit)

    def latest(self) -> list | None:
        """``[skipped, floor_run, taken]`` as the host last saw them without waiting (None: not
        yet on a GPU); see :meth:`HostView.latest`."""
        return self.view.latest()

    def read(self) -> list[int]:
        """``[skipped, floor_run, taken]`` now (a host sync on a GPU: for checkpoints, logs and
        properties, never inside a step)."""
        return [int(v) for v in self.values.tolist()]

    def set(self, skipped: int, floor_run: int) -> None:
        """Set the counts a checkpoint carries (``taken`` stays)."""
        self.values[self.SKIPPED] = skipped
        self.values[self.FLOOR_RUN] = floor_run
        self.view.forget()
