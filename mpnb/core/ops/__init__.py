"""The only door to mpnb's compiled kernels.

``torch.ops.mpnb.*`` are defined in C++ (``csrc/``) and built just in time by ``_build``;
the typed wrappers here pick the kernel, PyTorch's own ops (CUDA) or the pure-PyTorch
reference, with one signature for all three.
"""

from mpnb.core.ops._build import ExtensionWarning, cache_root, cpu_extension
from mpnb.core.ops._registry import OpInfo, all_ops, kernel_ready, op_path, use_kernel
from mpnb.core.ops.multi_tensor import (
    multi_tensor_axpby,
    multi_tensor_check_finite,
    multi_tensor_l2norm,
    multi_tensor_scale,
    reference_multi_tensor_axpby,
    reference_multi_tensor_check_finite,
    reference_multi_tensor_l2norm,
    reference_multi_tensor_scale,
    reference_update_loss_scale_,
    reference_update_scale_hysteresis,
    update_loss_scale_,
    update_scale_hysteresis,
)

__all__ = [
    "ExtensionWarning",
    "OpInfo",
    "all_ops",
    "cache_root",
    "cpu_extension",
    "kernel_ready",
    "op_path",
    "use_kernel",
    "multi_tensor_axpby",
    "multi_tensor_check_finite",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "update_scale_hysteresis",
    "update_loss_scale_",
    "reference_multi_tensor_axpby",
    "reference_multi_tensor_check_finite",
    "reference_multi_tensor_l2norm",
    "reference_multi_tensor_scale",
    "reference_update_scale_hysteresis",
    "reference_update_loss_scale_",
]
