"""``mpnb::multi_tensor_scale``: ``dst = src * scale`` over tensor lists, in one pass.

Apex's ``amp_C.multi_tensor_scale``, and what a loss scaler's unscale is: half grads read
once, multiplied in fp32 (fp64 for fp64 lists), written once (into themselves or into fp32
master grads), and ``noop_flag`` set to 1 when a scaled value is not finite. Checking the
*scaled* value catches every non-finite source (``inf * s`` and ``NaN * s`` are never finite)
and also a finite source that a huge or non-finite scale turns non-finite (``0 * inf``). The
flag is only ever set, never cleared, and the work is done even when it is already set (as
Apex does).

Kernels: ``csrc/cpu/scale.cpp`` (CPU); PyTorch's ``_amp_foreach_non_finite_check_and_unscale_``
on CUDA (fp32 destinations), else the reference.
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype, any_nonfinite, check_lists, check_one, raise_flag_if
from mpnb.core.ops._library import Sample, Tensor, Tensors, call, define

__all__ = ["multi_tensor_scale", "reference_multi_tensor_scale"]


def reference_multi_tensor_scale(
    noop_flag: Tensor,
    src: Tensors,
    dst: Tensors,
    scale: float,
    scale_tensor: Tensor | None = None,
) -> None:
    """``dst[i] = src[i] * scale`` for every pair, in one pass; flag non-finite results.

    The lists may have different dtypes (bf16 model grads into fp32 master grads: the unscale
    of a loss-scaled backward). Each element is read once, multiplied in fp32 (fp64 for fp64
    lists), checked and written once.

    Args:
        noop_flag: a one-element tensor set to 1 when any scaled value is inf or NaN.
        src: contiguous tensors to read (one dtype per list).
        dst: contiguous tensors to write, same sizes as ``src`` (may be ``src`` itself).
            Channels-last pairs laid out alike work too (:mod:`mpnb.core.ops._layout`).
        scale: the factor.
        scale_tensor: optional one-element tensor multiplied into ``scale`` (a loss scaler's
            ``inv_scale`` that lives on the device).

    Example::

        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> grads = [torch.randn(10).bfloat16()]; master = [torch.empty(10)]
        >>> multi_tensor_scale(flag, grads, master, 1 / 1024)
    """
    if not src:
        return
    acc = acc_dtype(src[0])
    # rounded to fp32, as the kernel; a 0-dim host scalar, which a CUDA op reads as an argument
    # (made on the device from a host value it would be a copy the host waits for)
    s = torch.tensor(scale, dtype=acc)
    if scale_tensor is not None:
        s = s * scale_tensor.to(device=src[0].device, dtype=acc).reshape(())
    scaled = [a.to(acc) * s for a in src]
    for b, v in zip(dst, scaled, strict=True):
        b.copy_(v)
    raise_flag_if(noop_flag, any_nonfinite(scaled, noop_flag.device))


def _check(args, per_tensor: bool) -> None:
    op = args.op_name
    check_one(op, "noop_flag", args.noop_flag)
    check_one(op, "scale_tensor", args.scale_tensor)
    check_lists(op, per_tensor, src=args.src, dst=args.dst)


def _torch_multi_tensor_scale(args) -> None:
    """PyTorch's fused unscale for fp32 destinations (CUDA); the reference otherwise.

    Widening into fp32 is exact, so ``_amp_foreach_non_finite_check_and_unscale_`` on the
    copied values checks exactly the scaled values the reference checks.
    """
    src, dst = args.src, args.dst
    fp32_dst = src and all(t.dtype == torch.float32 for t in dst)
    aliased = any(a.numel() and a.data_ptr() == b.data_ptr() for a, b in zip(src, dst, strict=True))
    if not fp32_dst or src[0].dtype == torch.float64 or (aliased and src[0].dtype != torch.float32):
        call(reference_multi_tensor_scale, args)
        return
    s = torch.full((1,), args.scale, dtype=torch.float32, device=dst[0].device)  # no copy
    if args.scale_tensor is not None:
        s = s * args.scale_tensor.to(device=s.device, dtype=torch.float32).reshape(1)
    found = torch.zeros(1, dtype=torch.float32, device=dst[0].device)
    torch._foreach_copy_(list(dst), list(src))
    torch._amp_foreach_non_finite_check_and_unscale_(list(dst), found, s)
    raise_flag_if(args.noop_flag, found > 0)


def _samples(dtype: torch.dtype):
    g = torch.Generator().manual_seed(0)
    sizes = (0, 1, 3, 17, 1000, 32768 * 2 + 5)

    def make(dt, scale=1.0):
        return [(torch.randn(n, generator=g, dtype=torch.float64) * scale).to(dt) for n in sizes]

    outs = (dtype,) if dtype == torch.float64 else (dtype, torch.float32)
    for out in outs:
        flag = torch.zeros(1, dtype=torch.int32)
        kw = dict(noop_flag=flag, src=make(dtype), dst=make(out), scale=1 / 1024)
        yield Sample(kw, name=f"to {out}")
    src = make(dtype, 1e3)
    src[4][7] = float("inf")
    kw = dict(noop_flag=torch.zeros(1), src=src, dst=[torch.empty_like(t) for t in src])
    yield Sample(kw | dict(scale=0.5, scale_tensor=torch.ones(1)), name="inf, scale_tensor")


OP = define(
    reference_multi_tensor_scale,
    family="scale",
    mutates=("noop_flag", "dst"),
    check=_check,
    cuda=_torch_multi_tensor_scale,
    triton="scale",
    memory_order=("src", "dst"),
    sample_inputs=_samples,
)
multi_tensor_scale = OP.wrapper
