"""``mpnb.fp8``: FP8 training of ``nn.Linear`` layers through torch's float8 dtypes.

Four recipes, as module swaps (the fp32/bf16 weight stays the parameter the optimizer
updates; each GEMM quantizes its operands on the fly):

* ``"tensorwise"`` (:class:`TensorwiseScaling`): per-tensor current scaling;
* ``"delayed"`` (:class:`DelayedScaling`): per-tensor scales from an amax history kept in the
  layer's ``state_dict`` (TransformerEngine's defaults: 1024 steps, ``"max"``, margin 0);
* ``"rowwise"`` (:class:`RowwiseScaling`): one scale per row of each GEMM operand;
* ``"mxfp8"`` (:class:`MXFP8BlockScaling`): 32-element blocks with E8M0 power-of-two scales.

Four-bit numerics beside them (E2M1 elements with two scale levels): TransformerEngine's NVFP4
and torchao's variant (:func:`quantize_nvfp4`, :func:`quantize_nvfp4_torchao`), MXFP4
(:func:`quantize_mxfp4`), the 16-point randomized Hadamard transform, stochastic rounding to
E2M1, and the emulated GEMM that accumulates per K block (:func:`fp4_mm`).

Per-layer quantization statistics (underflow, saturation, error, scale inverses, dynamic
range) of a converted model, or what a format would do to an unconverted one:
:func:`collect_quant_stats` (:mod:`mpnb.core.fp8.stats`).

The GEMMs run in ``torch._scaled_mm`` where the device supports the recipe (CPU: tensorwise
and rowwise, any shape; CUDA sm89+/sm90+: multiples of 16), and otherwise as the same math
emulated (dequantize, float32 matmul) with one :class:`Float8FallbackWarning` per layer. On a
CPU, FP8 is always emulated in the end (``torch._scaled_mm`` itself dequantizes to float32):
the numerics are FP8's, the speed is not. ``reference_*`` functions restate every recipe's
math in plain PyTorch.

Example::

    >>> from mpnb import fp8
    >>> model = fp8.convert_to_float8_training(model, "delayed")
    >>> loss = model(x).float().pow(2).mean(); loss.backward(); optimizer.step()
    >>> torch.save(model.state_dict(), "ckpt.pt")   # includes the amax histories
"""

from mpnb.core.fp8.convert import (
    NoFloat8LayerWarning,
    convert_from_float8_training,
    convert_to_float8_training,
    float8_layers,
)
from mpnb.core.fp8.formats import E4M3, E5M2, E8M0, FP8_FORMATS, format_dtypes, fp8_max
from mpnb.core.fp8.fp4 import (
    E2M1_MAX,
    e2m1_to_float,
    pack_e2m1,
    round_to_e2m1,
    stochastic_round_to_e2m1,
    unpack_e2m1,
)
from mpnb.core.fp8.fp4_gemm import FP4Operand, fp4_mm
from mpnb.core.fp8.gemm import emulated_mm, fp8_mm, scaled_mm_blocker, scaled_mm_rule
from mpnb.core.fp8.hadamard import (
    TE_RHT_SIGNS,
    hadamard_matrix,
    hadamard_transform,
    random_signs,
    te_rht_matrix,
)
from mpnb.core.fp8.keep import KeepList, KeptLayersWarning
from mpnb.core.fp8.linear import Float8FallbackWarning, Float8Linear
from mpnb.core.fp8.mxfp4 import mxfp4_scale, quantize_mxfp4
from mpnb.core.fp8.nvfp4 import (
    TE_FORMULAS,
    global_encode_scale,
    quantize_nvfp4,
    quantize_nvfp4_torchao,
    torchao_per_tensor_scale,
)
from mpnb.core.fp8.quantize import (
    Float8Operand,
    amax_to_scale,
    quantize_mx,
    quantize_rowwise,
    quantize_tensorwise,
    quantize_with_scale,
)
from mpnb.core.fp8.recipes import (
    RECIPES,
    DelayedScaling,
    Float8Recipe,
    MXFP8BlockScaling,
    RowwiseScaling,
    TensorwiseScaling,
    recipe,
)
from mpnb.core.fp8.reference import (
    reference_delayed_scales,
    reference_dequantize,
    reference_float8_linear,
    reference_quantize,
    reference_quantize_mx,
    reference_quantize_rowwise,
    reference_quantize_tensorwise,
    reference_scale,
)
from mpnb.core.fp8.stats import QuantStats, collect_quant_stats

__all__ = [
    "convert_to_float8_training",
    "convert_from_float8_training",
    "float8_layers",
    "NoFloat8LayerWarning",
    "Float8Linear",
    "Float8FallbackWarning",
    "Float8Recipe",
    "TensorwiseScaling",
    "DelayedScaling",
    "RowwiseScaling",
    "MXFP8BlockScaling",
    "RECIPES",
    "recipe",
    "Float8Operand",
    "amax_to_scale",
    "quantize_with_scale",
    "quantize_tensorwise",
    "quantize_rowwise",
    "quantize_mx",
    "fp8_mm",
    "emulated_mm",
    "scaled_mm_blocker",
    "scaled_mm_rule",
    "E4M3",
    "E5M2",
    "E8M0",
    "FP8_FORMATS",
    "fp8_max",
    "format_dtypes",
    "reference_scale",
    "reference_quantize",
    "reference_quantize_tensorwise",
    "reference_quantize_rowwise",
    "reference_quantize_mx",
    "reference_dequantize",
    "reference_delayed_scales",
    "reference_float8_linear",
    "E2M1_MAX",
    "round_to_e2m1",
    "stochastic_round_to_e2m1",
    "pack_e2m1",
    "unpack_e2m1",
    "e2m1_to_float",
    "FP4Operand",
    "fp4_mm",
    "quantize_nvfp4",
    "quantize_nvfp4_torchao",
    "global_encode_scale",
    "torchao_per_tensor_scale",
    "TE_FORMULAS",
    "quantize_mxfp4",
    "mxfp4_scale",
    "te_rht_matrix",
    "hadamard_matrix",
    "hadamard_transform",
    "random_signs",
    "TE_RHT_SIGNS",
    "QuantStats",
    "collect_quant_stats",
    "KeepList",
    "KeptLayersWarning",
]
