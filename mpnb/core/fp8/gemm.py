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
  MX block scaling needs sm100+ and swizzled scales: mpnb does not send MX GEMMs to it.

:func:`emulated_mm` is the fallback everywhere: the same quantized operands, dequantized,
multiplied in float32 and cast once to the output dtype, so a fallback never changes the
numerics, only the speed.
"""

from __future__ import annotations

import torch

from mpnb.core.fp8.fp4_gemm import FP4Operand, fp4_mm
from mpnb.core.fp8.quantize import Float8Operand
from mpnb.core.hardware import dtype_support

__all__ = ["fp8_mm", "emulated_mm", "scaled_mm_blocker", "scaled_mm_rule"]

_MX_REASON = (
    "MXFP8 GEMMs run emulated (dequantize + float32 matmul) on every device: torch._scaled_mm "
    "on CPU rejects float8_e8m0fnu block scales ('Invalid scaling configuration', torch "
    "2.13), and mpnb does not call its CUDA MX path (sm100+, swizzled scales) before it is "
    "verified on such a GPU"
)


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
    if isinstance(a, FP4Operand):
        return "fp4", (
            f"{a.label} GEMMs run emulated on every device (E2M1 values and both scale levels "
            "accumulated per block in float32, as TransformerEngine's reference qgemm): mpnb "
            "does not call torch's FP4 scaled_mm (sm100+) before it is verified on such a GPU"
        )
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

    Example::

        >>> scaled_mm_rule("cuda", (9, 0), "tensorwise", 40, 64, torch.bfloat16)[0]
        'shape'
    """
    if granularity == "mx":
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
    on the CPU the result equals ``torch._scaled_mm``'s bit for bit (tested).
    """
    return (a.dequantize() @ b.dequantize().t().contiguous()).to(out_dtype)


def fp8_mm(a: Float8Operand, b: Float8Operand, out_dtype: torch.dtype, scaled_mm: bool):
    """``a @ b.T`` for ``(M, K)`` and ``(N, K)`` operands quantized along ``K``.

    Args:
        a, b: operands of the same granularity (two :class:`~mpnb.core.fp8.fp4_gemm.
            FP4Operand` run :func:`~mpnb.core.fp8.fp4_gemm.fp4_mm`).
        out_dtype: the result's dtype (the accumulation is float32 either way).
        scaled_mm: True runs ``torch._scaled_mm`` (check :func:`scaled_mm_blocker` first),
            False runs :func:`emulated_mm`.
    """
    if isinstance(a, FP4Operand):  # the four-bit recipes: the emulated block-scaled GEMM
        return fp4_mm(a, b, out_dtype)
    if not scaled_mm:
        return emulated_mm(a, b, out_dtype)
    sb = b.dequant_scale.view(1, -1) if b.granularity == "rowwise" else b.dequant_scale
    return torch._scaled_mm(a.data, b.data.t(), a.dequant_scale, sb, out_dtype=out_dtype)
