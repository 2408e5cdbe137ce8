"""The operands of torch's block-scaled ``torch._scaled_mm`` (MXFP8, MXFP4, NVFP4; sm100+).

cuBLAS's block-scaled GEMM takes the same quantized values mpnb computes, in two layouts of
its own:

* **elements**: MXFP8 as the ``float8`` data itself; MXFP4 and NVFP4 as
  ``torch.float4_e2m1fn_x2``, two E2M1 codes per byte with the even element (index 0, 2, ...)
  in the low nibble. That is exactly :func:`mpnb.core.fp8.fp4.pack_e2m1`'s byte, so the packed
  ``uint8`` data is reinterpreted (:func:`as_float4_x2`), never repacked. The second operand is
  column-major: ``b.data`` is ``(N, K)`` row-major, so ``b.data.t()`` is the ``(K, N)`` view.
* **block scales** (:func:`to_blocked`): the ``(rows, K // block)`` scale matrix zero-padded to
  whole 128 x 4 tiles and flattened tile after tile (row tiles outer, column tiles inner);
  inside a tile, row ``r = 32 * i + j`` (``i`` in 0..3, ``j`` in 0..31) and column ``c`` go to
  offset ``16 * j + 4 * i + c`` (cuBLAS's "1D block scaling factors layout", 32 x 4 x 4).

NVFP4's float32 tensor level is not a cuBLAS operand here: the GEMM runs with a float32 output
and :func:`blocked_scaled_mm` multiplies it by ``(tensor_scale_a * tensor_scale_b) /
(tensor_divisor_a * tensor_divisor_b)`` once, then casts once, as the emulated
:func:`mpnb.core.fp8.fp4_gemm.fp4_mm` does (and as torchao applies its per-tensor scales after
the GEMM).

Whether this path is taken is decided in one place, :func:`mpnb.core.fp8.gemm.scaled_mm_blocker`
(capability, dtypes, shapes and a first-use check against the emulated GEMM).

Example::

    >>> s = torch.arange(8, dtype=torch.uint8).view(2, 4)
    >>> to_blocked(s).shape, from_blocked(to_blocked(s), 2, 4).equal(s)
    (torch.Size([512]), True)
"""

from __future__ import annotations

import torch

from mpnb.core.fp8.fp4_gemm import FP4Operand, fp4_mm
from mpnb.core.fp8.mxfp4 import quantize_mxfp4
from mpnb.core.fp8.nvfp4 import quantize_nvfp4
from mpnb.core.fp8.quantize import Float8Operand, quantize_mx

__all__ = [
    "NATIVE_MIN_CAPABILITY",
    "TILE_ROWS",
    "TILE_COLS",
    "native_dtypes_missing",
    "to_blocked",
    "from_blocked",
    "as_float4_x2",
    "blocked_scaled_mm",
    "CHECK_SHAPE",
    "check_tolerance",
    "first_use_check",
]

NATIVE_MIN_CAPABILITY = (10, 0)  #: cuBLAS's block-scaled GEMMs: Blackwell (sm100) and later
TILE_ROWS, TILE_COLS = 128, 4  #: one tile of the swizzled scale layout
_SUB = 32  # rows of one of the four interleaved sub-tiles


def native_dtypes_missing() -> list[str]:
    """The torch dtypes the native block-scaled GEMMs need that this torch lacks (``[]``: all
    there): ``float4_e2m1fn_x2`` (FP4 elements) and ``float8_e8m0fnu`` (MX scales)."""
    return [n for n in ("float4_e2m1fn_x2", "float8_e8m0fnu") if not hasattr(torch, n)]


def _tiles(rows: int, cols: int) -> tuple[int, int]:
    return -(-rows // TILE_ROWS), -(-cols // TILE_COLS)


def to_blocked(scales: torch.Tensor) -> torch.Tensor:
    """The 2-D block-scale matrix in cuBLAS's swizzled layout, flattened (same dtype).

    Args:
        scales: ``(rows, K // block)`` scales (any dtype; a float8 dtype is moved as bytes).

    Returns a 1-D tensor of ``ceil(rows / 128) * 128 * ceil(cols / 4) * 4`` elements: the padding
    holds zeros (the GEMM never reads it for real rows and columns).
    """
    if scales.ndim != 2:
        raise ValueError(
            f"to_blocked takes the 2-D (rows, K // block) scale matrix, got shape "
            f"{tuple(scales.shape)}; reshape it to one row per operand row first."
        )
    raw = scales.view(torch.uint8) if scales.element_size() == 1 else scales
    rows, cols = raw.shape
    rt, ct = _tiles(rows, cols)
    full = raw.new_zeros(rt * TILE_ROWS, ct * TILE_COLS)
    full[:rows, :cols] = raw
    # (row tile, i, j, column tile, c) -> (row tile, column tile, j, i, c)
    t = full.view(rt, TILE_ROWS // _SUB, _SUB, ct, TILE_COLS).permute(0, 3, 2, 1, 4)
    out = t.reshape(-1)
    return out.view(scales.dtype) if raw is not scales else out


def from_blocked(blocked: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """The ``(rows, cols)`` scale matrix back from :func:`to_blocked`'s flat tensor."""
    raw = blocked.view(torch.uint8) if blocked.element_size() == 1 else blocked
    rt, ct = _tiles(rows, cols)
    if raw.numel() != rt * ct * TILE_ROWS * TILE_COLS:
        raise ValueError(
            f"a swizzled scale tensor for {rows}x{cols} scales has "
            f"{rt * ct * TILE_ROWS * TILE_COLS} elements, this one {raw.numel()}; pass the "
            "rows and columns it was made from."
        )
    t = raw.reshape(rt, ct, _SUB, TILE_ROWS // _SUB, TILE_COLS).permute(0, 3, 2, 1, 4)
    out = t.reshape(rt * TILE_ROWS, ct * TILE_COLS)[:rows, :cols].contiguous()
    return out.view(blocked.dtype) if raw is not blocked else out


def as_float4_x2(packed: torch.Tensor) -> torch.Tensor:
    """:func:`~mpnb.core.fp8.fp4.pack_e2m1`'s ``uint8`` bytes viewed as
    ``torch.float4_e2m1fn_x2`` (the same bytes: the even element in the low nibble)."""
    if packed.dtype != torch.uint8:
        raise TypeError(
            f"as_float4_x2 views packed E2M1 bytes (uint8), got {packed.dtype}; pack the codes "
            "with mpnb.core.fp8.fp4.pack_e2m1 first."
        )
    return packed.view(torch.float4_e2m1fn_x2)


def blocked_scaled_mm(a, b, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` in ``torch._scaled_mm``'s block-scaled GEMM (cuBLAS, sm100+).

    Args:
        a, b: ``(M, K)`` and ``(N, K)`` operands of one format: two MX
            :class:`~mpnb.core.fp8.quantize.Float8Operand` (MXFP8) or two
            :class:`~mpnb.core.fp8.fp4_gemm.FP4Operand` (MXFP4, NVFP4).
        out_dtype: the result's dtype. MXFP8 writes it directly; the four-bit formats write
            float32, take the tensor level and cast once.

    Call it only where :func:`mpnb.core.fp8.gemm.scaled_mm_blocker` says None: nothing here
    checks the device.
    """
    if isinstance(a, FP4Operand):
        y = torch._scaled_mm(
            as_float4_x2(a.data),
            as_float4_x2(b.data).t(),
            to_blocked(a.block_scale),
            to_blocked(b.block_scale),
            out_dtype=torch.float32,
        )
        alpha = (a.tensor_scale * b.tensor_scale) / (a.tensor_divisor * b.tensor_divisor)
        return (alpha * y).to(out_dtype)
    if not isinstance(a, Float8Operand) or a.granularity != "mx":
        raise TypeError(
            "blocked_scaled_mm takes MX Float8Operands (quantize_mx) or FP4Operands; "
            "tensorwise and rowwise operands go to torch._scaled_mm through fp8_mm."
        )
    return torch._scaled_mm(
        a.data,
        b.data.t(),
        to_blocked(a.dequant_scale),
        to_blocked(b.dequant_scale),
        out_dtype=out_dtype,
    )


#: ``(M, N, K)`` of the first-use check: M pads the scales' rows to a second 128-row tile and
#: K // 16 = 14 and K // 32 = 7 pad their columns, so the padding of the layout is exercised
CHECK_SHAPE = (144, 160, 224)


def _check_data(rows: int, k: int, seed: int, device) -> torch.Tensor:
    """Random values whose 16-blocks span 2**-6 .. 2**6, so neighbouring blocks get their
    own scales (a scale read from the wrong block changes the product by a power of two)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen)
    e = torch.randint(-6, 7, (rows, k // 16), generator=gen).float()
    return (x * torch.exp2(e).repeat_interleave(16, dim=1)).to(device)


def _check_operands(fmt: str, dtypes, device):
    m, n, k = CHECK_SHAPE
    x, w = _check_data(m, k, 1, device), _check_data(n, k, 2, device)
    if fmt == "nvfp4":  # TE's two levels: the tensor scales reach the output's alpha
        return quantize_nvfp4(x), quantize_nvfp4(w, tile_rows=16)
    if fmt == "mxfp4":  # FLOOR with stochastic rounding: tensor_divisor 3/4 on both sides
        return (
            quantize_mxfp4(x, "floor", stochastic=True, generator=3),
            quantize_mxfp4(w, "floor", stochastic=True, generator=4),
        )
    return quantize_mx(x, dtypes[0]), quantize_mx(w, dtypes[1])


def check_tolerance(a, b, ref: torch.Tensor) -> torch.Tensor:
    """The largest difference allowed between a native block-scaled GEMM and the emulated one.

    Both sum the same exact products ``a_k * b_k`` (E2M1 or float8 values times power-of-two
    or E4M3 scales) in float32, in different orders. Any order of a K-term float32 sum is
    within ``(K - 1) * u * sum_k |a_k b_k|`` of the exact sum (``u = 2**-24``), so two orders
    differ by at most ``2 K u S = K * eps32 * S`` with ``S = |A| @ |B|^T``; the one rounding
    of each result to the output dtype adds ``eps_out * |ref|``, and ``K * tiny32`` covers
    products a GPU flushes to zero. A wrong layout (a scale of another block, one operand's
    nibbles read in the wrong order) misses by far more than this bound.
    """
    da, db = a.dequantize().double().abs(), b.dequantize().double().abs()
    k = da.shape[1]
    s = da @ db.t()
    f32 = torch.finfo(torch.float32)
    out = torch.finfo(ref.dtype)
    return k * f32.eps * s + out.eps * ref.double().abs() + k * f32.tiny


def first_use_check(device, fmt: str, dtypes=(), out_dtype=torch.float32) -> str | None:
    """Run one :data:`CHECK_SHAPE` GEMM of ``fmt`` natively and emulated on ``device``:
    None when they agree within :func:`check_tolerance`, else what went wrong (an error
    raised by ``torch._scaled_mm`` included).

    Args:
        device: the CUDA device to check.
        fmt: ``"mxfp8"``, ``"mxfp4"`` or ``"nvfp4"``.
        dtypes: MXFP8's element dtypes ``(a, b)`` (the four-bit formats: ignored).
        out_dtype: MXFP8's output dtype (the four-bit formats write float32).
    """
    try:
        with torch.no_grad():
            a, b = _check_operands(fmt, dtypes, device)
            if fmt == "mxfp8":
                ref = (a.dequantize() @ b.dequantize().t()).to(out_dtype)
            else:
                ref = fp4_mm(a, b, out_dtype)
            got = blocked_scaled_mm(a, b, out_dtype)
            if got.shape != ref.shape or got.dtype != ref.dtype:
                return (
                    f"it returned {got.dtype} {tuple(got.shape)}, the emulated GEMM "
                    f"{ref.dtype} {tuple(ref.shape)}"
                )
            err = (got.double() - ref.double()).abs()
            tol = check_tolerance(a, b, ref)
            bad = ~(err <= tol)  # a NaN in either result counts as wrong
            if bool(bad.any()):
                i = int(bad.flatten().nonzero()[0])
                r, c = divmod(i, ref.shape[1])
                return (
                    f"{int(bad.sum())} of {bad.numel()} outputs of a {CHECK_SHAPE} GEMM "
                    f"differ from the emulated GEMM beyond the float32 accumulation bound, "
                    f"e.g. [{r}, {c}]: {float(got[r, c])} vs {float(ref[r, c])} "
                    f"(allowed {float(tol[r, c]):.3g})"
                )
    except Exception as e:  # noqa: BLE001 - any failure keeps the format emulated, named
        return f"torch._scaled_mm raised {type(e).__name__}: {e}"
    return None
