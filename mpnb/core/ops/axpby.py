"""``mpnb::multi_tensor_axpby``: ``out = a * x + b * y`` over tensor lists, in one pass.

Apex's ``amp_C.multi_tensor_axpby`` (the gradient accumulation of fp16_utils): each list one
dtype of fp32/fp16/bf16 (or all fp64), the math in fp32 (fp64), ``noop_flag`` set to 1 when a
checked input holds inf or NaN (``arg_to_check``: -1 both, 0 ``x``, 1 ``y``).

Kernels: ``csrc/cpu/axpby.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, any_nonfinite, check_lists, check_one, raise_flag_if
from mpnb.core.ops._library import Sample, Tensor, Tensors, define

__all__ = ["multi_tensor_axpby", "reference_multi_tensor_axpby"]


def reference_multi_tensor_axpby(
    noop_flag: Tensor,
    x: Tensors,
    y: Tensors,
    out: Tensors,
    a: float,
    b: float,
    arg_to_check: int = -1,
) -> None:
    """``out[i] = a * x[i] + b * y[i]`` for every triple, in one pass (Apex's axpby).

    Args:
        noop_flag: set to 1 when a checked input holds inf or NaN.
        x, y: inputs; out: outputs (each list one dtype of fp32/fp16/bf16, or all fp64;
            contiguous, or channels-last triples laid out alike).
        a, b: the scalars (rounded to fp32 for non-fp64 lists, as Apex does).
        arg_to_check: which inputs are checked for non-finite values: -1 both, 0 ``x``, 1 ``y``.

    Example::

        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> x, y = [torch.ones(4)], [torch.ones(4)]; out = [torch.empty(4)]
        >>> multi_tensor_axpby(flag, x, y, out, 2.0, 3.0)     # out == [5, 5, 5, 5]
    """
    if not x:
        return
    acc = acc_dtype(x[0])
    # 0-dim host scalars: a CUDA op reads them as arguments (a tensor made on the device from
    # a host value would be a copy that makes the host wait for the stream)
    sa, sb = torch.tensor(a, dtype=acc), torch.tensor(b, dtype=acc)
    for xi, yi, oi in zip(x, y, out, strict=True):
        oi.copy_(sa * xi.to(acc) + sb * yi.to(acc))
    checked = {-1: [*x, *y], 0: list(x), 1: list(y)}[arg_to_check]
    raise_flag_if(noop_flag, any_nonfinite(checked, noop_flag.device))


def _check(args, per_tensor: bool) -> None:
    op = args.op_name
    if args.arg_to_check not in (-1, 0, 1):
        raise ValueError(
            f"{op}: arg_to_check must be -1 (both), 0 (x) or 1 (y), got {args.arg_to_check}."
        )
    check_one(op, "noop_flag", args.noop_flag)
    check_lists(op, per_tensor, x=args.x, y=args.y, out=args.out)


def _samples(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    sizes = (0, 1, 17, 1000, 40000)

    def make(dt):
        return [torch.randn(n, generator=g, dtype=torch.float64).to(dt) for n in sizes]

    other = torch.float64 if dtype == torch.float64 else torch.float32
    for check in (-1, 0, 1):
        x, y = make(dtype), make(other)
        x[3][5] = float("nan")
        kw = dict(noop_flag=torch.zeros(1, dtype=torch.int32), x=x, y=y, out=make(dtype))
        yield Sample(kw | dict(a=0.5, b=-2.0, arg_to_check=check), name=f"arg_to_check={check}")


OP = define(
    reference_multi_tensor_axpby,
    family="axpby",
    mutates=("noop_flag", "out"),
    check=_check,
    memory_order=("x", "y", "out"),
    sample_inputs=_samples,
)
multi_tensor_axpby = OP.wrapper
