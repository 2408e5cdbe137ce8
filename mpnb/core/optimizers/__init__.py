"""Apex's fused optimizers (``apex.optimizers``) as C++ multi-tensor kernels.

Each is a real ``torch.optim.Optimizer``: LR schedulers, ``add_param_group`` and
``state_dict``/``load_state_dict`` work as usual, and checkpoints of FusedAdam, FusedSGD and
FusedAdagrad interchange with those of torch.optim.AdamW/Adam, SGD and Adagrad.
"""

from mpnb.core.optimizers.fused_adagrad import FusedAdagrad
from mpnb.core.optimizers.fused_adam import FusedAdam
from mpnb.core.optimizers.fused_lamb import FusedLAMB
from mpnb.core.optimizers.fused_mixed_precision_lamb import FusedMixedPrecisionLamb
from mpnb.core.optimizers.fused_novograd import FusedNovoGrad
from mpnb.core.optimizers.fused_sgd import FusedSGD

__all__ = [
    "FusedAdagrad",
    "FusedAdam",
    "FusedLAMB",
    "FusedMixedPrecisionLamb",
    "FusedNovoGrad",
    "FusedSGD",
]
