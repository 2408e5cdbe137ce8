"""The precision configurations mpnb compares, defined once: each one object that knows itself.

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

Each is a :class:`PrecisionConfig` (:class:`AmpConfig`, :class:`Float8Config`,
:class:`PureHalfConfig`). Callers ask it, never test its class or name: how to set a model and
optimizer up (:meth:`~PrecisionConfig.apply`, :meth:`~PrecisionConfig.setup`,
:meth:`~PrecisionConfig.make_optimizer`), which dtypes its runs use
(:meth:`~PrecisionConfig.halves`, :meth:`~PrecisionConfig.half_dtype`), where each tensor is
stored (``weights``, ``grads``, ``optimizer_state``: dtype names, ``"half"`` meaning the
run's half dtype; ``stores``: the extra state the memory tracker counts), whether a device
emulates it (:meth:`~PrecisionConfig.status`, from doctor's facts), its label and its row's
precision text. The FP8 configurations keep every other op in float32.

Adding a configuration is one entry in :data:`PRECISION_CONFIGS` (and one class when no
existing one fits); the lab, the CLI and the widgets offer it from the table.

Example::

    >>> cfg = PRECISION_CONFIGS["fp8-delayed"]
    >>> model, opt = cfg.apply(model, opt)
    >>> cfg.dtypes(torch.bfloat16)["weights"]
    (torch.float32,)
"""

from __future__ import annotations

import types

from mpnb.core.opt_levels import OPT_LEVEL_DESCRIPTIONS, OPT_LEVEL_NAMES, check_names
from mpnb.core.precision_configs._amp import AmpConfig
from mpnb.core.precision_configs._base import PrecisionConfig, StoredRole
from mpnb.core.precision_configs._float8 import FP8_SCALES, Float8Config
from mpnb.core.precision_configs._optimizers import OPTIMIZERS, make_optimizer
from mpnb.core.precision_configs._pure_half import KAHAN_BUFFERS, PureHalfConfig

__all__ = [
    "PrecisionConfig",
    "AmpConfig",
    "Float8Config",
    "PureHalfConfig",
    "StoredRole",
    "PRECISION_CONFIGS",
    "BASELINE",
    "DEFAULT_CONFIGS",
    "OPTIMIZERS",
    "STORED_ROLES",
    "config_names",
    "get_config",
    "make_optimizer",
]

_F32 = ("float32",)
_FP8 = "float8_e4m3fn / float8_e5m2 GEMMs in nn.Linear, float32 elsewhere"


def _amp(name: str, weights: tuple, grads: tuple, state: tuple, compute: str) -> AmpConfig:
    return AmpConfig(name, OPT_LEVEL_DESCRIPTIONS[name], weights, grads, state, compute)


def _fp8(name: str, description: str, recipe: str, extra: str = "", **kw) -> Float8Config:
    return Float8Config(
        name, description, _F32, _F32, _F32, _FP8, extra, (FP8_SCALES,), recipe, **kw
    )


def _pure(name, description, state: tuple, extra="", stores=(), option=None, half="bfloat16"):
    own = (half,)
    return PureHalfConfig(name, description, own, own, state, half, extra, stores, half, option)


PRECISION_CONFIGS = types.MappingProxyType(
    {
        c.name: c
        for c in (
            _amp("O0", _F32, _F32, _F32, "float32"),
            _amp(
                "O1",
                _F32,
                _F32,
                _F32,
                "half (autocast's lower-precision list), float32 (its fp32 list)",
            ),
            _amp("O2", ("half", "float32"), ("half", "float32"), _F32, "half"),
            _amp("O3", ("half",), ("half",), ("half",), "half"),
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
                gemm_emulated=True,
            ),
            _pure(
                "bf16-pure",
                "Pure bf16: weights, grads, activations bf16, no masters, no loss scaling.",
                ("bfloat16",),
            ),
            _pure(
                "bf16-pure+sr",
                "Pure bf16; needs FusedAdam(stochastic_rounding=True): fp32 update, "
                "stochastically rounded to bf16.",
                _F32,
                option="stochastic_rounding",
            ),
            _pure(
                "bf16-pure+kahan",
                "Pure bf16; needs FusedAdam(kahan_summation=True): a bf16 compensation buffer.",
                _F32,
                "a bf16 Kahan compensation buffer per parameter (2 bytes/param, optimizer "
                "state['compensation'])",
                (KAHAN_BUFFERS,),
                "kahan_summation",
            ),
        )
    }
)

#: the configuration every row is compared with (``speedup_vs_O0``, ``mem_saving_vs_O0``)
BASELINE = "O0"

#: what compare and the widgets run when no configuration is named: Apex's four opt levels
DEFAULT_CONFIGS = OPT_LEVEL_NAMES

#: the extra state every configuration stores, once each, in table order (the memory roles
#: beyond params, grads, master weights and optimizer state)
STORED_ROLES: tuple[StoredRole, ...] = tuple(
    dict.fromkeys(r for c in PRECISION_CONFIGS.values() for r in c.stores)
)


def config_names() -> tuple[str, ...]:
    """The configuration names, in table order."""
    return tuple(PRECISION_CONFIGS)


def get_config(name: str | PrecisionConfig) -> PrecisionConfig:
    """The configuration called ``name`` (a :class:`PrecisionConfig` is returned as is).

    Raises:
        ValueError: naming the valid choices (and "the letter O, not zero" for ``"02"``).

    Example::

        >>> get_config("O2").weights
        ('half', 'float32')
    """
    if isinstance(name, PrecisionConfig):
        return name
    check_names([name], config_names(), "unknown precision config")
    return PRECISION_CONFIGS[name]
