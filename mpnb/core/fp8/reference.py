"""Plain-PyTorch references of every recipe's quantize/dequantize math and of the FP8 linear.

Written a second way on purpose (Python loops over rows and blocks, ``torch.frexp`` for the
power-of-two exponents, a float64 comparison for the MX rounding up, Python lists for the amax
history) so that the tests can compare the fast path's
bytes with these. ``reference_float8_linear`` multiplies the dequantized operands in float64:
the exact product of what the FP8 GEMM receives, which the fast path must match up to its
float32 accumulation.
"""

from __future__ import annotations

import math

import torch

from mpnb.core.fp8.formats import AMAX_EPS, E8M0, MX_ELEMENT_EMAX, fp8_max
from mpnb.core.fp8.quantize import check_mx_rounding

__all__ = [
    "reference_scale",
    "reference_quantize",
    "reference_quantize_tensorwise",
    "reference_quantize_rowwise",
    "reference_quantize_mx",
    "reference_dequantize",
    "reference_delayed_scales",
    "reference_float8_linear",
]


def reference_scale(amax: float, dtype: torch.dtype, power_of_2: bool = False) -> torch.Tensor:
    """``fp8_max / max(amax, 1e-12)`` computed in float32 (0-d tensor), optionally 2**floor."""
    a = torch.tensor(max(float(amax), AMAX_EPS), dtype=torch.float32)
    s = torch.tensor(fp8_max(dtype), dtype=torch.float32) / a
    if power_of_2 and torch.isfinite(s):
        _, exp = torch.frexp(s)  # s = m * 2**exp with m in [0.5, 1)
        s = torch.ldexp(torch.tensor(1.0), exp - 1)
    return s


def _saturate_cast(v: torch.Tensor, dtype: torch.dtype, x: torch.Tensor) -> torch.Tensor:
    """``v`` (the scaled ``x``) clamped to the format's range and cast; an inf in ``x`` is NaN."""
    m = fp8_max(dtype)
    out = torch.clamp(v, -m, m)
    out[torch.isinf(x)] = float("nan")
    return out.to(dtype)


def reference_quantize_tensorwise(x, dtype, scale=None, power_of_2=False):
    """``(q, dequant_scale)`` of per-tensor scaling; ``scale`` given (delayed) or from ``x``."""
    if scale is None:
        scale = reference_scale(x.abs().max().item(), dtype, power_of_2)
    scale = torch.as_tensor(scale, dtype=torch.float32)
    return _saturate_cast(x.float() * scale, dtype, x), 1.0 / scale


def reference_quantize_rowwise(x, dtype, power_of_2=True):
    """``(q, dequant_scales (rows, 1))``: each row scaled by its own amax."""
    qs, inv = [], []
    for row in x.float():
        s = reference_scale(row.abs().max().item(), dtype, power_of_2)
        qs.append(_saturate_cast(row * s, dtype, row))
        inv.append(1.0 / s)
    return torch.stack(qs), torch.stack(inv).view(-1, 1)


def _mx_block(block: torch.Tensor, dtype: torch.dtype, rounding: str):
    amax = block.abs().max()
    if not torch.isfinite(amax):
        return torch.full_like(block, float("nan")).to(dtype), 255
    _, exp = torch.frexp(amax.double())  # amax = m * 2**exp, m in [0.5, 1): floor(log2) = exp-1
    shared = int(exp) - 1 - MX_ELEMENT_EMAX[dtype] if amax > 0 else -127
    # rceil: the smallest power of two under which the block's amax does not clip
    if rounding == "rceil" and amax > 0 and float(amax) > fp8_max(dtype) * 2.0**shared:
        shared += 1
    shared = max(-127, min(127, shared))
    q = _saturate_cast(block.double() * 2.0 ** (-shared), dtype, block)
    return q, shared + 127


def reference_quantize_mx(x, dtype, block_size=32, rounding="rceil"):
    """``(q, e8m0 scales (rows, ceil(K/32)))`` of MXFP8.

    ``rounding="rceil"``: each block's scale is the smallest power of two ``X`` with
    ``amax / X <= fp8_max``; ``"floor"``: ``2**(floor(log2(amax)) - emax)`` (OCP MX v1.0).
    """
    check_mx_rounding(rounding)
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=dtype)
    codes = torch.empty(rows, -(-k // block_size), dtype=torch.uint8)
    for r in range(rows):
        for j, start in enumerate(range(0, k, block_size)):
            qb, code = _mx_block(x[r, start : start + block_size].float(), dtype, rounding)
            q[r, start : start + block_size] = qb
            codes[r, j] = code
    return q, codes.view(E8M0)


def reference_quantize(x, dtype, granularity, power_of_2=False, scale=None, mx_rounding="rceil"):
    """Dispatch to the tensorwise / rowwise / mx reference by ``granularity``."""
    if granularity == "tensorwise":
        return reference_quantize_tensorwise(x, dtype, scale, power_of_2)
    if granularity == "rowwise":
        return reference_quantize_rowwise(x, dtype, power_of_2)
    if granularity == "mx":
        return reference_quantize_mx(x, dtype, rounding=mx_rounding)
    raise ValueError(f"unknown granularity {granularity!r}; use tensorwise, rowwise or mx.")


def reference_dequantize(q, dequant_scale, granularity, block_size=32) -> torch.Tensor:
    """float64 values of ``q`` scaled back: ``q * s`` per tensor/row, ``q * 2**e`` per block."""
    v = q.double()
    if granularity != "mx":
        return v * dequant_scale.double()
    out = torch.empty_like(v)
    for j, start in enumerate(range(0, v.shape[1], block_size)):
        blk = dequant_scale[:, j : j + 1].view(torch.uint8).double()
        factor = torch.where(blk == 255, float("nan"), torch.exp2(blk - 127))
        out[:, start : start + block_size] = v[:, start : start + block_size] * factor
    return out


def reference_delayed_scales(amaxes, dtype, history_len=1024, algo="max", margin=0):
    """Scales delayed scaling uses at each step, given each step's amax (a Python list).

    Step ``t`` quantizes with the scale computed after step ``t-1`` (1.0 at the start) from
    the last ``history_len`` recorded amaxes. An inf/NaN amax is not recorded (the step
    overflowed: the loss scaler skips it) and keeps the scale; a reduced amax of 0 keeps it
    too; a scale past float32's range is clamped to its largest finite value.
    """
    history, scale, used = [], 1.0, []
    big = torch.finfo(torch.float32).max
    for a in amaxes:
        used.append(scale)
        if not math.isfinite(float(a)):
            continue
        history = ([float(a)] + history)[:history_len]
        amax = max(history) if algo == "max" else history[0]
        if amax > 0.0:
            s = torch.tensor(fp8_max(dtype), dtype=torch.float32) / torch.tensor(amax)
            scale = min(float(s / 2.0**margin), big)
    return used


def _quantize_for(x, dtype, granularity, power_of_2, scale, mx_rounding="rceil"):
    q, s = reference_quantize(x, dtype, granularity, power_of_2, scale, mx_rounding)
    return reference_dequantize(q, s, granularity)


def reference_float8_linear(
    x,
    weight,
    bias,
    grad_output,
    dtypes,
    granularity,
    power_of_2=False,
    scales=None,
    mx_rounding="rceil",
):
    """``(y, grad_x, grad_w, grad_b)`` in float64 from the dequantized FP8 operands.

    Args:
        x: ``(M, K)`` input; weight: ``(N, K)``; bias: ``(N,)`` or None.
        grad_output: ``(M, N)`` incoming gradient.
        dtypes: ``(forward dtype, gradient dtype)``.
        granularity: ``"tensorwise"``, ``"rowwise"`` or ``"mx"``; each GEMM's operands are
            quantized along that GEMM's contraction dim.
        scales: per-tensor only, ``(s_x, s_w, s_grad)`` quantization scales (delayed
            scaling); None computes them from the tensors (current scaling).
        mx_rounding: the MX scales' rounding (``"rceil"`` or ``"floor"``).
    """
    fwd, bwd = dtypes
    sx, sw, sg = scales if scales is not None else (None, None, None)
    q = lambda t, d, s: _quantize_for(t, d, granularity, power_of_2, s, mx_rounding)  # noqa: E731
    per_tensor = granularity == "tensorwise"
    y = q(x, fwd, sx) @ q(weight, fwd, sw).T
    if bias is not None:
        y = y + bias.double()
    g_rows = q(grad_output, bwd, sg)
    w_cols = q(weight, fwd, sw) if per_tensor else q(weight.T.contiguous(), fwd, None).T
    grad_x = g_rows @ w_cols
    g_cols = g_rows if per_tensor else q(grad_output.T.contiguous(), bwd, None).T
    x_cols = q(x, fwd, sx) if per_tensor else q(x.T.contiguous(), fwd, None).T
    grad_w = g_cols.T @ x_cols
    grad_b = grad_output.double().sum(0) if bias is not None else None
    return y, grad_x, grad_w, grad_b
