"""A four-bit GEMM operand (NVFP4 or MXFP4) and the emulated block-scaled GEMM ``a @ b.T``.

An :class:`FP4Operand` holds a 2-D tensor quantized along its last dim ``K`` (the GEMM's
contraction dim) in two levels:

* ``data``: the E2M1 codes packed two per byte, ``(rows, K // 2)`` uint8, the even element in
  the low nibble (:func:`mpnb.core.fp8.fp4.pack_e2m1`);
* ``block_scale``: one decode scale per ``block`` elements along ``K``, ``(rows, K // block)``:
  ``float8_e4m3fn`` for NVFP4 (blocks of 16), ``float8_e8m0fnu`` for MXFP4 (blocks of 32);
  with 16x16 (2-D) blocks each scale is repeated on the tile's 16 rows;
* the tensor level: every block's scale is multiplied by ``tensor_scale / tensor_divisor``
  (TransformerEngine's NVFP4: its global amax over ``448 * 6``; torchao's NVFP4: its
  ``per_tensor_scale`` over 1; MXFP4: 1, or ``1 / (3/4)`` after the stochastic-rounding
  prescale).

:func:`fp4_mm` computes ``a @ b.T`` as TransformerEngine's reference ``qgemm`` does (and the
FP4 tensor cores): for each ``block``-wide slice of ``K``, the exact product of the E2M1 values
(float32; products of E2M1 values and their 16- or 32-term sums are exact) times the outer
product of the two block scales, accumulated in float32 slice after slice; then one multiply
by ``(tensor_scale_a * tensor_scale_b) / (tensor_divisor_a * tensor_divisor_b)`` and one cast.
On a GPU without FP4 tensor cores and on every CPU this is the only path (emulated).

Example::

    >>> a = quantize_nvfp4(x)                  # (M, K)
    >>> b = quantize_nvfp4(w, tile_rows=16)    # (N, K), 16x16 blocks
    >>> y = fp4_mm(a, b, torch.bfloat16)       # (M, N)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from mpnb.core.fp8.fp4 import e2m1_to_float, unpack_e2m1

__all__ = ["FP4Operand", "fp4_mm"]

_CHUNK_ELEMS = 1 << 24  #: float32 elements of one chunk of per-block products (64 MiB)


@dataclass(frozen=True)
class FP4Operand:
    """A 2-D tensor in a four-bit format, quantized along its last dim (see the module doc).

    ``label`` names the recipe that produced it (``"nvfp4 (TE v2.14)"``, ``"nvfp4 (torchao)"``,
    ``"mxfp4 (rceil)"``, ...) so that rows of a comparison say which numerics they show.
    """

    data: torch.Tensor
    block_scale: torch.Tensor
    tensor_scale: torch.Tensor
    tensor_divisor: float
    block: int
    label: str

    @property
    def shape(self) -> tuple[int, int]:
        """``(rows, K)`` of the high-precision tensor this operand stands for."""
        return self.data.shape[0], 2 * self.data.shape[1]

    def codes_as_float(self) -> torch.Tensor:
        """The E2M1 values, unscaled, as float32 ``(rows, K)``."""
        return e2m1_to_float(unpack_e2m1(self.data))

    def block_decode(self) -> torch.Tensor:
        """Each block's full decode factor, float32 ``(rows, K // block)``:
        ``block_scale * tensor_scale / tensor_divisor`` (NaN for a block with a NaN scale)."""
        return (self.block_scale.float() * self.tensor_scale) / self.tensor_divisor

    def dequantize(self) -> torch.Tensor:
        """The float32 values this operand stands for: each E2M1 value times its block's
        :meth:`block_decode`."""
        factor = self.block_decode().repeat_interleave(self.block, dim=1)
        return self.codes_as_float() * factor


def _check_pair(a: FP4Operand, b: FP4Operand) -> None:
    for name, op in (("a", a), ("b", b)):
        if not isinstance(op, FP4Operand):
            raise TypeError(
                f"fp4_mm's {name} must be an FP4Operand, got {type(op).__name__}; quantize it "
                "with quantize_nvfp4, quantize_nvfp4_torchao or quantize_mxfp4 first."
            )
    if a.block != b.block or a.block_scale.dtype != b.block_scale.dtype:
        raise ValueError(
            f"fp4_mm needs both operands in the same format, got {a.label!r} and {b.label!r}; "
            "quantize both with the same recipe."
        )
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"fp4_mm computes a @ b.T over K: a has K={a.shape[1]}, b has K={b.shape[1]}; "
            "quantize both along the contraction dim of the same GEMM."
        )


def fp4_mm(a: FP4Operand, b: FP4Operand, out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b.T`` for ``(M, K)`` and ``(N, K)`` four-bit operands, as TE's ``qgemm``.

    Args:
        a, b: operands of the same format, both quantized along ``K``.
        out_dtype: the result's dtype (the accumulation is float32 either way).
    """
    _check_pair(a, b)
    qa, qb = a.codes_as_float(), b.codes_as_float()
    sa, sb = a.block_scale.float(), b.block_scale.float()
    (m, k), nrows, n = a.shape, b.shape[0], a.block
    blocks = k // n
    # Every block's partial product at once (exact: products of E2M1 values and their 16- or
    # 32-term sums are float32 numbers), times its outer product of scales; then the float32
    # sum over the blocks in order, one add each, as the tensor cores (and TE's reference)
    # accumulate: a single matmul over K would round differently. In chunks of blocks, so
    # the (blocks, M, N) products stay under _CHUNK_ELEMS.
    qa3 = qa.view(m, blocks, n).transpose(0, 1)  # (blocks, M, n)
    qb3 = qb.view(nrows, blocks, n).permute(1, 2, 0)  # (blocks, n, N)
    y = torch.zeros(m, nrows, dtype=torch.float32, device=qa.device)
    step = max(1, _CHUNK_ELEMS // max(1, m * nrows))
    for lo in range(0, blocks, step):
        hi = min(blocks, lo + step)
        parts = torch.bmm(qa3[lo:hi], qb3[lo:hi])
        parts *= sa.t()[lo:hi, :, None] * sb.t()[lo:hi, None, :]
        for p in parts:
            y += p
    alpha = (a.tensor_scale * b.tensor_scale) / (a.tensor_divisor * b.tensor_divisor)
    return (alpha * y).to(out_dtype)
