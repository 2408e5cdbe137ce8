"""The names of mpnb's dtypes, defined once: what users type, what rows show, what doctor keys.

Three spellings name one dtype, and every module converts through here:

==================  ===========================  ================================================
short name          torch name (doctor's key)    torch dtype
==================  ===========================  ================================================
``"fp32"``          ``"float32"``                ``torch.float32``
``"bf16"``          ``"bfloat16"``               ``torch.bfloat16``
``"fp16"``          ``"float16"``                ``torch.float16``
``"fp8"``           ``"float8_e4m3fn"``          ``torch.float8_e4m3fn`` (``float8_e5m2`` too)
==================  ===========================  ================================================

The lab's rows, the verdict and the widgets show short names; :func:`mpnb.core.hardware.
dtype_support` and :func:`~mpnb.core.hardware.half_support` key their facts by torch names;
users pass any of them. :func:`lookup` finds an entry in a mapping keyed either way.

Example::

    >>> short_name(torch.bfloat16), torch_name("bf16"), parse_half_dtype("fp16")
    ('bf16', 'bfloat16', torch.float16)
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

__all__ = [
    "HALF_DTYPES",
    "HALF_NAMES",
    "default_half_dtype",
    "half_dtype_name",
    "lookup",
    "parse_half_dtype",
    "short_name",
    "torch_name",
]

#: short name -> torch name (the key of doctor's facts)
_TORCH_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "fp8": "float8_e4m3fn"}
_SHORT_NAMES = {v: k for k, v in _TORCH_NAMES.items()} | {"float8_e5m2": "fp8", "half": "fp16"}

#: the short names of the half dtypes, in the order the lab offers them
HALF_NAMES = ("bf16", "fp16")

HALF_DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
}
"""Every name of a half dtype that amp, the lab and the CLI accept."""


def short_name(dtype) -> str:
    """``"bf16"`` for ``torch.bfloat16``, ``"bfloat16"``, ``"torch.bfloat16"`` or ``"bf16"``
    (``"fp32"``, ``"fp16"``, ``"fp8"`` likewise); a name it does not know comes back as given.

    Example::

        >>> short_name(torch.float16), short_name("float8_e4m3fn")
        ('fp16', 'fp8')
    """
    name = str(dtype).removeprefix("torch.")
    return _SHORT_NAMES.get(name, name)


def torch_name(dtype) -> str:
    """The torch name doctor's facts are keyed by: ``"bfloat16"`` for ``"bf16"`` (or the dtype).

    Example::

        >>> torch_name("fp8")
        'float8_e4m3fn'
    """
    short = short_name(dtype)
    return _TORCH_NAMES.get(short, short)


def lookup(mapping: Mapping, dtype):
    """The entry of ``mapping`` for ``dtype``, whether the mapping is keyed by short names
    (a compare DataFrame's ``attrs["hardware"]``) or torch names (doctor's facts).

    Raises:
        KeyError: naming the dtype and the keys there are.

    Example::

        >>> lookup({"bfloat16": "native"}, "bf16")
        'native'
    """
    short = short_name(dtype)
    for key in (short, _TORCH_NAMES.get(short, short)):
        if key in mapping:
            return mapping[key]
    raise KeyError(
        f"no fact for {short!r} among {sorted(mapping)}; pass doctor's facts "
        "(mpnb.core.hardware.dtype_support(device)) or a compare DataFrame's attrs['hardware']."
    )


def default_half_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The half dtype mpnb picks when the user does not choose: fp16 on CUDA, bf16 on CPU.

    Example::

        >>> default_half_dtype("cpu")
        torch.bfloat16
    """
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16


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


def half_dtype_name(dtype) -> str:
    """The short name of a half dtype (or of any name :func:`parse_half_dtype` accepts).

    Example::

        >>> half_dtype_name(torch.float16)
        'fp16'
    """
    return short_name(parse_half_dtype(dtype))
