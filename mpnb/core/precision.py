"""The precision configurations mpnb compares, defined once: name -> what it is and how to apply it.

====================  ========================================================================
name                  what it is
====================  ========================================================================
``O0``..``O3``        Apex's opt levels through :func:`mpnb.amp.initialize`
``fp8-tensorwise``    FP8 linear layers, per-tensor current scaling (:mod:`mpnb.fp8`)
``fp8-delayed``       FP8 linear layers, per-tensor scales from an amax history
``fp8-rowwise``       FP8 linear layers, one scale per row
``mxfp8``             FP8 linear layers, 32-element blocks, E8M0 scales rounded up (RCEIL)
``bf16-pure``         every weight, grad and activation bf16, no fp32 masters (= O3 in bf16)
``bf16-pure+sr``      bf16-pure, the optimizer rounds updates stochastically to bf16
``bf16-pure+kahan``   bf16-pure, the optimizer keeps a Kahan compensation buffer
====================  ========================================================================

Each entry's storage dtypes are data (``weights``, ``grads``, ``optimizer_state``: tuples of
dtype names, ``"half"`` meaning the run's half dtype); :meth:`PrecisionConfig.apply` sets a
(model, optimizer) pair up. The FP8 configurations keep every other op in float32.

Example::

    >>> cfg = PRECISION_CONFIGS["fp8-delayed"]
    >>> model, opt = cfg.apply(model, opt)
    >>> cfg.dtypes(torch.bfloat16)["weights"]
    (torch.float32,)
"""

from __future__ import annotations

import abc
import types
from dataclasses import dataclass

import torch

from mpnb.core.hardware import default_half_dtype

__all__ = [
    "PrecisionConfig",
    "AmpConfig",
    "Float8Config",
    "PureBf16Config",
    "PRECISION_CONFIGS",
    "get_config",
    "config_names",
    "resolve_half",
]


@dataclass(frozen=True)
class PrecisionConfig(abc.ABC):
    """One configuration: a name, a one-line description and where each tensor lives.

    Attributes:
        name: the key in :data:`PRECISION_CONFIGS`.
        description: one line.
        weights, grads, optimizer_state: dtype names each is stored in (``"half"``: the
            run's half dtype; several: e.g. a half model copy and fp32 masters). The
            optimizer state is the one ``torch.optim`` keeps (it follows the params it
            updates); mpnb's fused optimizers keep float32 state.
        compute: the dtype(s) the GEMMs run in.
        extra_state: other per-model state (amax histories, compensation buffers).
    """

    name: str
    description: str
    weights: tuple[str, ...]
    grads: tuple[str, ...]
    optimizer_state: tuple[str, ...]
    compute: str
    extra_state: str = ""

    @property
    def low_precision(self) -> bool:
        """True unless every op is meant to run in float32 (``O0``)."""
        return self.name != "O0"

    def dtypes(self, half_dtype: torch.dtype = torch.bfloat16) -> dict[str, tuple]:
        """``{"weights": (...), "grads": (...), "optimizer_state": (...)}`` as torch dtypes."""

        def resolve(names):
            return tuple(half_dtype if n == "half" else getattr(torch, n) for n in names)

        return {
            "weights": resolve(self.weights),
            "grads": resolve(self.grads),
            "optimizer_state": resolve(self.optimizer_state),
        }

    @abc.abstractmethod
    def apply(self, model, optimizer=None, half_dtype=None):
        """Set ``model`` (and ``optimizer``) up for this configuration; returns both.

        Args:
            model: an fp32 ``nn.Module``.
            optimizer: built on ``model``'s parameters, or None.
            half_dtype: ``torch.bfloat16`` / ``torch.float16`` for the O levels (default:
                bf16 on CPU, fp16 on CUDA); ignored where the configuration fixes it.

        Returns:
            ``(model, optimizer)``: the model may be the same object, changed in place.
        """


@dataclass(frozen=True)
class AmpConfig(PrecisionConfig):
    """An Apex opt level, applied by :func:`mpnb.amp.initialize` (quietly: ``verbosity=0``)."""

    def apply(self, model, optimizer=None, half_dtype=None):
        """``amp.initialize(model, optimizer, opt_level=name, half_dtype=...)``."""
        from mpnb.core import amp

        out = amp.initialize(
            model, optimizer, opt_level=self.name, half_dtype=half_dtype, verbosity=0
        )
        return out if optimizer is not None else (out, None)


@dataclass(frozen=True)
class Float8Config(PrecisionConfig):
    """FP8 ``nn.Linear`` layers (module swap, shared parameters), everything else float32."""

    recipe: str = "tensorwise"

    def apply(self, model, optimizer=None, half_dtype=None):
        """:func:`mpnb.fp8.convert_to_float8_training` with this recipe (optimizer untouched)."""
        from mpnb.core.fp8 import convert_to_float8_training

        return convert_to_float8_training(model, self.recipe), optimizer

    @property
    def gemm_emulated(self) -> bool:
        """True where the GEMM is emulated on every device: MXFP8's (:mod:`mpnb.fp8`
        dequantizes its E8M0-scaled blocks and multiplies in float32)."""
        return self.recipe == "mxfp8"

    def fp8_status(self, device_fp8: str) -> str:
        """``"native"`` or ``"emulated"``: how this recipe runs on a device whose FP8 support
        is ``device_fp8`` (:func:`mpnb.lab.fp8_support`)."""
        return "emulated" if self.gemm_emulated else device_fp8


@dataclass(frozen=True)
class PureBf16Config(PrecisionConfig):
    """Pure bf16 (O3 with ``half_dtype=torch.bfloat16``); variants need an optimizer option.

    ``optimizer_option`` names the constructor option the optimizer must have been built with
    (``stochastic_rounding`` / ``kahan_summation`` of mpnb's fused optimizers).
    """

    optimizer_option: str | None = None

    def apply(self, model, optimizer=None, half_dtype=None):
        """Check the optimizer option, then ``amp.initialize(..., "O3", bfloat16)``."""
        if self.optimizer_option is not None:
            _require_option(self.name, self.optimizer_option, optimizer)
        from mpnb.core import amp

        out = amp.initialize(
            model, optimizer, opt_level="O3", half_dtype=torch.bfloat16, verbosity=0
        )
        return out if optimizer is not None else (out, None)


def _require_option(name: str, option: str, optimizer) -> None:
    if optimizer is not None and optimizer.defaults.get(option) is True:
        return
    got = "no optimizer" if optimizer is None else type(optimizer).__name__
    raise ValueError(
        f"precision config {name!r} needs an optimizer built with {option}=True, got {got}; "
        f"build it as mpnb.optimizers.FusedAdam(params, {option}=True) (FusedSGD and "
        "FusedLAMB take the option too). Use 'bf16-pure' for pure bf16 without it."
    )


_F32 = ("float32",)
_BF16 = ("bfloat16",)
_FP8 = "float8_e4m3fn / float8_e5m2 GEMMs in nn.Linear, float32 elsewhere"


def _fp8(name: str, description: str, recipe: str, extra_state: str = "") -> Float8Config:
    return Float8Config(name, description, _F32, _F32, _F32, _FP8, extra_state, recipe)


def _bf16(name: str, description: str, state: tuple, extra: str = "", option=None):
    return PureBf16Config(name, description, _BF16, _BF16, state, "bfloat16", extra, option)


PRECISION_CONFIGS = types.MappingProxyType(
    {
        c.name: c
        for c in (
            AmpConfig("O0", "Pure fp32 training.", _F32, _F32, _F32, "float32"),
            AmpConfig(
                "O1",
                "fp32 weights; torch.autocast runs the forward's listed ops in half.",
                _F32,
                _F32,
                _F32,
                "half (autocast's lower-precision list), float32 (its fp32 list)",
            ),
            AmpConfig(
                "O2",
                "Half model (batch norms fp32), fp32 master weights in the optimizer.",
                ("half", "float32"),
                ("half", "float32"),
                _F32,
                "half",
            ),
            AmpConfig("O3", "Pure half training.", ("half",), ("half",), ("half",), "half"),
            _fp8(
                "fp8-tensorwise",
                "FP8 linear layers, per-tensor current scaling (scale from each tensor's amax).",
                "tensorwise",
            ),
            _fp8(
                "fp8-delayed",
                "FP8 linear layers, per-tensor scales from a 1024-step amax history (TE).",
                "delayed",
                "fp8_amax_history (1024 x 3 float32) and fp8_scale (3) per linear layer",
            ),
            _fp8(
                "fp8-rowwise",
                "FP8 (E4M3) linear layers, one power-of-two scale per row of each operand.",
                "rowwise",
            ),
            _fp8(
                "mxfp8",
                "MXFP8 linear layers: E4M3 values, one E8M0 scale per 32 rounded up (RCEIL, "
                "as TransformerEngine); emulated GEMM.",
                "mxfp8",
            ),
            _bf16(
                "bf16-pure",
                "Pure bf16: weights, grads, activations bf16, no masters, no loss scaling.",
                _BF16,
            ),
            _bf16(
                "bf16-pure+sr",
                "Pure bf16; needs FusedAdam(stochastic_rounding=True): fp32 update, "
                "stochastically rounded to bf16.",
                _F32,
                option="stochastic_rounding",
            ),
            _bf16(
                "bf16-pure+kahan",
                "Pure bf16; needs FusedAdam(kahan_summation=True): a bf16 compensation buffer.",
                _F32,
                "a bf16 Kahan compensation buffer per parameter (2 bytes/param, optimizer "
                "state['compensation'])",
                "kahan_summation",
            ),
        )
    }
)


def config_names() -> tuple[str, ...]:
    """The configuration names, in table order."""
    return tuple(PRECISION_CONFIGS)


def get_config(name: str | PrecisionConfig) -> PrecisionConfig:
    """The configuration called ``name`` (a :class:`PrecisionConfig` is returned as is).

    Example::

        >>> get_config("O2").weights
        ('half', 'float32')
    """
    if isinstance(name, PrecisionConfig):
        return name
    if name not in PRECISION_CONFIGS:
        hint = " (use the letter O, not zero)" if str(name).startswith("0") else ""
        raise ValueError(
            f"unknown precision config {name!r}{hint}; valid choices: "
            f"{', '.join(PRECISION_CONFIGS)}."
        )
    return PRECISION_CONFIGS[name]


def resolve_half(config: PrecisionConfig, half_dtype, device) -> torch.dtype:
    """The half dtype a run of ``config`` uses (bf16 for the pure-bf16 family)."""
    if isinstance(config, PureBf16Config):
        return torch.bfloat16
    return half_dtype or default_half_dtype(device)
