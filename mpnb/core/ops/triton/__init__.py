"""GPU kernels of mpnb in Triton: the CUDA backend of the ``mpnb::`` ops, opt-in until measured.

One module per op family, named like the op's module (``adam.py``, ``sgd.py``, ``lamb.py``,
``scale.py``, ``l2norm.py``, ``layer_norm.py``, ``rms_norm.py``, ``softmax.py``, ``rope.py``).
Each exposes launchers with exactly the signature of the op's schema (the reference's
positional arguments), to be registered for the CUDA dispatch key of the existing op::

    from mpnb.core.ops import triton as tk

    if tk.triton_usable():
        for name in tk.LAUNCHERS:
            torch.library.impl(f"mpnb::{name}", "CUDA", tk.launcher(name))

Importing this package imports neither triton nor the kernels (it must stay importable where
triton is not installed); :func:`launcher` imports a kernel module on first use. Until a GPU
run has measured a kernel faster than PyTorch's path, the kernels are opt-in:
``MPNB_TRITON=1``, read once (:func:`triton_status`).

Tensor-list launchers read their tensors through a table of addresses (one launch per list),
which ``torch.compile`` cannot see into: register them as opaque ops (``torch.library.impl``),
not through ``torch.library.triton_op``. The layer launchers (norms, softmax, RoPE) pass
every tensor to the kernel and may also be registered with ``triton_op``.
"""

from __future__ import annotations

import functools
import importlib
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass

__all__ = [
    "LAUNCHERS",
    "TritonStatus",
    "launcher",
    "probe_triton",
    "triton_status",
    "triton_usable",
]

#: ``mpnb::`` op name -> ``"<module>:<function>"`` of its Triton launcher in this package.
LAUNCHERS: Mapping[str, str] = {
    "fused_adam_": "adam:fused_adam_",
    "fused_adam_bf16_": "adam:fused_adam_bf16_",
    "fused_sgd_": "sgd:fused_sgd_",
    "fused_sgd_bf16_": "sgd:fused_sgd_bf16_",
    "fused_lamb_": "lamb:fused_lamb_",
    "fused_lamb_bf16_": "lamb:fused_lamb_bf16_",
    "multi_tensor_scale": "scale:multi_tensor_scale",
    "multi_tensor_l2norm": "l2norm:multi_tensor_l2norm",
    "layer_norm_fwd": "layer_norm:layer_norm_fwd",
    "layer_norm_bwd": "layer_norm:layer_norm_bwd",
    "rms_norm_fwd": "rms_norm:rms_norm_fwd",
    "rms_norm_bwd": "rms_norm:rms_norm_bwd",
    "scaled_softmax_fwd": "softmax:scaled_softmax_fwd",
    "scaled_masked_softmax_fwd": "softmax:scaled_masked_softmax_fwd",
    "scaled_upper_triang_masked_softmax_fwd": "softmax:scaled_upper_triang_masked_softmax_fwd",
    "scaled_softmax_bwd": "softmax:scaled_softmax_bwd",
    "rope": "rope:rope",
}


def launcher(name: str) -> Callable:
    """The Triton launcher of op ``name`` (imports triton and the kernel module).

    Raises:
        KeyError: ``name`` has no Triton kernel (the message lists those that do).
        ImportError: triton cannot be imported here.

    Example::

        >>> launcher("multi_tensor_scale")  # mpnb.core.ops.triton.scale.multi_tensor_scale
    """
    if name not in LAUNCHERS:
        raise KeyError(f"no Triton kernel for op {name!r}; ops with one: {', '.join(LAUNCHERS)}.")
    module, func = LAUNCHERS[name].split(":")
    return getattr(importlib.import_module(f"{__name__}.{module}"), func)


@dataclass(frozen=True)
class TritonStatus:
    """Whether the Triton kernels may serve CUDA calls here, and why not.

    Attributes:
        opted_in: ``MPNB_TRITON=1`` was set.
        cuda: torch sees a CUDA device.
        version: triton's version, or None when it cannot be imported (or was not tried).
        reason: why the kernels are not used, in words ("" when they are).
    """

    opted_in: bool
    cuda: bool
    version: str | None
    reason: str

    @property
    def usable(self) -> bool:
        """True when every condition holds."""
        return not self.reason


def probe_triton(
    environ: Mapping[str, str] | None = None, cuda_available: Callable[[], bool] | None = None
) -> TritonStatus:
    """Check the three conditions now: opted in, a CUDA device, triton importable.

    Args:
        environ: the environment to read ``MPNB_TRITON`` from (default ``os.environ``).
        cuda_available: the CUDA check (default ``torch.cuda.is_available``).

    Conditions are checked in that order and triton is imported only when the first two
    hold, so the probe stays cheap where the kernels cannot run.
    """
    env = os.environ if environ is None else environ
    opted = env.get("MPNB_TRITON", "0") == "1"
    if cuda_available is None:
        import torch

        cuda_available = torch.cuda.is_available
    cuda = bool(cuda_available())
    if not opted:
        why = "opt-in: set MPNB_TRITON=1 to use the Triton kernels (unmeasured on a GPU yet)"
        return TritonStatus(False, cuda, None, why)
    if not cuda:
        return TritonStatus(True, False, None, "no CUDA device: the Triton kernels need a GPU")
    try:
        import triton
    except ImportError as e:
        where = (
            ""
            if sys.platform == "linux"
            else f" (triton ships wheels for Linux only; this is {sys.platform})"
        )
        return TritonStatus(
            True, True, None, f"triton cannot be imported ({e}){where}: pip install triton"
        )
    return TritonStatus(True, True, triton.__version__, "")


@functools.cache
def triton_status() -> TritonStatus:
    """:func:`probe_triton` of this process, computed once (``MPNB_TRITON`` is read once)."""
    return probe_triton()


def triton_usable() -> bool:
    """True when the Triton kernels serve CUDA calls: opted in, a GPU, triton importable."""
    return triton_status().usable
