"""Compiling a configuration's model before the lab times it, apart from its step times.

A step whose :attr:`~mpnb.core.precision_configs.TrainStep.compile_budget_s` is set trains
through ``torch.compile``. :func:`warm_up_step` compiles it first, as ``mpnb bench`` does
(:func:`mpnb.lab.bench._compile.warm_up`: the calls until one compiles nothing, their time the
compile time), by rehearsing the forward and backward on the run's first batch, and leaves
everything a training step depends on as it was: no weight, gradient, buffer (BatchNorm's
running statistics) or random-number state is changed, so the row trains the same model, data
and seed as every other. :class:`CompileWatch` notices a step that compiled again later (a new
input shape): the runner keeps that step out of the timed ones.
"""

from __future__ import annotations

import warnings

import torch

from mpnb.lab._errors import CompileError

__all__ = ["warm_up_step", "CompileWatch", "WAY_OUT", "CACHED_NOTE"]

#: how to leave compiling out, for the errors' last words
WAY_OUT = "leave torch-amp+compile out of the configurations"


#: the model classes this process compiled already: dynamo reuses their graphs for a new
#: instance of the same structure, so a first call that compiles nothing is a reuse, not an
#: eager run (which it would be for a class never compiled)
_COMPILED: set[type] = set()

#: the row's warning when its model's graphs came from an earlier compile in this process
CACHED_NOTE = (
    "torch.compile reused the graphs compiled for this model earlier in this process: "
    "compile_s is 0 here (the earlier run paid it)"
)


def _rehearse(step, x, y, loss_fn, forward) -> None:
    step.zero_grad()
    with step.forward_context():
        loss = loss_fn(forward(step.model, x), y)
    loss.backward()  # compiles the backward graph; the gradients are dropped after


def warm_up_step(step, x, y, loss_fn, forward, device) -> tuple[float, str]:
    """Compile ``step``'s model on the batch ``(x, y)`` within its budget; returns the seconds
    and a note for the row (``""``, or :data:`CACHED_NOTE`).

    Args:
        step: a :class:`~mpnb.core.precision_configs.TrainStep` with ``compile_budget_s``.
        x, y: a batch of the run's shape, on the device.
        loss_fn: the workload's loss; forward: the lab's ``forward(model, x)``.
        device: the run's device (its random-number state is restored too).

    Raises:
        CompileError: the compile failed, overran the budget or kept recompiling; the message
            names the cause and the fix.
    """
    # torch.compile's helpers when a run compiles: +220 ms to importing the trainer
    from mpnb.lab.bench._compile import failure, warm_up

    kind = type(step.module)
    buffers = [(b, b.detach().clone()) for b in step.module.buffers()]
    devices = [device] if torch.device(device).type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=devices), warnings.catch_warnings():
            # torch's own modules warn of their deprecations while they compile: not the run's
            warnings.filterwarnings("ignore", category=DeprecationWarning, module=r"torch\.")
            warm = warm_up(
                lambda: _rehearse(step, x, y, loss_fn, forward),
                budget_s=step.compile_budget_s,
                way_out=WAY_OUT,
                allow_cached=kind in _COMPILED,
                larger="give it a larger budget (mpnb compare --compile-budget S, or "
                "compare(compile_budget=S))",
            )
    except Exception as e:  # noqa: BLE001 - any compile failure becomes the row's error
        own = WAY_OUT in str(e)  # warm_up's own refusal (over budget, recompiling): as it says
        raise CompileError(str(e) if own else failure(e, WAY_OUT)) from e
    finally:
        step.zero_grad()
        with torch.no_grad():
            for b, saved in buffers:
                b.copy_(saved)
    _COMPILED.add(kind)
    return warm.seconds, CACHED_NOTE if warm.calls == 0 else ""


class CompileWatch:
    """Says whether the code run between :meth:`start` and :meth:`compiled` compiled
    anything (dynamo's counters: host-side, nothing is read from the device)."""

    def __init__(self) -> None:
        self._before = None

    def start(self) -> None:
        """Note the compile counters now."""
        # see warm_up_step: +220 ms to importing the trainer
        from mpnb.lab.bench._compile import compile_events

        self._before = compile_events()

    def compiled(self) -> bool:
        """True when something compiled since :meth:`start`."""
        # see warm_up_step: +220 ms to importing the trainer
        from mpnb.lab.bench._compile import compile_events

        return self._before is not None and compile_events() != self._before
