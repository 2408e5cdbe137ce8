"""``mpnb::multi_tensor_check_finite``: is any element of a tensor list inf or NaN?

Read-only, one pass, no copy: what a loss scaler needs before a fused optimizer step that
unscales on the fly. Sets ``noop_flag`` to 1 on inf/NaN and never clears it.

Kernels: ``csrc/cpu/check_finite.cpp`` (CPU, over the raw bits); on CUDA the Triton kernel
(:mod:`mpnb.core.ops.triton.check_finite`: one read-only launch over the whole list, every
dtype) where a GPU run measured it at least as fast as the PyTorch path, which is PyTorch's
``_amp_foreach_non_finite_check_and_unscale_`` with a scale of exactly 1.0 (bit-preserving,
but it writes the tensors back) for the dtypes it takes (fp32, fp16), and the reference for
the others (bf16, fp64: three launches per tensor).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import any_nonfinite, check_lists, check_one, raise_flag_if
from mpnb.core.ops._library import Sample, Tensor, Tensors, call, define

__all__ = ["multi_tensor_check_finite", "reference_multi_tensor_check_finite"]


def reference_multi_tensor_check_finite(noop_flag: Tensor, tensors: Tensors) -> None:
    """Set ``noop_flag`` to 1 if any element of ``tensors`` is inf or NaN; read-only, one pass.

    Args:
        noop_flag: a one-element tensor (any dtype), set to 1 on inf/NaN, never cleared.
        tensors: contiguous (or channels-last) tensors of one floating dtype.

    Example::

        >>> flag = torch.zeros(1)
        >>> multi_tensor_check_finite(flag, [torch.tensor([1.0, float("inf")])])   # flag == 1
    """
    raise_flag_if(noop_flag, any_nonfinite(tensors, noop_flag.device))


def _check(args, per_tensor: bool) -> None:
    check_one(args.op_name, "noop_flag", args.noop_flag)
    check_lists(args.op_name, per_tensor, tensors=args.tensors)


#: The dtypes PyTorch's CUDA ``_amp_foreach_non_finite_check_and_unscale_`` takes (it
#: refuses bf16 with "not implemented for 'BFloat16'").
TORCH_CHECK_DTYPES = (torch.float32, torch.float16)


def _torch_multi_tensor_check_finite(args) -> None:
    """PyTorch's fused check (CUDA): unscale by exactly 1.0 into a found-inf flag; the
    reference for a dtype that op does not take (bf16, fp64)."""
    tensors = args.tensors
    if not tensors or tensors[0].dtype not in TORCH_CHECK_DTYPES:
        call(reference_multi_tensor_check_finite, args)
        return
    dev = tensors[0].device
    found = torch.zeros(1, dtype=torch.float32, device=dev)
    one = torch.ones(1, dtype=torch.float32, device=dev)
    torch._amp_foreach_non_finite_check_and_unscale_(list(tensors), found, one)
    raise_flag_if(args.noop_flag, found > 0)


def _samples(dtype: torch.dtype):
    g = torch.Generator().manual_seed(3)
    sizes = (0, 1, 17, 1000, 32768 * 2 + 5)
    for plant in (None, float("inf"), float("-inf"), float("nan")):
        xs = [torch.randn(n, generator=g, dtype=torch.float64).to(dtype) for n in sizes]
        if plant is not None:
            xs[4][32768 + 9] = plant
        kw = dict(noop_flag=torch.zeros(1, dtype=torch.int32), tensors=xs)
        yield Sample(kw, name=f"plant={plant}")


OP = define(
    reference_multi_tensor_check_finite,
    family="check_finite",
    mutates=("noop_flag",),
    check=_check,
    cuda=_torch_multi_tensor_check_finite,
    triton="check_finite",
    memory_order=("tensors",),
    sample_inputs=_samples,
)
multi_tensor_check_finite = OP.wrapper
