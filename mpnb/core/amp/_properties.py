"""Opt levels O0-O3 as small frozen objects, and the validation of user overrides.

An opt level only supplies defaults; :func:`resolve_properties` merges the user's overrides
into one frozen :class:`Properties` and rejects invalid or conflicting values with a
``ValueError`` that names the valid choices.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from mpnb.core.amp._config import HALF_DTYPES, LossScaleRule
from mpnb.core.dtype_names import default_half_dtype
from mpnb.core.opt_levels import OPT_LEVEL_DESCRIPTIONS, parse_opt_level

__all__ = [
    "Properties",
    "OptLevel",
    "OPT_LEVELS",
    "parse_opt_level",
    "resolve_properties",
    "format_properties",
]

_HALF = (torch.float16, torch.bfloat16)
_DTYPE_NAMES = {**HALF_DTYPES, "float32": torch.float32, "fp32": torch.float32}


@dataclass(frozen=True)
class Properties:
    """The resolved settings of one ``amp.initialize`` call (Apex's ``Properties``).

    Attributes:
        enabled: False makes amp a no-op (scale_loss yields the loss unchanged).
        opt_level: ``"O0"``..``"O3"``.
        cast_model_type: dtype the model is cast to (None: the model is not cast; Apex's
            ``cast_model_type=False`` resolves to None at any level, and the level's master
            weights then serve the half params the model already has).
        patch_torch_functions: run forward under ``torch.autocast`` (O1).
        keep_batchnorm_fp32: keep batch norms fp32 when the model is cast.
        master_weights: keep fp32 master params in the optimizer.
        loss_scale: ``"dynamic"`` or a fixed positive number. Defaults: fp16 keeps Apex's
            (``"dynamic"`` for O1/O2, 1.0 for O0/O3); bf16 is 1.0 (static, no scaling) at
            every level, as ``torch.amp`` does: bf16 has fp32's exponent range, so gradients
            neither underflow nor overflow where fp32's would not (pass
            ``loss_scale="dynamic"`` to scale anyway). The dynamic rule itself is each
            :class:`~mpnb.core.amp.LossScaler`'s ``rule``.
        cast_model_outputs: dtype the model's floating outputs are cast to (None: no cast).
            fp32 by default at every level, so a loss computed from the outputs runs in fp32
            (under O1 this gives the numerics of Apex's fp32 function list).
        half_dtype: ``torch.float16`` or ``torch.bfloat16``.
    """

    enabled: bool
    opt_level: str
    cast_model_type: torch.dtype | None
    patch_torch_functions: bool
    keep_batchnorm_fp32: bool | None
    master_weights: bool
    loss_scale: float | str
    cast_model_outputs: torch.dtype | None
    half_dtype: torch.dtype


@dataclass(frozen=True)
class OptLevel:
    """One opt level: a name, Apex's one-line description and a function of the half dtype."""

    name: str
    brief: str

    def defaults(self, half: torch.dtype) -> Properties:
        """The Apex defaults of this level with ``half`` as the half dtype.

        The one departure from Apex: with bf16 the loss scale is 1.0 (no scaling, as
        ``torch.amp`` does), since bf16's range is fp32's; fp16 keeps Apex's dynamic scale
        for O1 and O2.
        """
        dynamic = self.name in ("O1", "O2") and half == torch.float16
        cast = {"O0": torch.float32, "O1": None, "O2": half, "O3": half}[self.name]
        return Properties(
            enabled=True,
            opt_level=self.name,
            cast_model_type=cast,
            patch_torch_functions=self.name == "O1",
            keep_batchnorm_fp32={"O2": True, "O3": False}.get(self.name),
            master_weights=self.name == "O2",
            loss_scale="dynamic" if dynamic else 1.0,
            cast_model_outputs=torch.float32,
            half_dtype=half,
        )


OPT_LEVELS = {name: OptLevel(name, brief) for name, brief in OPT_LEVEL_DESCRIPTIONS.items()}


def _dtype(name: str, value, allowed: tuple[torch.dtype, ...]) -> torch.dtype:
    dt = _DTYPE_NAMES.get(value, value) if isinstance(value, str) else value
    if dt not in allowed:
        names = ", ".join(f"torch.{str(a).split('.')[-1]}" for a in allowed)
        raise ValueError(f"amp.initialize: {name}={value!r} is invalid; valid choices: {names}.")
    return dt


def _bool(name: str, value) -> bool:
    if value in (True, "True"):
        return True
    if value in (False, "False"):
        return False
    raise ValueError(
        f"amp.initialize: {name}={value!r} is invalid; valid choices: True, False, "
        "'True', 'False' (or None for the opt level's default)."
    )


def _loss_scale(value) -> float | str:
    """Apex's view of the rule: ``"dynamic"`` or the static scale (a rule passes through the
    parse unchanged; another value is parsed here, for a direct caller)."""
    return LossScaleRule.parse(value, owner="amp.initialize").apex_value


def _outputs(value) -> torch.dtype | None:
    if value is False or value == "False":
        return None  # no cast at all
    return _dtype("cast_model_outputs", value, (*_HALF, torch.float32))


def _no_cast(value) -> bool:
    """Apex's ``cast_model_type=False``: leave the model's dtypes as they are."""
    return value is False or value == "False"


def _check_o1(over: dict) -> None:
    cast = over.get("cast_model_type")
    if not (cast is None or _no_cast(cast) or cast == torch.float32):
        raise ValueError(
            "amp.initialize: O1 casts inside torch.autocast, not the model's weights, so "
            "cast_model_type must stay None with O1; use opt_level='O2' or 'O3' to cast the model."
        )
    if over.get("master_weights") is True:
        raise ValueError(
            "amp.initialize: master_weights=True makes no sense with O1 (the weights are already "
            "fp32); remove it, or use opt_level='O2'."
        )
    if over.get("keep_batchnorm_fp32") is not None:
        raise ValueError(
            "amp.initialize: with O1 batch norms already run in fp32 under autocast, so "
            "keep_batchnorm_fp32 must be None; remove it, or use opt_level='O2'."
        )


def resolve_properties(opt_level: str = "O1", device="cpu", **overrides) -> Properties:
    """Merge ``overrides`` (the non-None keyword arguments) into ``opt_level``'s defaults.

    Args:
        opt_level: ``"O0"``, ``"O1"``, ``"O2"`` or ``"O3"`` (the letter O, not zero).
        device: where the model lives; picks the default half dtype (fp16 CUDA, bf16 CPU).
        **overrides: any :class:`Properties` field; None means "the level's default";
            ``cast_model_outputs=False`` leaves the outputs uncast, ``cast_model_type=False``
            the model's dtypes; ``loss_scale`` may also be
            a :class:`~mpnb.core.amp.LossScaleRule` or a dict of its fields (``"dynamic"``).

    Example::

        >>> resolve_properties("O2", half_dtype=torch.float16).cast_model_type
        torch.float16
    """
    parse_opt_level(opt_level)
    unknown = set(overrides) - {f.name for f in dataclasses.fields(Properties)}
    if unknown:
        raise ValueError(f"amp.initialize: unknown properties {sorted(unknown)}.")
    over = {k: v for k, v in overrides.items() if v is not None}
    half = _resolve_half(over, device)
    if opt_level == "O1":
        _check_o1(over)
    props = OPT_LEVELS[opt_level].defaults(half)
    uncast = _no_cast(over.get("cast_model_type"))
    if uncast:  # the model keeps its dtypes; the level's other defaults stay (Apex)
        over.pop("cast_model_type")
        props = dataclasses.replace(props, cast_model_type=None)
        if "keep_batchnorm_fp32" not in over:
            props = dataclasses.replace(props, keep_batchnorm_fp32=None)
    conv = {
        "enabled": lambda v: _bool("enabled", v),
        "cast_model_type": lambda v: _dtype("cast_model_type", v, (*_HALF, torch.float32)),
        "patch_torch_functions": lambda v: _bool("patch_torch_functions", v),
        "keep_batchnorm_fp32": lambda v: _bool("keep_batchnorm_fp32", v),
        "master_weights": lambda v: _bool("master_weights", v),
        "loss_scale": _loss_scale,
        "cast_model_outputs": _outputs,
        "half_dtype": lambda v: _dtype("half_dtype", v, _HALF),
    }
    props = dataclasses.replace(props, **{k: conv[k](v) for k, v in over.items()})
    _check_consistent(props, uncast)
    return props


def _resolve_half(over: dict, device) -> torch.dtype:
    half = over.get("half_dtype")
    if half is not None:
        half = _dtype("half_dtype", half, _HALF)
    cast = over.get("cast_model_type")
    if cast is not None and not _no_cast(cast):
        cast = _dtype("cast_model_type", cast, (*_HALF, torch.float32))
        if cast in _HALF:
            if half is not None and half != cast:
                raise ValueError(
                    f"amp.initialize: cast_model_type={cast} conflicts with half_dtype={half}; "
                    "pass only one of them, or the same dtype to both."
                )
            half = cast
    return half or default_half_dtype(device)


def _check_consistent(p: Properties, uncast: bool = False) -> None:
    # With cast_model_type=False the model's own half params get the masters (Apex).
    if p.master_weights and p.cast_model_type not in _HALF and not uncast:
        raise ValueError(
            f"amp.initialize: master_weights=True needs a half model (cast_model_type "
            f"{p.half_dtype}), got cast_model_type={p.cast_model_type}; drop master_weights or "
            "use opt_level='O2'."
        )
    if p.keep_batchnorm_fp32 and p.cast_model_type not in _HALF and not uncast:
        raise ValueError(
            "amp.initialize: keep_batchnorm_fp32=True only applies when the model is cast to "
            "half (O2/O3); drop it or pick opt_level='O2' or 'O3'."
        )


def format_properties(p: Properties) -> str:
    """Apex-style listing of ``p``, one ``name : value`` line per property."""
    lines = [f"Selected optimization level {p.opt_level}:  {OPT_LEVELS[p.opt_level].brief}", ""]
    for f in dataclasses.fields(p):
        lines.append(f"{f.name:22} : {getattr(p, f.name)}")
    if p.half_dtype == torch.bfloat16 and p.loss_scale == 1.0 and p.opt_level in ("O1", "O2"):
        lines.append(
            "(loss_scale 1.0: bf16 has fp32's exponent range, so it needs no loss scaling, as "
            "in torch.amp; fp16 gets Apex's dynamic scale)"
        )
    return "\n".join(lines)
