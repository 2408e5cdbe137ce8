"""The only door to mpnb's compiled kernels: one module per op family, one op library.

Each module ``mpnb/core/ops/<family>.py`` writes its ops' pure-PyTorch references
(``reference_<op>``, annotated: the one written signature of each op) and defines the ops
from them (:func:`mpnb.core.ops._library.define`): the ``torch.library`` schema (namespace
``mpnb``), the public wrapper that checks the arguments and calls ``torch.ops.mpnb.<op>``, the
PyTorch-ops path and the Triton kernel for CUDA, the fakes. The C++ kernels
(``csrc/cpu/<family>.cpp``) register themselves for the CPU key when the library is loaded
(built just in time on first use). PyTorch's dispatcher is the only way to an op:
:func:`op_path` says which implementation it picks.

The RoPE op's family module is :mod:`mpnb.core.ops.rotary`, so ``mpnb.core.ops.rope`` is the
op's wrapper and nothing else.
"""

from mpnb.core.ops import (
    adagrad,
    adam,
    axpby,
    check_finite,
    dense,
    l2norm,
    lamb,
    layer_norm,
    loss_scale,
    novograd,
    rms_norm,
    rotary,
    scale,
    sgd,
    softmax,
    welford,
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
    use_torch_path,
)
from mpnb.core.ops._output_cache import output_cache
from mpnb.core.ops.adagrad import fused_adagrad_, reference_fused_adagrad_
from mpnb.core.ops.adam import (
    fused_adam_,
    fused_adam_bf16_,
    reference_fused_adam_,
    reference_fused_adam_bf16_,
)
from mpnb.core.ops.axpby import multi_tensor_axpby, reference_multi_tensor_axpby
from mpnb.core.ops.check_finite import (
    multi_tensor_check_finite,
    reference_multi_tensor_check_finite,
)
from mpnb.core.ops.dense import ACTIVATIONS, bias_act_bwd, reference_bias_act_bwd
from mpnb.core.ops.l2norm import multi_tensor_l2norm, reference_multi_tensor_l2norm
from mpnb.core.ops.lamb import (
    fused_lamb_,
    fused_lamb_bf16_,
    reference_fused_lamb_,
    reference_fused_lamb_bf16_,
)
from mpnb.core.ops.layer_norm import (
    layer_norm_bwd,
    layer_norm_fwd,
    reference_layer_norm_bwd,
    reference_layer_norm_fwd,
)
from mpnb.core.ops.loss_scale import (
    reference_update_loss_scale_,
    reference_update_scale_hysteresis,
    update_loss_scale_,
    update_scale_hysteresis,
)
from mpnb.core.ops.novograd import fused_novograd_, reference_fused_novograd_
from mpnb.core.ops.rms_norm import (
    reference_rms_norm_bwd,
    reference_rms_norm_fwd,
    rms_norm_bwd,
    rms_norm_fwd,
)
from mpnb.core.ops.rotary import reference_rope, rope
from mpnb.core.ops.scale import multi_tensor_scale, reference_multi_tensor_scale
from mpnb.core.ops.sgd import (
    fused_sgd_,
    fused_sgd_bf16_,
    reference_fused_sgd_,
    reference_fused_sgd_bf16_,
)
from mpnb.core.ops.softmax import (
    MASKED_VALUE,
    generic_scaled_masked_softmax_fwd,
    reference_scaled_masked_softmax_fwd,
    reference_scaled_softmax_bwd,
    reference_scaled_softmax_fwd,
    reference_scaled_upper_triang_masked_softmax_fwd,
    scaled_masked_softmax_fwd,
    scaled_softmax_bwd,
    scaled_softmax_fwd,
    scaled_upper_triang_masked_softmax_fwd,
)
from mpnb.core.ops.welford import (
    reference_welford_mean_var,
    reference_welford_parallel,
    welford_mean_var,
    welford_parallel,
)

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
    "output_cache",
    "scale",
    "use_reference",
    "use_torch_path",
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
    "dense",
    "layer_norm",
    "rms_norm",
    "rotary",
    "softmax",
    "welford",
    "ACTIVATIONS",
    "MASKED_VALUE",
    "bias_act_bwd",
    "generic_scaled_masked_softmax_fwd",
    "layer_norm_bwd",
    "layer_norm_fwd",
    "rms_norm_bwd",
    "rms_norm_fwd",
    "rope",
    "scaled_masked_softmax_fwd",
    "scaled_softmax_bwd",
    "scaled_softmax_fwd",
    "scaled_upper_triang_masked_softmax_fwd",
    "welford_mean_var",
    "welford_parallel",
    "reference_bias_act_bwd",
    "reference_layer_norm_bwd",
    "reference_layer_norm_fwd",
    "reference_rms_norm_bwd",
    "reference_rms_norm_fwd",
    "reference_rope",
    "reference_scaled_masked_softmax_fwd",
    "reference_scaled_softmax_bwd",
    "reference_scaled_softmax_fwd",
    "reference_scaled_upper_triang_masked_softmax_fwd",
    "reference_welford_mean_var",
    "reference_welford_parallel",
    "adagrad",
    "adam",
    "lamb",
    "novograd",
    "sgd",
    "fused_adagrad_",
    "fused_adam_",
    "fused_adam_bf16_",
    "fused_lamb_",
    "fused_lamb_bf16_",
    "fused_novograd_",
    "fused_sgd_",
    "fused_sgd_bf16_",
    "reference_fused_adagrad_",
    "reference_fused_adam_",
    "reference_fused_adam_bf16_",
    "reference_fused_lamb_",
    "reference_fused_lamb_bf16_",
    "reference_fused_novograd_",
    "reference_fused_sgd_",
    "reference_fused_sgd_bf16_",
]
