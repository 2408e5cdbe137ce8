"""The fused scaled (masked) softmax ops of Apex's ``FusedScaleMaskSoftmax``.

Softmax over the last dim, computed in fp32 for half input (fp64 for fp64), output in the
input's dtype:

* :func:`scaled_softmax_fwd`: ``softmax(input * scale)``.
* :func:`scaled_masked_softmax_fwd`: input ``[b, np, sq, sk]``, mask
  ``[b or 1, np or 1, sq, sk]`` (bool or uint8, true = masked):
  masked scores become -10000 after scaling, as in Apex/Megatron (a fully masked row is
  uniform, not NaN). As in Apex, the backward does not read the mask: a fully masked row
  passes its gradient through. ``zero_all_masked=True`` is Apex's *generic* kernel: a fully
  masked row attends to nothing (all zeros, and so a zero gradient).
* :func:`scaled_upper_triang_masked_softmax_fwd`: causal, ``[..., sq, sk]`` with
  ``sq == sk``; row ``i`` keeps columns ``0..i`` and is exactly zero after them.
* :func:`scaled_softmax_bwd`: the one backward, ``scale * y * (dy - sum(dy * y))``; the
  forwards are differentiable through it.

Kernels: ``csrc/cpu/softmax.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, check_float
from mpnb.core.ops._library import Sample, Tensor, define

__all__ = [
    "MASKED_VALUE",
    "scaled_softmax_fwd",
    "scaled_masked_softmax_fwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "generic_scaled_masked_softmax_fwd",
    "scaled_softmax_bwd",
    "reference_scaled_softmax_fwd",
    "reference_scaled_masked_softmax_fwd",
    "reference_scaled_upper_triang_masked_softmax_fwd",
    "reference_scaled_softmax_bwd",
]

#: The score a masked position gets after scaling (Apex's and Megatron's -10000).
MASKED_VALUE = -10000.0


# ---- checks ---------------------------------------------------------------------------------


def _check_scores(op: str, x: Tensor, min_dim: int, what: str = "input") -> None:
    check_float(op, x, what)
    if x.dim() < min_dim:
        raise ValueError(
            f"{op}: {what} must have at least {min_dim} dims, got shape {tuple(x.shape)}; the "
            "softmax runs over the last dim."
        )


def _check_fwd(args, per_tensor: bool) -> None:
    _check_scores(args.op_name, args.input, 1)


def _check_masked(args, per_tensor: bool) -> None:
    op, x, mask = args.op_name, args.input, args.mask
    _check_scores(op, x, 1)
    if x.dim() != 4:
        raise ValueError(
            f"{op}: input must be [b, np, sq, sk] scores, got shape {tuple(x.shape)}; "
            "reshape the scores to four dims."
        )
    if mask.dtype not in (torch.bool, torch.uint8):
        raise TypeError(
            f"{op}: mask is {mask.dtype}; pass a bool (or uint8) mask where True means "
            "'masked out'."
        )
    b, h, sq, sk = x.shape
    ok = (
        mask.dim() == 4
        and mask.shape[0] in (1, b)
        and mask.shape[1] in (1, h)
        and tuple(mask.shape[2:]) == (sq, sk)
    )
    if not ok:
        raise ValueError(
            f"{op}: mask of shape {tuple(mask.shape)} does not fit scores of shape "
            f"{tuple(x.shape)}; Apex masks are [b or 1, np or 1, sq, sk] "
            f"(here [{b} or 1, {h} or 1, {sq}, {sk}])."
        )
    if mask.device != x.device:
        raise ValueError(
            f"{op}: mask is on {mask.device} but the scores are on {x.device}; move both "
            "to one device."
        )


def _check_causal(args, per_tensor: bool) -> None:
    op, x = args.op_name, args.input
    _check_scores(op, x, 2)
    if x.shape[-1] != x.shape[-2]:
        raise ValueError(
            f"{op}: the causal softmax needs square [..., sq, sk] scores with sq == sk, got "
            f"shape {tuple(x.shape)}; use the masked softmax for other shapes."
        )


def _check_bwd(args, per_tensor: bool) -> None:
    op, grad_out, output = args.op_name, args.grad_out, args.output
    _check_scores(op, output, 2 if args.upper_triang else 1, "output")
    if grad_out.shape != output.shape or grad_out.dtype != output.dtype:
        raise ValueError(
            f"{op}: grad_out {tuple(grad_out.shape)} {grad_out.dtype} does not match the "
            f"softmax output {tuple(output.shape)} {output.dtype}; pass the gradient of that "
            "output."
        )
    if grad_out.device != output.device:
        raise ValueError(
            f"{op}: grad_out is on {grad_out.device} but the output is on {output.device}; "
            "pass the gradient of that output."
        )


# ---- references -----------------------------------------------------------------------------


def reference_scaled_softmax_fwd(input: Tensor, scale: float = 1.0) -> Tensor:
    """Softmax of ``input * scale`` over the last dim (differentiable), computed in fp32
    (fp64 for fp64).

    Example::

        >>> scaled_softmax_fwd(torch.zeros(2, 4), 0.5)[0]
        tensor([0.2500, 0.2500, 0.2500, 0.2500])
    """
    return torch.softmax(input.to(acc_dtype(input)) * scale, -1).to(input.dtype)


def reference_scaled_masked_softmax_fwd(
    input: Tensor, mask: Tensor, scale: float = 1.0, zero_all_masked: bool = False
) -> Tensor:
    """Masked softmax of ``[b, np, sq, sk]`` scores (differentiable in ``input``):
    ``softmax(masked_fill(input * scale, mask, -10000), -1)`` in fp32.

    Args:
        input: the scores ``[b, np, sq, sk]``.
        mask: ``[b or 1, np or 1, sq, sk]``, bool or uint8, True where masked out.
        scale: multiplies the scores first.
        zero_all_masked: a fully masked row is all zeros (Apex's generic kernel:
            :func:`generic_scaled_masked_softmax_fwd`), not uniform.

    Example::

        >>> x = torch.randn(2, 4, 8, 8)
        >>> pad = torch.zeros(2, 1, 8, 8, dtype=torch.bool); pad[..., 6:] = True
        >>> scaled_masked_softmax_fwd(x, pad, 0.125)[..., 6:].abs().max() < 1e-3
        tensor(True)
    """
    x = input.to(acc_dtype(input)) * scale
    m = mask.bool()
    # Value: -10000 where masked, whatever the score there (inf and NaN included, as the
    # kernel). Gradient, when this reference is differentiated directly: straight through, as
    # Apex's kernel (its backward does not see the mask; it differs from masked_fill's only in
    # fully masked rows). The straight-through term is built from the finite scores only:
    # x - x.detach() would be inf - inf = NaN at a masked inf.
    finite = torch.nan_to_num(x, nan=0.0, posinf=0.0, neginf=0.0)
    x = torch.where(m, torch.full_like(x, MASKED_VALUE), x) + (finite - finite.detach()) * m
    y = torch.softmax(x, -1)
    if zero_all_masked:  # Apex's generic kernel: a row that sees nothing attends to nothing
        y = torch.where(m.all(-1, keepdim=True), torch.zeros_like(y), y)
    return y.to(input.dtype)


def reference_scaled_upper_triang_masked_softmax_fwd(input: Tensor, scale: float = 1.0) -> Tensor:
    """Causal softmax of ``[..., sq, sq]`` scores without a mask tensor (differentiable):
    column ``j > i`` of row ``i`` is excluded (its probability is 0).

    Example::

        >>> y = scaled_upper_triang_masked_softmax_fwd(torch.zeros(1, 3, 3))
        >>> y[0, 1]
        tensor([0.5000, 0.5000, 0.0000])
    """
    sq, sk = input.shape[-2:]
    future = torch.ones(sq, sk, dtype=torch.bool, device=input.device).triu(1)
    x = (input.to(acc_dtype(input)) * scale).masked_fill(future, float("-inf"))
    return torch.softmax(x, -1).to(input.dtype)


def reference_scaled_softmax_bwd(
    grad_out: Tensor, output: Tensor, scale: float = 1.0, upper_triang: bool = False
) -> Tensor:
    """Gradient of any of the softmax forwards from its output ``y`` and ``grad_out``:
    ``scale * y * (dy - sum(dy * y, -1))`` in fp32.

    Args:
        grad_out: the gradient of the forward's output.
        output: the forward's output ``y``.
        scale: the forward's scale.
        upper_triang: the forward was the causal one (the masked-out upper triangle of the
            gradient is exactly zero).

    Example::

        >>> y = scaled_softmax_fwd(torch.randn(2, 4), 0.5)
        >>> dx = scaled_softmax_bwd(torch.ones_like(y), y, 0.5)   # zeros: softmax sums to 1
    """
    acc = acc_dtype(output)
    y, dy = output.to(acc), grad_out.to(acc)
    return (scale * y * (dy - (dy * y).sum(-1, keepdim=True))).to(output.dtype)


# ---- fakes and autograd ---------------------------------------------------------------------


def _fake_fwd(args):
    return torch.empty_like(args.input, memory_format=torch.contiguous_format)


def _fake_bwd(args):
    return torch.empty_like(args.output, memory_format=torch.contiguous_format)


def _setup_context(ctx, args, output):
    ctx.scale = args.scale
    ctx.save_for_backward(output)


def _autograd(upper_triang: bool):
    def backward(ctx, grad_y):
        (y,) = ctx.saved_tensors
        return {"input": _bwd(grad_y, y, ctx.scale, upper_triang)}

    return backward, _setup_context


# ---- samples --------------------------------------------------------------------------------


def _scores(shape, dtype, seed, grad=False):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    return x.requires_grad_(True) if grad else x


def _fwd(x, scale, name):
    return Sample(dict(input=x, scale=scale), name=name)


def _samples_fwd(dtype):
    yield _fwd(_scores((2, 3, 4, 20), dtype, 0, grad=True), 0.5, "opcheck")
    for sk in (1, 3, 1000, 4097):
        yield _fwd(_scores((2, 3, 4, sk), dtype, sk), 0.3, f"sk={sk}")
    yield _fwd(_scores((5, 37), dtype, 1), -0.7, "2-d, negative scale")
    yield _fwd(_scores((0, 8), dtype, 2), 1.0, "no rows")
    yield _fwd(_scores((3, 0), dtype, 3), 1.0, "empty rows")
    x = _scores((3, 40), dtype, 4)
    x[0, 5], x[1, 7], x[2, 9] = float("nan"), float("inf"), float("-inf")
    yield _fwd(x, 0.5, "nan, inf, -inf")


def _mask(shape, seed, p=0.4, dtype=torch.bool):
    g = torch.Generator().manual_seed(seed)
    m = torch.rand(shape, generator=g) < p
    return m.to(dtype)


def _masked(x, m, scale, name, zero_all_masked=False):
    kw = dict(input=x, mask=m, scale=scale, zero_all_masked=zero_all_masked)
    return Sample(kw, name=name)


def _samples_masked(dtype):
    x = _scores((2, 3, 4, 20), dtype, 0, grad=True)
    m = _mask((2, 1, 4, 20), 0)
    m[..., 0] = False  # no fully masked row: opcheck's gradient checks see a plain softmax
    yield _masked(x, m, 0.5, "opcheck")
    for sk in (1, 3, 1000, 4097):
        for mshape in ((2, 1, 5, sk), (1, 1, 5, sk), (2, 3, 5, sk), (1, 3, 5, sk)):
            mdtype = torch.uint8 if sk % 2 else torch.bool
            m = _mask(mshape, sk, dtype=mdtype)
            m[0, 0, 1] = True  # a fully masked row: uniform, as Apex
            yield _masked(_scores((2, 3, 5, sk), dtype, sk), m, 0.5, f"sk={sk} {mshape}")
    # Masked scores far above the unmasked ones (the kernel shifts by the unmasked bound first,
    # then by the exact masked max), negative scales, a fully masked row.
    x = _scores((2, 2, 4, 70), torch.float64, 5)
    m = torch.zeros(1, 1, 4, 70, dtype=torch.bool)
    m[..., 10:], m[..., 2, :] = True, True
    x[..., 10:] += 500.0
    x[..., 1, :10] -= 5000.0
    for scale in (0.5, -0.5):
        xs = (x if scale > 0 else -x).to(dtype)
        yield _masked(xs, m, scale, f"masked far above, scale={scale}")
    x = _scores((2, 3, 4, 33), dtype, 8)
    m = _mask((2, 1, 4, 33), 8)
    m[..., :3], m[..., 3:5] = True, False
    x[..., 0], x[..., 1], x[..., 2] = float("inf"), float("-inf"), float("nan")
    yield _masked(x, m, 0.5, "inf, -inf, NaN at masked positions")
    x = _scores((2, 5, 3, 40), dtype, 6).transpose(1, 2)  # [2, 3, 5, 40] strided
    yield _masked(x, _mask((2, 1, 5, 40), 6), 0.2, "strided scores")
    yield _masked(_scores((0, 3, 4, 5), dtype, 7), _mask((1, 1, 4, 5), 7), 1.0, "empty")
    # Apex's generic kernel: fully masked rows are zero (also far below and above -10000)
    for sk in (1, 5, 40, 1000):
        x = _scores((2, 3, 5, sk), dtype, 20 + sk)
        m = _mask((2, 1, 5, sk), 20 + sk)
        m[0, 0, 1], m[1, 0, 3], m[1, 0, 4] = True, True, False
        x[0, :, 2] -= 30000.0
        yield _masked(x, m, 0.5, f"zero_all_masked sk={sk}", zero_all_masked=True)


def _samples_causal(dtype):
    yield _fwd(_scores((6, 9, 9), dtype, 0, grad=True), 0.5, "opcheck")
    for sq in (1, 3, 37, 300):
        yield _fwd(_scores((4, sq, sq), dtype, sq), 0.7, f"sq={sq}")
    yield _fwd(_scores((2, 3, 17, 17), dtype, 7), -0.3, "4-d, negative scale")
    yield _fwd(_scores((0, 5, 5), dtype, 8), 1.0, "empty")


def _grad(dy, y, scale, name, upper_triang=False):
    kw = dict(grad_out=dy, output=y, scale=scale, upper_triang=upper_triang)
    return Sample(kw, name=name)


def _samples_bwd(dtype):
    shapes = ((2, 3, 4, 20), (2, 3, 4, 1), (2, 3, 4, 1000), (5, 4097), (0, 8), (3, 0))
    for i, shape in enumerate(shapes):
        y = reference_scaled_softmax_fwd(_scores(shape, dtype, i), 1.0)
        yield _grad(_scores(shape, dtype, 10 + i), y, 0.3, f"{shape}")
    for sq in (1, 3, 37, 300):
        y = reference_scaled_upper_triang_masked_softmax_fwd(_scores((4, sq, sq), dtype, sq), 1.0)
        yield _grad(_scores((4, sq, sq), dtype, sq + 1), y, 0.7, f"causal sq={sq}", True)


# Kernel vs reference, measured over the samples: the fp32 exp is within 1.2 ulp of the
# correctly rounded one and exactly 0 below ~1e-38 (torch's gives subnormals); a half output is
# within one rounding (rtol one ulp). The backward's row sums differ in order only.
FWD_TOLERANCE = {
    torch.float32: (1e-6, 1e-9),
    torch.float64: (1e-14, 1e-16),
    torch.float16: (2**-10, 1e-7),
    torch.bfloat16: (2**-7, 1e-7),
}
BWD_TOLERANCE = {
    torch.float32: (1e-6, 1e-6),
    torch.float64: (1e-13, 1e-16),
    torch.float16: (2**-10, 1e-6),
    torch.bfloat16: (2**-7, 1e-6),
}

FWD = define(
    reference_scaled_softmax_fwd,
    family="softmax",
    check=_check_fwd,
    fake=_fake_fwd,
    triton="softmax",
    autograd=_autograd(False),
    sample_inputs=_samples_fwd,
    tolerance=FWD_TOLERANCE,
)
MASKED = define(
    reference_scaled_masked_softmax_fwd,
    family="softmax",
    check=_check_masked,
    fake=_fake_fwd,
    triton="softmax",
    autograd=_autograd(False),
    sample_inputs=_samples_masked,
    tolerance=FWD_TOLERANCE,
)
CAUSAL = define(
    reference_scaled_upper_triang_masked_softmax_fwd,
    family="softmax",
    check=_check_causal,
    fake=_fake_fwd,
    triton="softmax",
    autograd=_autograd(True),
    sample_inputs=_samples_causal,
    tolerance=FWD_TOLERANCE,
)
BWD = define(
    reference_scaled_softmax_bwd,
    family="softmax",
    check=_check_bwd,
    fake=_fake_bwd,
    triton="softmax",
    sample_inputs=_samples_bwd,
    tolerance=BWD_TOLERANCE,
)
scaled_softmax_fwd = FWD.wrapper
scaled_masked_softmax_fwd = MASKED.wrapper
scaled_upper_triang_masked_softmax_fwd = CAUSAL.wrapper
scaled_softmax_bwd = BWD.wrapper
_bwd = BWD.overload  # the autograd formula calls the op itself (its inputs are checked)


def generic_scaled_masked_softmax_fwd(input: Tensor, mask: Tensor, scale: float = 1.0) -> Tensor:
    """Apex's ``generic_scaled_masked_softmax`` (any ``sk``): :func:`scaled_masked_softmax_fwd`
    with ``zero_all_masked=True``, so a fully masked row is all zeros (it attends to nothing;
    its gradient is zero too).

    Example::

        >>> m = torch.tensor([[False, True], [True, True]])[None, None]
        >>> generic_scaled_masked_softmax_fwd(torch.zeros(1, 1, 2, 2), m)[0, 0]
        tensor([[1., 0.],
                [0., 0.]])
    """
    return scaled_masked_softmax_fwd(input, mask, scale, zero_all_masked=True)
