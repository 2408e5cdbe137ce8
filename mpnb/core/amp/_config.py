"""One definition of each amp concept the lab and users name: half dtypes and loss scales.

:data:`HALF_DTYPES` and :func:`parse_half_dtype` are the half-dtype names every entry point
accepts; :class:`LossScaleRule` (defined in :mod:`mpnb.core.amp._rule`, re-exported here) is the
loss scaler's rule, and :meth:`LossScaleRule.parse` turns anything a user may pass as
``loss_scale`` into one. The opt levels live beside the properties they set
(:data:`mpnb.core.amp.OPT_LEVELS`).
"""

from __future__ import annotations

import torch

from mpnb.core.amp._rule import LossScaleRule, parse_loss_scale
from mpnb.core.hardware import default_half_dtype

__all__ = [
    "HALF_DTYPES",
    "LossScaleRule",
    "half_dtype_name",
    "parse_half_dtype",
    "parse_loss_scale",
]

HALF_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
"""Every name of a half dtype that amp, the lab and the CLI accept."""


def parse_half_dtype(value, device="cpu", *, name: str = "half_dtype") -> torch.dtype:
    """``torch.float16``/``torch.bfloat16`` from a dtype or one of :data:`HALF_DTYPES`' names.

    Args:
        value: a half dtype, a name (``"bf16"``, ``"fp16"``, ...), or None/``"auto"`` for
            the device's default (fp16 on CUDA, bf16 on CPU).
        device: the device whose default ``None``/``"auto"`` means.
        name: the argument's name in the error message.

    Example::

        >>> parse_half_dtype("bf16")
        torch.bfloat16
    """
    if value is None or value == "auto":
        return default_half_dtype(device)
    dtype = HALF_DTYPES.get(value, value) if isinstance(value, str) else value
    if dtype not in (torch.float16, torch.bfloat16):
        raise ValueError(
            f"{name}={value!r} is invalid; valid choices: torch.float16, torch.bfloat16, "
            f"{', '.join(repr(k) for k in HALF_DTYPES)} (or None/'auto' for the device default)."
        )
    return dtype


def half_dtype_name(dtype: torch.dtype) -> str:
    """The short name of a half dtype: ``"bf16"`` or ``"fp16"``.

    Example::

        >>> half_dtype_name(torch.float16)
        'fp16'
    """
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}[parse_half_dtype(dtype)]
