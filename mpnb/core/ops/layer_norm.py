"""``mpnb::layer_norm_fwd`` and ``mpnb::layer_norm_bwd``: Apex's fused layer norm.

* :func:`layer_norm_fwd` returns ``(output, mean, invvar)``;
* :func:`layer_norm_bwd` returns ``(grad_input, grad_weight, grad_bias)``.

The input is normalized over its trailing ``normalized_shape`` dims; ``mean``/``invvar`` hold
one fp32 value per row (fp64 for fp64 input). Weights may have the input's dtype or be fp32
with a half input (Apex's mixed layers); the output has the input's dtype. ``saved`` is the
input, or the output when ``memory_efficient`` (the backward recomputes ``xhat = (y - b) / w``,
as Apex does: weights must not be zero). The forward is differentiable through its
registered autograd formula (the backward op); missing weight/bias gradients are empty
tensors from the backward op and ``None`` through autograd.

``torch_stats`` (set by :mod:`mpnb.normalization` inside an autocast region) rounds an fp16
layer's ``mean``/``invvar`` to fp16 on the CPU, as PyTorch's CPU ``native_layer_norm`` saves
them, so the backward rounds as PyTorch's fp16 layer norm does there (its CUDA kernel keeps
fp32, and so does mpnb on CUDA). The statistics stay fp32 tensors; the forward's output is
written from the unrounded ones, as PyTorch's is.

Kernels: ``csrc/cpu/layer_norm.cpp`` (CPU); PyTorch's ``native_layer_norm`` (and its backward
from the input) on CUDA for fp32/fp64 data with parameters of its dtype, else the reference.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mpnb.core.ops import _norm
from mpnb.core.ops._checks import acc_dtype
from mpnb.core.ops._library import Sample, Tensor, call, define

__all__ = [
    "layer_norm_fwd",
    "layer_norm_bwd",
    "reference_layer_norm_fwd",
    "reference_layer_norm_bwd",
]


def reference_layer_norm_fwd(
    input: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    memory_efficient: bool = False,
    torch_stats: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Layer norm over the trailing ``normalized_shape`` dims; returns ``(y, mean, invvar)``.

    Differentiable in ``input``, ``weight`` and ``bias`` (the backward is
    :func:`layer_norm_bwd`). The reference computes the statistics in fp32 (fp64 for fp64),
    in two passes, and the output from them, rounded once to the input's dtype.

    Args:
        input: the tensor to normalize (fp32, fp16, bf16 or fp64).
        normalized_shape: its trailing dims to normalize over (a list of ints).
        weight, bias: optional affine parameters of shape ``normalized_shape``, in the input's
            dtype or fp32 (with a half input).
        eps: added to the variance.
        memory_efficient: save the output instead of the input for the backward.
        torch_stats: return (and so save for the backward) the statistics PyTorch's own
            layer norm of these tensors saves on this device: rounded to fp16 for an fp16
            input on the CPU with fp16 parameters or none, unchanged elsewhere (see
            :func:`mpnb.core.ops._norm.saves_half_stats`). The output is the same either way.
            :mod:`mpnb.normalization` sets it inside a ``torch.autocast`` region.

    Example::

        >>> y, mean, invvar = layer_norm_fwd(torch.randn(4, 8), [8], torch.ones(8), torch.zeros(8))
    """
    rows, cols = _norm.rows_cols(input, normalized_shape)
    acc = acc_dtype(input)
    x = input.reshape(rows, cols).to(acc)
    mean = x.mean(dim=1)
    xc = x - mean[:, None]
    invvar = torch.rsqrt((xc * xc).mean(dim=1) + eps)
    y = xc * invvar[:, None]
    if weight is not None:
        y = y * weight.reshape(cols).to(acc)
    if bias is not None:
        y = y + bias.reshape(cols).to(acc)
    if torch_stats and _norm.saves_half_stats(input, weight, bias):
        mean, invvar = _norm.round_half_stats(mean, invvar)
    return y.to(input.dtype).reshape(input.shape), mean, invvar


def reference_layer_norm_bwd(
    grad_out: Tensor,
    saved: Tensor,
    mean: Tensor,
    invvar: Tensor,
    normalized_shape: Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    memory_efficient: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of :func:`layer_norm_fwd`: ``(grad_input, grad_weight, grad_bias)`` (the
    textbook formula in fp32; a missing weight or bias gets an empty gradient).

    Args:
        grad_out: the gradient of the forward's output.
        saved: the forward's input, or its output when ``memory_efficient``.
        mean, invvar: the statistics the forward returned.
        normalized_shape, weight, bias: as given to the forward.
        memory_efficient: ``saved`` is the output (``xhat`` recomputed as ``(y - b) / w``).

    Example::

        >>> x, w, b = torch.randn(4, 8), torch.ones(8), torch.zeros(8)
        >>> y, mean, invvar = layer_norm_fwd(x, [8], w, b)
        >>> dx, dw, db = layer_norm_bwd(torch.ones_like(y), x, mean, invvar, [8], w, b)
    """
    rows, cols = _norm.rows_cols(saved, normalized_shape)
    return _norm.backward(grad_out, saved, mean, invvar, rows, cols, weight, bias, memory_efficient)


def _native(x, *params) -> bool:
    # PyTorch's native layer norm returns its statistics in the input's dtype on the CPU and
    # in the accumulation dtype on CUDA; for fp32/fp64 data with parameters of the same dtype
    # both are ours, so only those take it (half data stays on the reference until the CUDA
    # statistics' dtype is checked on a GPU).
    return x.dtype in (torch.float32, torch.float64) and all(
        p is None or p.dtype == x.dtype for p in params
    )


def _torch_layer_norm_fwd(args):
    """PyTorch's fused layer norm for fp32/fp64 (see ``_native``); the reference otherwise."""
    x, weight, bias = args.input, args.weight, args.bias
    if not _native(x, weight, bias):
        return call(reference_layer_norm_fwd, args)
    y, mean, invvar = torch.native_layer_norm(x, args.normalized_shape, weight, bias, args.eps)
    return y, mean.reshape(-1), invvar.reshape(-1)


def _torch_layer_norm_bwd(args):
    """PyTorch's fused layer-norm backward from the input (not memory-efficient) for fp32/fp64
    (see ``_native``); the reference otherwise."""
    saved, weight, bias = args.saved, args.weight, args.bias
    if args.memory_efficient or not _native(saved, weight, bias):
        return call(reference_layer_norm_bwd, args)
    k = len(args.normalized_shape)
    stats = (*saved.shape[: saved.dim() - k], *([1] * k))
    mask = [True, weight is not None, bias is not None]
    dx, dw, db = torch.ops.aten.native_layer_norm_backward(
        args.grad_out,
        saved,
        args.normalized_shape,
        args.mean.view(stats),
        args.invvar.view(stats),
        weight,
        bias,
        mask,
    )
    empty = saved.new_empty(0)
    return dx, dw if weight is not None else empty, db if bias is not None else empty


def _fake_fwd(args):
    x = args.input
    rows, _ = _norm.rows_cols(x, args.normalized_shape)
    acc = acc_dtype(x)
    return _norm.fake_like(x), x.new_empty(rows, dtype=acc), x.new_empty(rows, dtype=acc)


def _fake_bwd(args):
    saved = args.saved
    grads = _norm.fake_grad(args.weight, saved), _norm.fake_grad(args.bias, saved)
    return _norm.fake_like(saved), *grads


def _setup_context(ctx, args, output):
    y, mean, invvar = output
    ctx.shape, ctx.memory_efficient = args.normalized_shape, args.memory_efficient
    saved = y if args.memory_efficient else args.input
    ctx.save_for_backward(saved, mean, invvar, args.weight, args.bias)
    ctx.mark_non_differentiable(mean, invvar)


def _backward(ctx, grad_y, _grad_mean, _grad_invvar):
    saved, mean, invvar, w, b = ctx.saved_tensors
    dx, dw, db = _bwd(grad_y, saved, mean, invvar, ctx.shape, w, b, ctx.memory_efficient)
    return {"input": dx, "weight": None if w is None else dw, "bias": None if b is None else db}


def _fwd_sample(dtype: torch.dtype, case: dict, torch_stats: bool = False) -> Sample:
    x, w, b, _dy, nshape = _norm.sample_tensors(dtype, case)
    kw = dict(input=x, normalized_shape=nshape, weight=w, bias=b, eps=1e-5)
    kw |= dict(memory_efficient=case.get("me", False), torch_stats=torch_stats)
    return Sample(kw, name=_norm.sample_name(case) + (" torch_stats" if torch_stats else ""))


def _samples_fwd(dtype: torch.dtype):
    for case in _norm.sample_cases(dtype):
        yield _fwd_sample(dtype, case)
    # torch_stats: fp16 statistics for an fp16 input with fp16 or no parameters, and no change
    # for the mixed layers and the other dtypes
    cases = [
        dict(rows=16, cols=512),
        dict(rows=16, cols=512, affine=""),
        dict(rows=9, cols=1000, me=True),
    ]
    if dtype in (torch.float16, torch.bfloat16):
        cases.append(dict(rows=5, cols=33, wdtype=torch.float32))
    for case in cases:
        yield _fwd_sample(dtype, case, torch_stats=True)


def _samples_bwd(dtype: torch.dtype):
    return _norm.backward_samples(dtype, reference_layer_norm_fwd, rms=False)


FWD = define(
    reference_layer_norm_fwd,
    family="layer_norm",
    check=_norm.check_forward,
    fake=_fake_fwd,
    cuda=_torch_layer_norm_fwd,
    triton="layer_norm",
    autograd=(_backward, _setup_context),
    sample_inputs=_samples_fwd,
    tolerance=_norm.TOLERANCE,
)
layer_norm_fwd = FWD.wrapper

BWD = define(
    reference_layer_norm_bwd,
    family="layer_norm",
    check=_norm.check_backward,
    fake=_fake_bwd,
    cuda=_torch_layer_norm_bwd,
    triton="layer_norm",
    sample_inputs=_samples_bwd,
    tolerance=_norm.TOLERANCE,
)
layer_norm_bwd = BWD.wrapper
_bwd = BWD.overload  # the autograd formula calls the op itself (its inputs are checked)
