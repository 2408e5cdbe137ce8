"""``mpnb::multi_tensor_l2norm``: the L2 norm of a tensor list, and of each tensor, in one pass.

Apex's ``amp_C.multi_tensor_l2norm`` (and ``multi_tensor_unscale_l2norm`` with
``inv_scale``): gradient clipping and LAMB's trust ratios. Squares are accumulated in fp64
(Apex accumulates in fp32 and overflows past ~1.8e19); the norms are returned in fp32 (fp64
for fp64 inputs); ``noop_flag`` is set when the total is not finite.

Kernels: ``csrc/cpu/l2norm.cpp`` (CPU); the reference elsewhere.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, check_lists, raise_flag_if
from mpnb.core.ops._layout import in_memory_order
from mpnb.core.ops._library import Sample, define, ensure_kernels

__all__ = ["multi_tensor_l2norm", "reference_multi_tensor_l2norm"]


def reference_multi_tensor_l2norm(noop_flag, tensors, per_tensor: bool = False, inv_scale=None):
    """Reference of :func:`multi_tensor_l2norm` in plain PyTorch (fp64 accumulation)."""
    check_lists("multi_tensor_l2norm", tensors)
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


def _fake(noop_flag, tensors, per_tensor=False, inv_scale=None):
    dtype = torch.float64 if tensors and tensors[0].dtype == torch.float64 else torch.float32
    n = len(tensors) if per_tensor else 0
    return noop_flag.new_empty((1,), dtype=dtype), noop_flag.new_empty((n,), dtype=dtype)


def _samples(dtype: torch.dtype):
    g = torch.Generator().manual_seed(2)
    sizes = (1, 3, 1000, 32768 + 3, 70000)
    for per_tensor in (False, True):
        xs = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
        yield Sample((torch.zeros(1, dtype=torch.int32), xs, per_tensor), name=f"per={per_tensor}")
    xs = [(torch.randn(n, generator=g, dtype=torch.float64) * 512).to(dtype) for n in sizes]
    yield Sample((torch.zeros(1), xs, True, torch.full((1,), 1 / 512)), name="inv_scale")


OP = define(
    "multi_tensor_l2norm(Tensor(a!) noop_flag, Tensor[] tensors, bool per_tensor=False, "
    "Tensor? inv_scale=None) -> (Tensor, Tensor)",
    family="l2norm",
    reference=reference_multi_tensor_l2norm,
    fake=_fake,
    sample_inputs=_samples,
    tolerance={
        torch.float32: (2e-6, 0.0),
        torch.float16: (2e-6, 0.0),
        torch.bfloat16: (2e-6, 0.0),
        torch.float64: (1e-12, 0.0),
    },
)
_op = OP.overload


def multi_tensor_l2norm(noop_flag, tensors, per_tensor: bool = False, inv_scale=None):
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
    ensure_kernels()
    return in_memory_order(_op, (noop_flag, tensors, per_tensor, inv_scale), (1,))
