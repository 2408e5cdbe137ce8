"""Failures as one line for an error row: what failed, where in *your* code, and the fix."""

from __future__ import annotations

import os
import traceback

import torch

import mpnb
from mpnb.core.number_formats import format_named, format_of

__all__ = [
    "CompileError",
    "DivergenceError",
    "describe_error",
    "divergence_message",
    "user_frame",
]


class DivergenceError(RuntimeError):
    """The loss became inf/NaN on a step that was not skipped: training diverged."""


class CompileError(RuntimeError):
    """A compiling configuration could not compile (failed, overran its budget, kept
    recompiling); the message names the cause and the fix."""


def divergence_message(cfg, loss: float, step: int, dynamic: bool, scale: float) -> str:
    """The error of a run (``cfg``: its :class:`~mpnb.lab.config.RunConfig`) whose loss became
    inf/NaN without the step being skipped, with advice that fits its precision: loss scaling
    only for fp16, bf16 only where it would help."""
    head = f"NaN divergence: the loss became {loss} at step {step} and the step was not skipped"
    fmt = format_of(cfg.half_dtype) or format_named("fp32")
    return head + fmt.divergence(dynamic, scale) + cfg.config.divergence_note()


def _library_dirs() -> tuple[str, ...]:
    dirs = [os.path.dirname(torch.__file__), os.path.dirname(mpnb.__file__)]
    return tuple(os.path.join(os.path.realpath(d), "") for d in dirs)


def user_frame(e: BaseException) -> traceback.FrameSummary | None:
    """The innermost frame of ``e``'s traceback outside torch and mpnb: the user's code.

    Falls back to the innermost frame when every frame is in torch or mpnb.
    """
    frames = traceback.extract_tb(e.__traceback__) if e.__traceback__ else []
    lib = _library_dirs()
    for fr in reversed(frames):
        if not os.path.realpath(fr.filename).startswith(lib):
            return fr
    return frames[-1] if frames else None


def describe_error(e: BaseException, configuration: str = "") -> str:
    """One line naming the configuration, the failure, the user's frame and, when known, the fix.

    Example::

        >>> describe_error(RuntimeError("boom"), "O2 bf16 b16")
        'O2 bf16 b16: RuntimeError: boom'
    """
    head = f"{configuration}: " if configuration else ""
    if isinstance(e, (torch.OutOfMemoryError, MemoryError)):
        return f"{head}out of memory: {str(e).splitlines()[0][:200]}; try a smaller batch size."
    # amp when a run failed: +160 ms to importing the error wording
    from mpnb.core.amp import LossScaleCollapseError

    if isinstance(e, (DivergenceError, LossScaleCollapseError, CompileError)):
        return f"{head}{e}"
    where = user_frame(e)
    loc = ""
    if where is not None:
        loc = f" (at {os.path.basename(where.filename)}:{where.lineno} in {where.name})"
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{head}{type(e).__name__}: {text}{loc}"
