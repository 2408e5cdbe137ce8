"""The FP8 GEMM ``a @ b.T``: ``torch._scaled_mm`` where it can run, else the same math emulated.

What ``torch._scaled_mm`` does (torch 2.13):

* **CPU** (measured on this project's CI CPU, AVX2, no AMX): tensorwise (0-d float32 scales)
  and rowwise (``(M, 1)`` and ``(1, N)`` float32 scales) on any float8 pair, any shape (no
  multiple-of-16 rule), either layout, float32/bfloat16/float16 outputs. The kernel
  converts both operands to float32, multiplies by the scales, runs a float32 matmul and casts
  the result once: exactly :func:`emulated_mm` below. MX block scales (``float8_e8m0fnu``),
  1x128/128x128 blockwise scales and 1-D rowwise scales are rejected ("Invalid scaling
  configuration"). On a CPU with AMX, torch routes to oneDNN instead.
* **CUDA** (from torch's checks; not run here): sm89+ for tensorwise, sm90+ and a bfloat16
  output for rowwise; ``K`` and ``N`` multiples of 16; the second operand column-major.
* **Block-scaled** (MXFP8, MXFP4, NVFP4): sm100+ and swizzled scales
  (:mod:`mpnb.core.fp8.blocked`). mpnb could not run these on a GPU of its own, so the first
  time a (device, format) pair would go native in a process, :func:`native_block_scaled`
  runs one small GEMM both ways and compares it with the emulated one within the float32
  accumulation bound; a pair that fails (or raises) stays emulated for the process, with one
  :class:`NativeGemmCheckWarning` naming the card, torch and the error.

:func:`emulated_mm` is the fallback everywhere: the same quantized operands, dequantized,
multiplied in float32 and cast once to the output dtype, so a fallback never changes the
numerics, only the speed.
"""

from __future__ import annotations

import warnings

import torch

from mpnb.core.fp8.blocked import (
    NATIVE_MIN_CAPABILITY,
    blocked_scaled_mm,
    first_use_check,
    native_dtypes_missing,
)
from mpnb.core.fp8.formats import E4M3
from mpnb.core.fp8.fp4_gemm import FP4Operand, fp4_mm
from mpnb.core.fp8.quantize import Float8Operand
from mpnb.core.hardware import dtype_support

__all__ = [
    "fp8_mm",
    "emulated_mm",
    "scaled_mm_blocker",
    "scaled_mm_rule",
    "block_format",
    "device_capability",
    "native_block_scaled",
    "block_scaled_status",
    "NativeGemmCheckWarning",
]

_MX_REASON = (
    "MXFP8 GEMMs run emulated (dequantize + float32 matmul) here: torch._scaled_mm on CPU "
    "rejects float8_e8m0fnu block scales ('Invalid scaling configuration', torch 2.13), and "
    "its CUDA MX path needs CUDA capability 10.0+ (sm100)"
)
_FP4_EMULATED = (
    "GEMMs run emulated here (E2M1 values and both scale levels accumulated per block in "
    "float32, as TransformerEngine's reference qgemm)"
)
#: (device, format key) -> None (native: the first-use check passed) or why not
_DECISIONS: dict[tuple, str | None] = {}


class NativeGemmCheckWarning(UserWarning):
    """A native block-scaled GEMM failed its first-use check: its format stays emulated."""


def block_format(a, b, out_dtype: torch.dtype) -> tuple:
    """The key the native decision is taken for: ``("nvfp4",)``, ``("mxfp4",)`` or
    ``("mxfp8", a_dtype, b_dtype, out_dtype)`` (each MXFP8 dtype pair is checked apart)."""
    if isinstance(a, FP4Operand):
        return ("nvfp4",) if a.block == 16 else ("mxfp4",)
    return ("mxfp8", a.data.dtype, b.data.dtype, out_dtype)


def device_capability(device) -> tuple[int, int] | None:
    """The CUDA capability of ``device`` (``(10, 0)`` on a B200), None for a device that is
    not a CUDA GPU of this process: what the block-scaled decision reads of the hardware."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(dev))


def _card(device: torch.device) -> str:
    cap = device_capability(device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
    return f"{name} (CUDA capability {cap[0]}.{cap[1]})" if cap else name


def _device_refusal(dev: torch.device, fmt: str) -> str | None:
    """Why ``dev`` cannot run ``fmt``'s block-scaled GEMM natively at all (None: it may)."""
    cap = device_capability(dev)
    if cap is None:
        return f"{fmt} GEMMs run emulated on {dev}: torch's block-scaled GEMMs need a CUDA GPU"
    if cap < NATIVE_MIN_CAPABILITY:
        return (
            f"{fmt} GEMMs run emulated: torch._scaled_mm's block-scaled GEMMs need CUDA "
            f"capability 10.0+ (sm100), this GPU has {cap[0]}.{cap[1]}"
        )
    missing = native_dtypes_missing()
    if missing:
        return (
            f"{fmt} GEMMs run emulated: this torch ({torch.__version__}) lacks "
            f"{', '.join('torch.' + m for m in missing)}; upgrade torch for native GEMMs"
        )
    return None


def native_block_scaled(device, key: tuple) -> str | None:
    """None where ``key``'s GEMMs (:func:`block_format`) run natively on ``device``, else why
    they stay emulated: a device below sm100, a torch without the dtypes, or a failed
    first-use check. The check is run once per process and pair, on the first call
    (:func:`mpnb.core.fp8.blocked.first_use_check`: one small GEMM, a host sync); a failure
    warns once (:class:`NativeGemmCheckWarning`) and is remembered.

    .. warning:: inside CUDA graph capture an undecided pair stays emulated for that call
       (the check syncs); a call outside capture decides it.
    """
    dev = torch.device(device)
    refusal = _device_refusal(dev, key[0])
    if refusal is not None:
        return refusal
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if (dev, key) in _DECISIONS:
        return _DECISIONS[(dev, key)]
    if dev.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return "its first-use check cannot run during CUDA graph capture; run a step first"
    why = first_use_check(dev, key[0], key[1:3], key[3] if len(key) > 3 else torch.float32)
    if why is not None:
        why = (
            f"the native {key[0]} GEMM (torch._scaled_mm, block-scaled) failed mpnb's "
            f"first-use check on {_card(dev)}, torch {torch.__version__}: {why}"
        )
        warnings.warn(
            NativeGemmCheckWarning(
                f"mpnb.fp8: {why}. {key[0]} GEMMs stay emulated in this process (same "
                "numerics, no speed-up); please report this message to mpnb."
            ),
            stacklevel=3,
        )
    _DECISIONS[(dev, key)] = why
    return why


def _block_scaled_blocker(a, b, out_dtype: torch.dtype):
    fp4 = isinstance(a, FP4Operand)
    key = block_format(a, b, out_dtype)
    category = "fp4" if fp4 else "recipe"
    dev = a.data.device
    if device_capability(dev) is None:  # the CPU (and any non-CUDA device)
        return category, (f"{a.label} {_FP4_EMULATED}" if fp4 else _MX_REASON)
    refusal = _device_refusal(dev, key[0])
    if refusal is not None:
        return category, refusal
    k, n = (a.shape[1] if fp4 else a.data.shape[1]), b.data.shape[0]
    kk = 32 if fp4 else 16
    if k % kk or n % 16:
        return ("fp4" if fp4 else "shape"), (
            f"torch._scaled_mm's {key[0]} GEMM needs K a multiple of {kk} and N of 16, this "
            f"GEMM has K={k}, N={n}"
        )
    why = native_block_scaled(dev, key)
    return None if why is None else (category, why)


def block_scaled_status(device, fmt: str, dtypes=(E4M3, E4M3), out_dtype=torch.float32) -> str:
    """``"native"`` where ``fmt``'s (``"mxfp8"``, ``"nvfp4"``, ``"mxfp4"``) GEMMs of a
    whole-tile shape run in torch's block-scaled GEMM on ``device``, else ``"emulated"``:
    :func:`native_block_scaled`'s decision, the one :func:`scaled_mm_blocker` takes
    (``dtypes``, ``out_dtype``: MXFP8's forward element dtypes and output)."""
    key = (fmt,) if fmt != "mxfp8" else ("mxfp8", *dtypes, out_dtype)
    return "native" if native_block_scaled(device, key) is None else "emulated"


def scaled_mm_blocker(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype):
    """Why ``torch._scaled_mm`` cannot compute ``a @ b.T`` here: ``(category, reason)`` or None.

    The category (``"recipe"``, ``"device"``, ``"shape"``, ``"out_dtype"``, or
    ``"out_dtype+shape"`` with both reasons when both hold) is what a layer warns about
    once; ``"speed"`` (a CPU whose ``torch._scaled_mm`` measured slower than its float32
    GEMM: :func:`mpnb.core.hardware.dtype_support`) is not warned about.

    Example::

        >>> scaled_mm_blocker(quantize_tensorwise(x, E4M3), quantize_tensorwise(w, E4M3),
        ...                   torch.float32)      # None on CPU: torch._scaled_mm runs it
    """
    if isinstance(a, FP4Operand) or a.granularity == "mx":
        return _block_scaled_blocker(a, b, out_dtype)
    dev = a.data.device
    cap = torch.cuda.get_device_capability(dev) if dev.type == "cuda" else None
    k, n = a.data.shape[1], b.data.shape[0]
    rule = scaled_mm_rule(dev.type, cap, a.granularity, k, n, out_dtype)
    if rule is None and dev.type == "cpu":
        fp8 = dtype_support("cpu")["float8_e4m3fn"]
        if fp8.status == "unsupported":
            # torch._scaled_mm exists but can fail in this process (oneDNN under an ISA limit)
            return "device", f"torch._scaled_mm cannot run on this CPU here ({fp8.reason})"
        if fp8.status == "emulated":
            # It runs, but slower than the float32 GEMM it would replace (on an AMX CPU
            # oneDNN's FP8 matmul took 590 ms for 128x128): the emulated GEMM computes the
            # same math faster. Not warned: doctor and the verdict already name FP8 emulated.
            return "speed", f"torch._scaled_mm is slower than float32 here ({fp8.reason})"
    return rule


def scaled_mm_rule(device_type: str, capability, granularity: str, k: int, n: int, out_dtype):
    """:func:`scaled_mm_blocker` on plain values (``capability``: CUDA's ``(major, minor)``).

    For ``"mx"`` on sm100+ a None leaves the decision to the first-use check
    (:func:`native_block_scaled`), which needs a device, not plain values.

    Example::

        >>> scaled_mm_rule("cuda", (9, 0), "tensorwise", 40, 64, torch.bfloat16)[0]
        'shape'
    """
    if granularity == "mx":
        # on sm100+ an MX GEMM of such a shape is then the first-use check's to decide
        if device_type != "cuda" or tuple(capability) < NATIVE_MIN_CAPABILITY:
            return "recipe", _MX_REASON
    if device_type == "cpu":
        return None
    if device_type != "cuda":
        return "device", f"torch._scaled_mm has no FP8 GEMM on {device_type}"
    need = (9, 0) if granularity == "rowwise" else (8, 9)
    if tuple(capability) < need:
        return "device", (
            f"{granularity} FP8 GEMMs need CUDA capability {need[0]}.{need[1]}+, this GPU "
            f"has {capability[0]}.{capability[1]}"
        )
    # Every cause at once, so that fixing the one named does not reveal another later.
    causes = []
    if granularity == "rowwise" and out_dtype != torch.bfloat16:
        causes.append(
            (
                "out_dtype",
                f"rowwise torch._scaled_mm on CUDA only writes bfloat16, this GEMM's output is "
                f"{out_dtype}",
            )
        )
    if k % 16 or n % 16:
        causes.append(
            (
                "shape",
                "torch._scaled_mm on CUDA needs K and N multiples of 16, "
                f"this GEMM has K={k}, N={n}",
            )
        )
    if not causes:
        return None
    return "+".join(c for c, _ in causes), "; and ".join(r for _, r in causes)


def emulated_mm(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` from the dequantized operands, a float32 matmul, one cast to ``out_dtype``.

    The operand layouts match CPU ``torch._scaled_mm`` (``b`` made row-major ``(K, N)``), so
    where oneDNN's FP8 matmul scales the operands before it accumulates (AVX2 CPUs) the result
    equals ``torch._scaled_mm``'s bit for bit; its AMX path applies a tensorwise scale
    otherwise, and the two differ by float32 rounding, at most 4 * 2^-24 * ``|a| @ |b|.T``
    (both tested).
    """
    return (a.dequantize() @ b.dequantize().t().contiguous()).to(out_dtype)


def fp8_mm(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype, scaled_mm: bool):
    """``a @ b.T`` for ``(M, K)`` and ``(N, K)`` operands quantized along ``K``.

    Args:
        a, b: operands of the same granularity (two :class:`~mpnb.core.fp8.fp4_gemm.
            FP4Operand` run :func:`~mpnb.core.fp8.fp4_gemm.fp4_mm`).
        out_dtype: the result's dtype (the accumulation is float32 either way).
        scaled_mm: True runs ``torch._scaled_mm`` (check :func:`scaled_mm_blocker` first;
            MX and FP4 operands: :func:`~mpnb.core.fp8.blocked.blocked_scaled_mm`), False
            runs :func:`emulated_mm` (FP4: :func:`~mpnb.core.fp8.fp4_gemm.fp4_mm`).
    """
    block_scaled = isinstance(a, FP4Operand) or a.granularity == "mx"
    if block_scaled and scaled_mm:
        return blocked_scaled_mm(a, b, out_dtype)
    if isinstance(a, FP4Operand):  # the four-bit recipes: the emulated block-scaled GEMM
        return fp4_mm(a, b, out_dtype)
    if not scaled_mm:
        return emulated_mm(a, b, out_dtype)
    sb = b.dequant_scale.view(1, -1) if b.granularity == "rowwise" else b.dequant_scale
    return torch._scaled_mm(a.data, b.data.t(), a.dequant_scale, sb, out_dtype=out_dtype)
