"""Number formats as objects: one table, :data:`FORMATS`, one row per format.

A row says everything mpnb knows of a format: its torch dtypes (or the element set mpnb
emulates where torch has none), its block and scale layout, the GEMM probe doctor times it
with, the speed that counts as native, the CUDA capability it needs, what emulation costs,
and the advice shown when a run in it diverges. Code above core asks the row
(:func:`format_of`, :func:`format_named`, a configuration's ``number_format``), never a dtype's
name or display text. A new format is one row (:func:`register_format`) plus its quantizer.

Example::

    >>> format_of(torch.float8_e5m2).name, format_named("nvfp4").block
    ('fp8', 16)
    >>> [f.probe.dtype for f in probed_formats()]
    ['bfloat16', 'float16', 'float8_e4m3fn']
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field

import torch

__all__ = [
    "E2M1_GRID",
    "E2M1_MAX",
    "FORMATS",
    "GemmProbe",
    "NumberFormat",
    "format_named",
    "format_of",
    "is_block_scale",
    "is_scaled",
    "native_min_speeds",
    "probed_formats",
    "read_precision",
    "register_format",
]


@dataclass(frozen=True)
class GemmProbe:
    """How doctor times a format's GEMM against float32 (:mod:`mpnb.core._gemm_probe`).

    Attributes:
        dtype: the torch dtype name the operands are cast to (doctor's key for the format).
        op: ``"mm"`` (``torch.mm`` in ``dtype``) or ``"scaled_mm"`` (``torch._scaled_mm``).
        cpu_sizes: the square sizes tried in turn on a CPU (a later one only when the earlier
            one was not decisive).
        cpu_flags: the CPU flags whose presence makes the format native in hardware (shown
            as evidence; ``()``: none, the evidence is ``torch._scaled_mm``).
    """

    dtype: str
    op: str = "mm"
    cpu_sizes: tuple[int, ...] = (128,)
    cpu_flags: tuple[str, ...] = ()


_HALF_COST = "every {name} op is converted to fp32 and back in software"
_HALF_READING = "it costs time here and saves only memory"
_HALF_CONSEQUENCE = {
    "native": "it can save time as well as memory",
    "emulated": "it saves memory here, not time",
    "unsupported": "PyTorch cannot compute it here",
}
#: FP8 recipes keep fp32 weights: FP8 is for the GEMMs' speed, so emulated it buys accuracy data
_SCALED_CONSEQUENCE = {
    "native": "its GEMMs can run faster than fp32's",
    "emulated": "its rows show FP8's accuracy here, not its speed",
    "unsupported": "PyTorch cannot compute it here (mpnb emulates it)",
}
_SCALED_COST = (
    "every FP8 GEMM is dequantized and multiplied in float32, after the quantization work"
)
_SCALED_READING = "its rows show FP8's accuracy here, not its speed"


@dataclass(frozen=True)
class NumberFormat:
    """One number format: a row of :data:`FORMATS`.

    Attributes:
        name: the short name rows, the verdict and the widgets show (``"bf16"``, ``"fp8"``).
        description: one line for people.
        dtypes: torch dtype names of its elements (``()`` where torch has none).
        elements: the emulated element magnitudes where torch has no dtype (E2M1's grid).
        element_max: the largest finite element value.
        block: elements sharing one scale (None: no block scale).
        scale: the scale layout, in words (``"none"``, ``"per tensor"``, ...).
        scale_dtype: the torch dtype name of its block scales (None: float32 or none).
        probe: the GEMM doctor times it with (None: doctor does not probe it).
        native_min_speed: the fraction of float32's GEMM speed that counts as native.
        min_capability: the CUDA capability its native GEMM needs (None: any).
        capability_subject: what needs that capability, in the refusal ("bf16 needs").
        scaled: True for formats computed through scaled GEMMs (``torch._scaled_mm``).
        emulation_cost: what emulation does to every op (``{name}`` is filled in).
        emulated_reading: what an emulated run's rows leave to read.
        consequences: status -> what that status means for a run in this format.
        divergence_advice: what to try when a run in this format diverges, a sentence after
            the format's name in the error (``{static}``: where a static loss scale gets its
            own advice).
        divergence_what: how that error names the format (default: its name).
        loss_scaled: trained behind a loss scale (fp16): the error names the scale.
        quantizer: the quantizer, a callable or ``"module:function"`` (None: a plain cast).
    """

    name: str
    description: str
    dtypes: tuple[str, ...] = ()
    elements: tuple[float, ...] | None = None
    element_max: float | None = None
    block: int | None = None
    scale: str = "none"
    scale_dtype: str | None = None
    probe: GemmProbe | None = None
    native_min_speed: float | None = None
    min_capability: tuple[int, int] | None = None
    capability_subject: str = ""
    scaled: bool = False
    emulation_cost: str = _HALF_COST
    emulated_reading: str = _HALF_READING
    consequences: Mapping[str, str] = field(default_factory=lambda: dict(_HALF_CONSEQUENCE))
    divergence_advice: str = "lower the learning rate or clip the gradients."
    divergence_what: str = ""
    loss_scaled: bool = False
    quantizer: Callable | str | None = None

    @property
    def is_fp8(self) -> bool:
        """True for the float8 formats (per-tensor, rowwise and MX-blocked FP8)."""
        return any(d.startswith("float8") for d in self.dtypes)

    @property
    def low_precision(self) -> bool:
        """True for every format narrower than float32's storage (tf32 stores float32)."""
        return self.dtypes != ("float32",)

    @property
    def torch_dtypes(self) -> tuple[torch.dtype, ...]:
        """The torch dtypes of :attr:`dtypes` that this torch has."""
        return tuple(getattr(torch, d) for d in self.dtypes if hasattr(torch, d))

    def divergence(self, dynamic: bool, scale: float) -> str:
        """``" (fp16, dynamic loss scale 1024); lower the learning rate, ..."``: what the
        error of a run in this format whose loss became inf/NaN says after its head."""
        what = self.divergence_what or self.name
        if self.loss_scaled:
            what += f", {'dynamic' if dynamic else 'static'} loss scale {scale:g}"
        static = "" if dynamic or not self.loss_scaled else ", use dynamic loss scaling"
        return f" ({what}); " + self.divergence_advice.format(static=static)

    def cost(self) -> str:
        """:attr:`emulation_cost` with the format's name filled in."""
        return self.emulation_cost.format(name=self.name)

    def capability_refusal(self, device_name: str, capability: str) -> str:
        """Why a CUDA device of ``capability`` ("8.6") cannot run this format ("": it may)."""
        if self.min_capability is None:
            return ""
        cap = tuple(int(v) for v in capability.split("."))
        if cap >= self.min_capability:
            return ""
        need = ".".join(str(v) for v in self.min_capability)
        return f"{device_name} has CUDA capability {capability}; {self.capability_subject} {need}+"

    def quantize(self, x: torch.Tensor, *args, **kwargs):
        """Quantize ``x`` with this format's quantizer (a plain cast when it has none)."""
        fn = self.quantizer
        if isinstance(fn, str):
            mod, _, attr = fn.partition(":")
            fn = getattr(importlib.import_module(mod), attr)
        if fn is None:
            return x.to(self.torch_dtypes[0])
        return fn(x, *args, **kwargs)


#: FP4 E2M1's element set (OCP MX spec 5.3.3), which torch has no dtype for: the largest
#: magnitude and the magnitudes of codes 0..7. Defined in the table, the lowest layer that
#: names formats; :mod:`mpnb.core.fp8.fp4` quantizes to it.
E2M1_MAX = 6.0
E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

_FP8 = ("float8_e4m3fn", "float8_e5m2")
_E4M3_MAX = float(torch.finfo(torch.float8_e4m3fn).max)  # 448
_E8M0 = "float8_e8m0fnu"
_E2M1 = tuple(-v for v in reversed(E2M1_GRID[1:])) + E2M1_GRID  # every E2M1 value
_FP4_DIVERGE = (
    "keep the first and last layers in higher precision, and try stochastic rounding for the "
    "gradients or a random Hadamard transform."
)

#: The formats mpnb knows, by short name, in the order doctor and the lab show them.
FORMATS: dict[str, NumberFormat] = {
    f.name: f
    for f in (
        NumberFormat(
            "fp32",
            "IEEE float32",
            ("float32",),
            element_max=3.4028234663852886e38,
            divergence_what="fp32: not a precision problem",
        ),
        NumberFormat(
            "tf32",
            "float32 storage, GEMMs with a 10-bit mantissa on tensor cores",
            ("float32",),
            element_max=3.4028234663852886e38,
            min_capability=(8, 0),
            capability_subject="TF32 needs",
            divergence_advice="lower the learning rate, or set torch's float32 matmul precision "
            "back to 'highest'.",
        ),
        NumberFormat(
            "bf16",
            "bfloat16: float32's range, 8 mantissa bits",
            ("bfloat16",),
            element_max=float(torch.finfo(torch.bfloat16).max),
            probe=GemmProbe("bfloat16", cpu_flags=("avx512_bf16", "amx_bf16")),
            native_min_speed=0.25,
            min_capability=(8, 0),
            capability_subject="bf16 needs",
            divergence_what="bf16, which has fp32's range: loss scaling would not help",
        ),
        NumberFormat(
            "fp16",
            "IEEE float16: 5 exponent bits, 10 mantissa bits",
            ("float16",),
            element_max=float(torch.finfo(torch.float16).max),
            probe=GemmProbe("float16", cpu_flags=("avx512_fp16", "amx_fp16")),
            native_min_speed=0.25,
            divergence_advice="lower the learning rate{static}, or bf16 (fp32's range).",
            loss_scaled=True,
        ),
        NumberFormat(
            "fp8",
            "float8 E4M3 (forward) / E5M2 (gradients), per-tensor or rowwise scales",
            _FP8,
            element_max=_E4M3_MAX,
            scale="per tensor or per row, float32",
            probe=GemmProbe("float8_e4m3fn", op="scaled_mm", cpu_sizes=(16, 128)),
            native_min_speed=1.0,
            min_capability=(8, 9),
            capability_subject="FP8 GEMMs (torch._scaled_mm) need",
            scaled=True,
            emulation_cost=_SCALED_COST,
            emulated_reading=_SCALED_READING,
            consequences=dict(_SCALED_CONSEQUENCE),
            divergence_what="FP8 matmuls, scaled per tensor or block",
            divergence_advice="lower the learning rate or clip the gradients, and compare with "
            "O0 to see whether FP8 is the cause.",
        ),
        NumberFormat(
            "mxfp8",
            "MXFP8: float8 elements, one E8M0 power-of-two scale per 32",
            _FP8,
            element_max=_E4M3_MAX,
            block=32,
            scale="E8M0 per 32 elements",
            scale_dtype=_E8M0,
            min_capability=(10, 0),
            capability_subject="MXFP8 GEMMs need",
            scaled=True,
            emulation_cost=_SCALED_COST,
            emulated_reading=_SCALED_READING,
            consequences=dict(_SCALED_CONSEQUENCE),
            divergence_advice="lower the learning rate, or use the 'floor' scale rounding or "
            "E5M2 gradients.",
            quantizer="mpnb.core.fp8.quantize:quantize_mx",
        ),
        NumberFormat(
            "nvfp4",
            "NVFP4: E2M1 elements, an E4M3 scale per 16 and a float32 tensor scale",
            elements=_E2M1,
            element_max=E2M1_MAX,
            block=16,
            scale="E4M3 per 16 elements, times a float32 per-tensor scale",
            scale_dtype="float8_e4m3fn",
            min_capability=(10, 0),
            capability_subject="NVFP4 GEMMs need",
            scaled=True,
            emulation_cost=_SCALED_COST.replace("FP8", "NVFP4"),
            emulated_reading=_SCALED_READING.replace("FP8", "NVFP4"),
            divergence_advice=_FP4_DIVERGE,
            quantizer="mpnb.core.fp8.nvfp4:quantize_nvfp4",
        ),
        NumberFormat(
            "mxfp4",
            "MXFP4: E2M1 elements, one E8M0 power-of-two scale per 32",
            elements=_E2M1,
            element_max=E2M1_MAX,
            block=32,
            scale="E8M0 per 32 elements",
            scale_dtype=_E8M0,
            min_capability=(10, 0),
            capability_subject="MXFP4 GEMMs need",
            scaled=True,
            emulation_cost=_SCALED_COST.replace("FP8", "MXFP4"),
            emulated_reading=_SCALED_READING.replace("FP8", "MXFP4"),
            divergence_advice=_FP4_DIVERGE,
            quantizer="mpnb.core.fp8.mxfp4:quantize_mxfp4",
        ),
    )
}


def register_format(fmt: NumberFormat) -> NumberFormat:
    """Add ``fmt`` to :data:`FORMATS`: doctor probes it (if it has a ``probe``), the hardware
    rules and the lab's traces know it, with no other edit. Returns ``fmt``.

    Raises:
        ValueError: a format of that name exists already.

    Example::

        >>> register_format(NumberFormat("fp6", "E3M2", ("float6_e3m2",)))   # doctest: +SKIP
    """
    if fmt.name in FORMATS:
        raise ValueError(
            f"a number format named {fmt.name!r} exists already; pick another name, or "
            f"del mpnb.core.number_formats.FORMATS[{fmt.name!r}] first to replace it."
        )
    FORMATS[fmt.name] = fmt
    return fmt


def format_named(name: str) -> NumberFormat:
    """The row of :data:`FORMATS` called ``name`` (a short name: ``"bf16"``, ``"nvfp4"``).

    Raises:
        KeyError: naming the formats there are.
    """
    if name not in FORMATS:
        raise KeyError(
            f"no number format named {name!r}; use one of {', '.join(FORMATS)} "
            "(or add one with mpnb.core.number_formats.register_format)."
        )
    return FORMATS[name]


def _named_rows(name: str) -> Iterator[NumberFormat]:
    yield from (f for f in FORMATS.values() if name in f.dtypes)
    yield from (f for f in FORMATS.values() if f.scale_dtype == name)


def format_of(dtype) -> NumberFormat | None:
    """The format of ``dtype``: a torch dtype, its torch name (``"float8_e5m2"``), or a short
    name (``"bf16"``); a block-scale dtype (``"float8_e8m0fnu"``) gives its MX format. None
    for a dtype that is no number format of mpnb's (``"int64"``, ``"-"``).

    Example::

        >>> format_of("float8_e8m0fnu").name, format_of(torch.float32).name
        ('mxfp8', 'fp32')
    """
    name = str(dtype).removeprefix("torch.")
    if name in FORMATS:
        return FORMATS[name]
    return next(_named_rows(name), None)


def is_scaled(dtype) -> bool:
    """True where ``dtype`` (or a part of a joined name, ``"float8_e4m3fn+float8_e5m2"``) is an
    element or block-scale dtype of a scaled format (FP8, MX, NVFP4, a registered one)."""
    return any((f := format_of(d)) is not None and f.scaled for d in str(dtype).split("+"))


def is_block_scale(dtype) -> bool:
    """True where ``dtype`` is only ever a block scale (E8M0), never a format's element."""
    name = str(dtype).removeprefix("torch.")
    rows = FORMATS.values()
    return any(f.scale_dtype == name for f in rows) and not any(name in f.dtypes for f in rows)


def read_precision(cell) -> tuple[NumberFormat | None, str]:
    """``(format, status)`` of a row's ``precision`` cell, the inverse of
    :meth:`~mpnb.core.precision_configs.PrecisionConfig.precision_text`: ``"fp8 (emulated)"``
    gives the fp8 row and ``"emulated"``, ``"fp32"`` the fp32 row and ``""``.

    Example::

        >>> f, status = read_precision("bf16 (native)")
        >>> f.name, status
        ('bf16', 'native')
    """
    name, _, rest = str(cell or "").partition("(")
    return format_of(name.strip()), rest.rstrip(")").strip()


def probed_formats() -> list[NumberFormat]:
    """The formats doctor probes (those with a ``probe``), in table order."""
    return [f for f in FORMATS.values() if f.probe is not None]


def native_min_speeds() -> dict[str, float]:
    """Doctor's key (the probe's dtype name) -> the native threshold, for the probed formats."""
    return {f.probe.dtype: f.native_min_speed for f in probed_formats()}
