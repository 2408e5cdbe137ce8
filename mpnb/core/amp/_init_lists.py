"""The cast lists of ``amp.init`` (Apex's pre-``initialize`` API), by owner and policy.

Names only; :mod:`mpnb.core.amp.init_api` turns them into a table from the function objects
PyTorch hands a :class:`torch.overrides.TorchFunctionMode` to each function's rule. Apex
applied the lists of ``torch`` to ``torch.Tensor`` as well, wherever the method exists.
"""

from __future__ import annotations

__all__ = [
    "FUNCTIONAL_HALF",
    "FUNCTIONAL_FLOAT",
    "HALF",
    "FLOAT",
    "PROMOTE",
    "SEQUENCE",
    "TENSOR_HALF",
    "TENSOR_FLOAT",
    "RNNS",
    "RNN_CELLS",
    "BANNED",
]

# torch.nn.functional and torch: run on half inputs (the matmul and convolution family).
FUNCTIONAL_HALF = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "conv_tbc",
    "linear",
)
HALF = (
    *FUNCTIONAL_HALF[:-1],
    "prelu",
    "addmm",
    "addmv",
    "addr",
    "matmul",
    "mm",
    "mv",
    "addbmm",
    "baddbmm",
    "bmm",
)

# Run in fp32: functions whose range or accuracy fp16 does not hold.
FUNCTIONAL_FLOAT = (
    "interpolate",
    "grid_sample",
    "softplus",
    "softmin",
    "log_softmax",
    "softmax",
    "gelu",
    "layer_norm",
    "group_norm",
    "local_response_norm",
    "normalize",
    "cosine_similarity",
    "poisson_nll_loss",
    "cosine_embedding_loss",
    "cross_entropy",
    "hinge_embedding_loss",
    "kl_div",
    "l1_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "multilabel_soft_margin_loss",
    "multi_margin_loss",
    "nll_loss",
    "binary_cross_entropy_with_logits",
    "smooth_l1_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "ctc_loss",
)
FLOAT = (
    "acos",
    "asin",
    "cosh",
    "erfinv",
    "exp",
    "expm1",
    "log",
    "log10",
    "log2",
    "reciprocal",
    "rsqrt",
    "sinh",
    "tan",
    "pow",
    "cumprod",
    "cumsum",
    "dist",
    "norm",
    "prod",
    "std",
    "sum",
    "var",
    "renorm",
)

# Several tensor inputs: cast to the widest (fp32) when fp16 and fp32 meet.
PROMOTE = (
    "addcdiv",
    "addcmul",
    "atan2",
    "cross",
    "bilinear",
    "dot",
    "add",
    "div",
    "mul",
    "eq",
    "equal",
    "ge",
    "gt",
    "le",
    "lt",
    "ne",
    "sub",
    "true_divide",
)
SEQUENCE = ("cat", "stack")

# Methods of torch.Tensor beyond the torch lists.
TENSOR_HALF = ("__matmul__",)
TENSOR_FLOAT = ("__ipow__", "__pow__", "__rpow__", "cpu")

# torch's recurrent kernels (what nn.RNN/LSTM/GRU and their cells call): run on half inputs.
RNNS = ("rnn_relu", "rnn_tanh", "gru", "lstm")
RNN_CELLS = ("rnn_relu_cell", "rnn_tanh_cell", "gru_cell", "lstm_cell")

BANNED = {
    "binary_cross_entropy": (
        "amp does not work out of the box with F.binary_cross_entropy or torch.nn.BCELoss: "
        "it needs fp32 inputs, and under amp.init the layer before it (usually a sigmoid) "
        "returns fp16. Use torch.nn.BCEWithLogitsLoss (sigmoid and loss in one, fp32 under "
        "amp), or call amp.register_float_function(torch, 'sigmoid') before amp.init(). If "
        "you know the inputs are safe, pass allow_banned=True to amp.init() to run it in fp32."
    ),
}
