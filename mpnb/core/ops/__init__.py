"""The only door to mpnb's compiled kernels: one module per op family, one op library.

Each module ``mpnb/core/ops/<family>.py`` defines its ops' schemas with ``torch.library``
(namespace ``mpnb``), their pure-PyTorch references (``reference_<op>``), the PyTorch-ops
path for devices without a kernel of ours, the fakes, and one-line wrappers that call
``torch.ops.mpnb.<op>``. The C++ kernels (``csrc/cpu/<family>.cpp``) register themselves for
the CPU key when the library is loaded (built just in time on first use). PyTorch's
dispatcher is the only way to an op: :func:`op_path` says which implementation it picks.
"""

from mpnb.core.ops import (
    adagrad,
    adam,
    axpby,
    check_finite,
    l2norm,
    lamb,
    loss_scale,
    novograd,
    scale,
    sgd,
)
from mpnb.core.ops._build import ExtensionWarning, cache_root, cpu_extension
from mpnb.core.ops._library import (
    OpInfo,
    Sample,
    all_ops,
    ensure_kernels,
    kernels_loaded,
    op_info,
    op_path,
    use_reference,
)
from mpnb.core.ops.adagrad import fused_adagrad_, reference_fused_adagrad_
from mpnb.core.ops.adam import fused_adam_, reference_fused_adam_
from mpnb.core.ops.axpby import multi_tensor_axpby, reference_multi_tensor_axpby
from mpnb.core.ops.check_finite import (
    multi_tensor_check_finite,
    reference_multi_tensor_check_finite,
)
from mpnb.core.ops.l2norm import multi_tensor_l2norm, reference_multi_tensor_l2norm
from mpnb.core.ops.lamb import fused_lamb_, reference_fused_lamb_
from mpnb.core.ops.loss_scale import (
    reference_update_loss_scale_,
    reference_update_scale_hysteresis,
    update_loss_scale_,
    update_scale_hysteresis,
)
from mpnb.core.ops.novograd import fused_novograd_, reference_fused_novograd_
from mpnb.core.ops.scale import multi_tensor_scale, reference_multi_tensor_scale
from mpnb.core.ops.sgd import fused_sgd_, reference_fused_sgd_

__all__ = [
    "ExtensionWarning",
    "OpInfo",
    "Sample",
    "all_ops",
    "axpby",
    "cache_root",
    "check_finite",
    "cpu_extension",
    "ensure_kernels",
    "kernels_loaded",
    "l2norm",
    "loss_scale",
    "op_info",
    "op_path",
    "scale",
    "use_reference",
    "multi_tensor_axpby",
    "multi_tensor_check_finite",
    "multi_tensor_l2norm",
    "multi_tensor_scale",
    "update_loss_scale_",
    "update_scale_hysteresis",
    "reference_multi_tensor_axpby",
    "reference_multi_tensor_check_finite",
    "reference_multi_tensor_l2norm",
    "reference_multi_tensor_scale",
    "reference_update_loss_scale_",
    "reference_update_scale_hysteresis",
    "adagrad",
    "adam",
    "lamb",
    "novograd",
    "sgd",
    "fused_adagrad_",
    "fused_adam_",
    "fused_lamb_",
    "fused_novograd_",
    "fused_sgd_",
    "reference_fused_adagrad_",
    "reference_fused_adam_",
    "reference_fused_lamb_",
    "reference_fused_novograd_",
    "reference_fused_sgd_",
]
