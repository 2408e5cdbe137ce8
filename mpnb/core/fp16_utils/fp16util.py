"""Apex's fp16 model/param helpers: cast a network, pair model and master params, copy grads."""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from mpnb.core.amp._model import cast_model
from mpnb.core.ops import multi_tensor_scale

__all__ = [
    "FP16Model",
    "tofp16",
    "BN_convert_float",
    "network_to_half",
    "convert_module",
    "convert_network",
    "prep_param_lists",
    "model_grads_to_master_grads",
    "master_params_to_model_params",
    "to_python_float",
    "clip_grad_norm",
]

clip_grad_norm = torch.nn.utils.clip_grad_norm_


class tofp16(torch.nn.Module):  # noqa: N801 (Apex's name)
    """A module that casts its input to ``dtype`` (fp16 by default, as in Apex)."""

    def __init__(self, dtype: torch.dtype = torch.float16):
        super().__init__()
        self.dtype = dtype

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Return ``x.to(dtype)``."""
        return x.to(self.dtype)


def BN_convert_float(module: torch.nn.Module) -> torch.nn.Module:  # noqa: N802
    """Cast every affine batch norm of ``module`` back to fp32 (in place); returns ``module``."""
    for m in module.modules():
        if isinstance(m, _BatchNorm) and m.affine:
            m.float()
    return module


def network_to_half(network: torch.nn.Module, dtype: torch.dtype = torch.float16):
    """``Sequential(tofp16(dtype), network cast to dtype with fp32 batch norms)`` (Apex's).

    Example::

        >>> net = network_to_half(torch.nn.Linear(4, 4), torch.bfloat16)
    """
    return torch.nn.Sequential(tofp16(dtype), BN_convert_float(network.to(dtype)))


def convert_module(module: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast ``module``'s own floating params and buffers (not its children's) to ``dtype``."""
    for p in module.parameters(recurse=False):
        if p.is_floating_point():
            p.data = p.data.to(dtype)
            if p.grad is not None:
                p.grad = p.grad.to(dtype)
    for name, b in module.named_buffers(recurse=False):
        if b is not None and b.is_floating_point():
            setattr(module, name, b.to(dtype))


def convert_network(network: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """Cast ``network`` to ``dtype`` in place, keeping affine batch norms fp32; returns it."""
    cast_model(network, dtype, keep_batchnorm_fp32=True)
    for m in network.modules():  # Apex keeps only affine batch norms fp32
        if isinstance(m, _BatchNorm) and not m.affine:
            convert_module(m, dtype)
    return network


class FP16Model(torch.nn.Module):
    """Apex's ``FP16Model``: ``network`` cast to half, batch-norm safe, inputs cast on entry.

    The network is cast in place by :func:`convert_network` (affine batch norms stay fp32,
    their fp32 statistics and weights take half inputs) and becomes ``self.network``; the
    floating inputs of each forward are cast to ``dtype`` (other inputs, index tensors say,
    pass unchanged).

    Args:
        network: the fp32 model.
        dtype: the half dtype (fp16 as in Apex; bf16 also works).

    Example::

        >>> model = FP16Model(torchvision.models.resnet18())
        >>> model(torch.randn(8, 3, 224, 224)).dtype
        torch.float16
    """

    def __init__(self, network: torch.nn.Module, dtype: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.dtype = dtype
        self.network = convert_network(network, dtype=dtype)

    def forward(self, *inputs):
        """Run the network on the inputs, floating ones cast to ``dtype``."""
        cast = (t.to(self.dtype) if torch.is_floating_point(t) else t for t in inputs)
        return self.network(*cast)


def prep_param_lists(model: torch.nn.Module, flat_master: bool = False):
    """``(model_params, master_params)``: trainable params and fp32 copies of them.

    Args:
        model: the (half) model.
        flat_master: one flat fp32 master for all params (they must share a dtype).

    Example::

        >>> model_params, master_params = prep_param_lists(model)
    """
    model_params = [p for p in model.parameters() if p.requires_grad]
    if flat_master:
        if len({p.dtype for p in model_params}) > 1:
            raise ValueError(
                "prep_param_lists(flat_master=True): the params have several dtypes"
                "; cast the model to one dtype or use flat_master=False."
            )
        flat = torch._utils._flatten_dense_tensors([p.detach() for p in model_params]).float()
        master = torch.nn.Parameter(flat)
        master.grad = torch.zeros_like(master)
        return model_params, [master]
    masters = [torch.nn.Parameter(p.detach().clone().float()) for p in model_params]
    return model_params, masters


def model_grads_to_master_grads(model_params, master_params, flat_master: bool = False) -> None:
    """Copy model grads into the master grads (fp32), allocating them when missing."""
    if flat_master:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in model_params]
        master_params[0].grad = torch._utils._flatten_dense_tensors([g.float() for g in grads])
        return
    src, dst = [], []
    for model, master in zip(model_params, master_params, strict=True):
        if model.grad is None:
            master.grad = None
            continue
        if master.grad is None:
            master.grad = torch.empty_like(master)
        src.append(model.grad.contiguous())
        dst.append(master.grad)
    flag = torch.zeros(1, dtype=torch.int32, device=(src or [torch.empty(0)])[0].device)
    for dt in {t.dtype for t in src}:
        idx = [i for i, t in enumerate(src) if t.dtype == dt]
        multi_tensor_scale(flag, [src[i] for i in idx], [dst[i] for i in idx], 1.0)


def master_params_to_model_params(model_params, master_params, flat_master: bool = False) -> None:
    """Copy master values (fp32) back into the model params (cast to their dtype)."""
    with torch.no_grad():
        if flat_master:
            views = torch._utils._unflatten_dense_tensors(master_params[0].data, model_params)
            torch._foreach_copy_(list(model_params), list(views))
        else:
            torch._foreach_copy_(list(model_params), list(master_params))


def to_python_float(t) -> float:
    """``t.item()`` for a tensor (a host sync), ``t[0]`` for a sequence, else ``float(t)``."""
    if hasattr(t, "item"):
        return t.item()
    if isinstance(t, (list, tuple)):
        return t[0]
    return float(t)
