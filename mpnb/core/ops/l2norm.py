"""``mpnb::multi_tensor_l2norm``: the L2 norm of a tensor list, and of each tensor, in one pass.

Apex's ``amp_C.multi_tensor_l2norm`` (and ``multi_tensor_unscale_l2norm`` with
``inv_scale``): gradient clipping and LAMB's trust ratios. Squares are accumulated in fp64
(Apex accumulates in fp32 and overflows past ~1.8e19); the norms are returned in fp32 (fp64
for fp64 inputs); ``noop_flag`` is set when the total is not finite.

Kernels: ``csrc/cpu/l2norm.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, check_lists, check_one, raise_flag_if
from mpnb.core.ops._library import Sample, Tensor, Tensors, define

__all__ = ["multi_tensor_l2norm", "reference_multi_tensor_l2norm"]


def reference_multi_tensor_l2norm(
    noop_flag: Tensor,
    tensors: Tensors,
    per_tensor: bool = False,
    inv_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The L2 norm of all ``tensors`` together, and optionally of each one, in one pass.

    Args:
        noop_flag: set to 1 when the norm is not finite (an input holds inf/NaN, or the norm
            exceeds the fp32 range).
        tensors: contiguous (or channels-last) tensors of one dtype.
        per_tensor: also return each tensor's norm.
        inv_scale: optional one-element tensor; the norm is that of ``t * inv_scale`` computed
            element by element in fp32 (Apex's ``multi_tensor_unscale_l2norm``); the tensors
            are not modified.

    Returns:
        ``(total, per_tensor_norms)``: ``total`` has shape ``(1,)``; ``per_tensor_norms`` has
        shape ``(len(tensors),)``, or ``(0,)`` when ``per_tensor`` is False.

    Example::

        >>> total, per = multi_tensor_l2norm(torch.zeros(1), [torch.ones(4), torch.ones(9)], True)
        >>> total, per      # tensor([3.6056]), tensor([2., 3.])
    """
    if not tensors:
        dev = noop_flag.device
        return torch.zeros(1, device=dev), torch.empty(0, device=dev)
    acc = acc_dtype(tensors[0])
    dev = tensors[0].device
    inv = None
    if inv_scale is not None:
        inv = inv_scale.to(device=dev, dtype=acc).reshape(())
    sq = []
    for t in tensors:
        v = t.to(acc)
        if inv is not None:
            v = v * inv
        sq.append(v.to(torch.float64).square().sum())
    sq = torch.stack(sq)
    total = sq.sum().sqrt().reshape(1).to(acc)
    per = sq.sqrt().to(acc) if per_tensor else torch.empty(0, dtype=acc, device=dev)
    raise_flag_if(noop_flag, ~torch.isfinite(total).all())
    return total, per


def _check(args, per_tensor: bool) -> None:
    op = args.op_name
    check_one(op, "noop_flag", args.noop_flag)
    check_one(op, "inv_scale", args.inv_scale)
    check_lists(op, per_tensor, tensors=args.tensors)


def _fake(args):
    tensors = args.tensors
    dtype = torch.float64 if tensors and tensors[0].dtype == torch.float64 else torch.float32
    n = len(tensors) if args.per_tensor else 0
    flag = args.noop_flag
    return flag.new_empty((1,), dtype=dtype), flag.new_empty((n,), dtype=dtype)


def _samples(dtype: torch.dtype):
    g = torch.Generator().manual_seed(2)
    sizes = (1, 3, 1000, 32768 + 3, 70000)
    for per_tensor in (False, True):
        xs = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
        kw = dict(noop_flag=torch.zeros(1, dtype=torch.int32), tensors=xs, per_tensor=per_tensor)
        yield Sample(kw, name=f"per={per_tensor}")
    xs = [(torch.randn(n, generator=g, dtype=torch.float64) * 512).to(dtype) for n in sizes]
    kw = dict(noop_flag=torch.zeros(1), tensors=xs, per_tensor=True)
    yield Sample(kw | dict(inv_scale=torch.full((1,), 1 / 512)), name="inv_scale")


OP = define(
    reference_multi_tensor_l2norm,
    family="l2norm",
    mutates=("noop_flag",),
    check=_check,
    fake=_fake,
    triton="l2norm",
    memory_order=("tensors",),
    sample_inputs=_samples,
    tolerance={
        torch.float32: (2e-6, 0.0),
        torch.float16: (2e-6, 0.0),
        torch.bfloat16: (2e-6, 0.0),
        torch.float64: (1e-12, 0.0),
    },
)
multi_tensor_l2norm = OP.wrapper
