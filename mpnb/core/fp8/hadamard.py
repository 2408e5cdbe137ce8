"""The randomized Hadamard transform (RHT) that spreads outliers before 4-bit quantization.

A Sylvester Hadamard matrix ``H_n`` (``H_1 = [1]``, ``H_2n = [[H, H], [H, -H]]``, so
``H[i, j] = (-1)**popcount(i & j)``) times a diagonal of signs ``D``, over ``sqrt(n)``, is
orthogonal: ``Q = D H / sqrt(n)`` has ``Q Q^T = I``. Applied blockwise along a GEMM's
contraction dim to *both* operands, ``(A Q)(B Q)^T = A B^T``: the product is unchanged while
each block's values are mixed, so one outlier no longer sets its block's scale alone.

* NVFP4 (TransformerEngine; the same in v2.13 and v2.14): ``n = 16``, ``D`` is the
  fixed sign vector :data:`TE_RHT_SIGNS` (TE's ``get_wgrad_sign_vector``), ``1/sqrt(16) = 1/4``;
  the matrix is built in bfloat16 (its entries ±0.25 are exact) and applied only to the
  Wgrad GEMM's operands, ``X^T`` and ``dY^T``, along the token dim; the global amax is taken
  after the transform.
* MXFP4 (Tseng et al. 2025, arXiv 2502.20586): the same construction on the backward GEMMs
  with random signs (:func:`random_signs`), any power-of-two size.

Example::

    >>> x_t, g_t = torch.randn(64, 32), torch.randn(48, 32)   # (features, tokens)
    >>> q = te_rht_matrix(torch.float64)
    >>> a, b = hadamard_transform(x_t, q), hadamard_transform(g_t, q)
    >>> torch.allclose(a @ b.T, x_t.double() @ g_t.double().T)   # the Wgrad is unchanged
    True
"""

from __future__ import annotations

import math

import torch

from mpnb.core.fp8.fp4 import check_float, make_generator

__all__ = [
    "TE_RHT_SIGNS",
    "TE_RHT_SIZE",
    "sylvester_hadamard",
    "hadamard_matrix",
    "te_rht_matrix",
    "random_signs",
    "hadamard_transform",
]

TE_RHT_SIZE = 16
# TransformerEngine's fixed RHT signs (transformer_engine/pytorch/custom_recipes/
# quantization_ref_nvfp4.py, get_wgrad_sign_vector; the same in its CUDA kernels).
TE_RHT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def _check_size(n: int) -> int:
    if not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(
            f"a Hadamard size must be a power of two (16 for NVFP4, 32 for MXFP4), got {n!r}."
        )
    return n


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The ``n x n`` Sylvester Hadamard matrix of ±1 (float32), ``n`` a power of two."""
    h = torch.ones(1, 1)
    while h.shape[0] < _check_size(n):
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_matrix(n: int = TE_RHT_SIZE, signs=None, dtype: torch.dtype = torch.bfloat16):
    """``diag(signs) @ H_n / sqrt(n)`` in ``dtype`` (built in float32, cast once).

    Args:
        n: the block size, a power of two.
        signs: ``n`` values of ±1 (a sequence or tensor); None means no sign flips.
        dtype: the matrix's dtype (bfloat16 by default, as TE's kernels; entries are exact
            in bfloat16 when ``n`` is a power of four).
    """
    h = sylvester_hadamard(n)
    if signs is not None:
        s = torch.as_tensor(signs, dtype=torch.float32).flatten()
        if s.numel() != n or not bool(((s == 1) | (s == -1)).all()):
            raise ValueError(
                f"signs must be {n} values of +1 or -1, got {s.numel()} values; build them "
                "with random_signs(n, generator) or pass TE_RHT_SIGNS for n=16."
            )
        h = s.view(-1, 1) * h
    return (h / math.sqrt(n)).to(dtype)


def te_rht_matrix(dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """TransformerEngine's NVFP4 RHT matrix: 16 x 16, :data:`TE_RHT_SIGNS`, over 4, bfloat16."""
    return hadamard_matrix(TE_RHT_SIZE, TE_RHT_SIGNS, dtype)


def random_signs(n: int, generator) -> torch.Tensor:
    """``n`` random ±1 (float32) from an int seed or CPU ``torch.Generator`` (reproducible)."""
    gen = make_generator(generator, torch.device("cpu"))
    bits = torch.randint(0, 2, (_check_size(n),), generator=gen)
    return (bits * 2 - 1).float()


def hadamard_transform(x: torch.Tensor, matrix: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` times ``matrix`` blockwise along its last dim, computed in ``matrix``'s dtype.

    Each run of ``n`` consecutive elements ``v`` (a row vector) becomes ``v @ matrix``; the
    result has ``x``'s shape and ``matrix``'s dtype (bfloat16 for TE's: the input is cast to
    bfloat16 first, the products are accumulated in float32 and rounded once, as a bfloat16
    GEMM does).

    Args:
        x: floating-point tensor whose last dim is a multiple of ``n``.
        matrix: an ``n x n`` matrix from :func:`hadamard_matrix`; None is :func:`te_rht_matrix`.
    """
    check_float(x)
    m = te_rht_matrix() if matrix is None else matrix.to(x.device)
    n = m.shape[0]
    if m.ndim != 2 or m.shape[1] != n:
        raise ValueError(f"matrix must be square, got shape {tuple(m.shape)}; use hadamard_matrix.")
    if x.ndim == 0 or x.shape[-1] % n:
        raise ValueError(
            f"the RHT runs on blocks of {n} along the last dim, which must be a multiple of {n}; "
            f"got shape {tuple(x.shape)}: pad the tokens (zeros change no product) first."
        )
    y = x.to(m.dtype).reshape(-1, n) @ m
    return y.reshape(x.shape)
