"""The base of every precision configuration: what callers may ask one, and the defaults.

A caller (the lab's runner, rows, verdict and precision trace, the memory tracker, the widgets)
holds a :class:`PrecisionConfig` and asks it; it never tests which class or name it has. A
subclass overrides only what differs from these defaults.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import torch

from mpnb.core import amp
from mpnb.core.hardware import dtype_support, status_of
from mpnb.core.number_formats import format_named
from mpnb.core.precision_configs._optimizers import make_optimizer, optimizer_code
from mpnb.core.precision_configs._snippets import loop
from mpnb.core.precision_configs._step import AmpStep, TrainStep

__all__ = ["PrecisionConfig", "StoredRole", "require_option"]


@dataclass(frozen=True)
class StoredRole:
    """A kind of tensor a configuration keeps beyond params, grads, masters and optimizer state.

    Attributes:
        role: its memory role (the lab's column ``mem_<role>_mib``).
        what: one line saying what it is.
        find: ``(model, optimizer) -> tensors`` of this role now (either argument may be None).
    """

    role: str
    what: str
    find: Callable[[torch.nn.Module | None, object], Iterable[torch.Tensor]]


@dataclass(frozen=True)
class PrecisionConfig(abc.ABC):
    """One configuration: a name, a one-line description, where each tensor lives, and how
    to set a model and optimizer up for it.

    Attributes:
        name: the key in :data:`~mpnb.core.precision_configs.PRECISION_CONFIGS`.
        description: one line.
        weights, grads, optimizer_state: dtype names each is stored in (``"half"``: the
            run's half dtype; several: e.g. a half model copy and fp32 masters). The
            optimizer state is the one ``torch.optim`` keeps (it follows the params it
            updates); mpnb's fused optimizers keep float32 state.
        compute: the dtype(s) the GEMMs run in.
        extra_state: other per-model state (amax histories, compensation buffers), in words.
        stores: the :class:`StoredRole` s of that state, which the memory tracker counts.
    """

    name: str
    description: str
    weights: tuple[str, ...]
    grads: tuple[str, ...]
    optimizer_state: tuple[str, ...]
    compute: str
    extra_state: str = ""
    stores: tuple[StoredRole, ...] = ()

    # ---- what it stores -------------------------------------------------------------------

    @property
    def low_precision(self) -> bool:
        """True unless every op is meant to run in float32 (``O0``)."""
        return self.compute != "float32"

    def dtypes(self, half_dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
        """``{"weights": (...), "grads": (...), "optimizer_state": (...)}`` as torch dtypes."""

        def resolve(names):
            return tuple(half_dtype if n == "half" else getattr(torch, n) for n in names)

        return {
            "weights": resolve(self.weights),
            "grads": resolve(self.grads),
            "optimizer_state": resolve(self.optimizer_state),
        }

    # ---- setting a model and optimizer up -------------------------------------------------

    @property
    def uses_amp(self) -> bool:
        """True when :meth:`apply` puts the pair under amp (``amp.initialize``), so a training
        step goes through ``amp.scale_loss``."""
        return True

    @property
    def loss_scaling(self) -> bool:
        """True when a loss scale given for the run applies (O1-O3); the others need none."""
        return False

    @property
    def autocast(self) -> bool:
        """True when the forward runs under ``torch.autocast`` (O1)."""
        return False

    @property
    def peer(self) -> bool:
        """True for what a user would pick instead of mpnb (torch.amp, TF32, torch.compile),
        measured beside mpnb's configurations; False for mpnb's own."""
        return False

    @property
    def captures(self) -> str:
        """The configuration whose whole step this one captures in a CUDA graph and replays
        (``"O2"`` for ``O2+graph``); ``""`` for one that runs eagerly."""
        return ""

    @property
    def verdict_reference(self) -> bool:
        """True for the peer the verdict holds mpnb's best row against (eager torch.amp)."""
        return False

    def runs_by_default(self, device_type: str) -> bool:
        """True when a comparison that names no configuration runs this one on a
        ``device_type`` (``"cpu"``, ``"cuda"``) device."""
        return False

    def unavailable(self, device="cpu") -> str:
        """Why ``device`` cannot run this configuration at all (``""``: it can); the lab then
        shows an ``unsupported`` row with this reason instead of training."""
        return ""

    def with_options(self, compile_budget_s: float | None = None) -> PrecisionConfig:
        """This configuration with a run's options applied (only a compiling configuration has
        any: its compile budget); the same object when none applies."""
        return self

    @abc.abstractmethod
    def apply(self, model, optimizer=None, half_dtype=None):
        """Set ``model`` (and ``optimizer``) up for this configuration; returns both.

        Args:
            model: an fp32 ``nn.Module``.
            optimizer: built on ``model``'s parameters (:meth:`make_optimizer` builds the one
                this configuration needs), or None.
            half_dtype: ``torch.bfloat16`` / ``torch.float16`` for the O levels (default:
                bf16 on CPU, fp16 on CUDA); ignored where the configuration fixes it.

        Returns:
            ``(model, optimizer)``: the model may be the same object, changed in place.
        """

    def setup(self, model, optimizer, half_dtype=None, loss_scale=None):
        """:meth:`apply` for a training loop that treats every configuration alike: the pair
        always ends under amp (a configuration that does not use amp runs under ``O0``, fp32
        and no scaling), so one ``amp.scale_loss`` step trains them all.

        Args:
            model, optimizer, half_dtype: as for :meth:`apply`.
            loss_scale: where :attr:`loss_scaling` holds, ``amp.initialize``'s ``loss_scale``
                (None: the level's default); ignored elsewhere.
        """
        if not self.uses_amp:
            model, optimizer = amp.initialize(model, optimizer, opt_level="O0", verbosity=0)
        return self.apply(model, optimizer, half_dtype)

    def train_step(self, model, optimizer, half_dtype=None, loss_scale=None) -> TrainStep:
        """Set ``model`` and ``optimizer`` up (:meth:`setup`) and return the step that trains
        them: an :class:`~mpnb.core.precision_configs._step.AmpStep` (``amp.scale_loss``)
        for every configuration under amp; a peer builds its own.

        Args:
            model, optimizer, half_dtype, loss_scale: as for :meth:`setup`.

        Example::

            >>> step = PRECISION_CONFIGS["O2"].train_step(model, opt, torch.bfloat16)
            >>> step.zero_grad()
            >>> with step.forward_context():
            ...     loss = loss_fn(step.model(x), y)
            >>> step.backward(loss)
            >>> step.step()
        """

        model, optimizer = self.setup(model, optimizer, half_dtype, loss_scale)
        return AmpStep(model, optimizer, amp.current_handle())  # the one setup just made

    def snippet(self, half: str, device: str = "cpu", optimizer: str = "adam", lr=1e-3) -> str:
        """The lines a user writes to train this way in their own loop
        (:mod:`~mpnb.core.precision_configs._snippets`), for a run in ``half`` (one of
        :meth:`halves`) on ``device`` with the optimizer called ``optimizer`` and ``lr``; the
        default is plain fp32 training.

        Example::

            >>> print(PRECISION_CONFIGS["O2"].snippet("bf16", "cpu", "fused_adam"))
            # model: your fp32 model on cpu; batches: (inputs, targets) on it; loss_fn
            import torch
            from mpnb import amp
            ...
        """

        imp, make = self._optimizer_code(optimizer, lr)
        return loop([make], [imp], device=torch.device(device).type)

    def _optimizer_code(self, name: str, lr, option: str | None = None) -> tuple[str, str]:
        return optimizer_code(name, lr, option)

    def make_optimizer(self, name: str, params, lr: float):
        """The optimizer called ``name`` (:data:`~mpnb.core.precision_configs.OPTIMIZERS`) on
        ``params``, or the one this configuration needs in its place (:meth:`optimizer_note`
        says which)."""
        return make_optimizer(name, params, lr)

    def optimizer_note(self, name: str) -> str:
        """What :meth:`make_optimizer` builds for ``name`` when it is not what was asked
        (``""`` when it is)."""
        return ""

    # ---- the dtypes it runs in, and the hardware's verdict on them ----------------------

    @abc.abstractmethod
    def halves(self, asked: Sequence[str]) -> tuple[str, ...]:
        """The short dtype name of each run of this configuration, given the half dtypes
        ``asked`` for (short names): the O levels run once per half dtype, the others once in
        their own (``"fp32"``, ``"fp8"``, ``"bf16"``)."""

    def half_dtype(self, asked=None, device="cpu") -> torch.dtype | None:
        """The half dtype this configuration casts to or computes in when ``asked`` (a name,
        dtype, or None for the device's default) is requested; None when it uses none."""
        return None

    def number_format(self, half: str):
        """The :class:`~mpnb.core.number_formats.NumberFormat` of the run in ``half`` (one of
        :meth:`halves`): what callers ask instead of comparing the dtype's name.

        Example::

            >>> get_config("O2").number_format("bf16").name
            'bf16'
        """

        return format_named(half)

    def label(self, half: str) -> str:
        """The row's name for the run in ``half`` (:meth:`halves`): the configuration's name,
        which says its dtype."""
        return self.name

    def status(self, half: str, facts: Mapping | None = None, device="cpu") -> str:
        """How ``device`` computes the run in ``half``: ``"native"``, ``"emulated"``,
        ``"unsupported"`` (doctor's facts, :func:`mpnb.core.hardware.dtype_support`, or
        ``facts`` given: see :func:`mpnb.core.hardware.status_of`), or ``""`` for float32."""

        if not self.number_format(half).low_precision:
            return ""
        return status_of(dtype_support(device) if facts is None else facts, half)

    def precision_text(self, half: str, status: str) -> str:
        """The row's ``precision`` cell: ``"fp32"``, ``"bf16 (native)"``, ``"fp8 (emulated)"``."""
        return f"{half} ({status})" if status else half

    @property
    def note_subject(self) -> str:
        """Whom a row's emulation note names (``""``: the dtype alone, the same for every
        configuration in it, so one note serves them all)."""
        return ""

    def gemm_dtype(self, half: str) -> str:
        """The dtype the run's GEMMs would run in on a GPU (for the verdict's estimate)."""
        return half

    def divergence_note(self) -> str:
        """What a NaN divergence may owe to this configuration (``""``: nothing in particular)."""
        if "float32" in self.weights or "float32" in self.optimizer_state:
            return ""
        return (
            f" {self.name} keeps no fp32 master weights (Adam's eps=1e-8 is 0 in fp16); "
            "O2 keeps them in fp32."
        )


def require_option(cfg: PrecisionConfig, option: str, optimizer, without: str) -> None:
    """Refuse an optimizer not built with ``option=True``; the message names the fix and
    ``without``, the configuration to use instead."""
    if optimizer is not None and optimizer.defaults.get(option) is True:
        return
    got = "no optimizer" if optimizer is None else type(optimizer).__name__
    raise ValueError(
        f"precision config {cfg.name!r} needs an optimizer built with {option}=True, got "
        f"{got}; build it as mpnb.optimizers.FusedAdam(params, {option}=True) (FusedSGD and "
        f"FusedLAMB take the option too). Use {without!r} without it."
    )
