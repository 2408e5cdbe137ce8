"""Apex's ``apex.parallel``: DistributedDataParallel, Reducer, SyncBatchNorm, LARC, launch; and
beyond Apex, the full state dict of a sharded model and the error of an overflowing fp16
reduction."""

from torch.distributed import ReduceOp

from mpnb.core.parallel._common import GradOverflowError
from mpnb.core.parallel.convert import convert_syncbn_model
from mpnb.core.parallel.distributed import CommStats, DistributedDataParallel
from mpnb.core.parallel.larc import LARC
from mpnb.core.parallel.launch import RankError, end_group, free_port, launch, under_torchrun
from mpnb.core.parallel.reducer import Reducer
from mpnb.core.parallel.state_dict import full_state_dict, load_full_state_dict
from mpnb.core.parallel.sync_batchnorm import SyncBatchNorm
from mpnb.core.parallel.sync_batchnorm_kernel import sync_batch_norm

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "Reducer",
    "SyncBatchNorm",
    "sync_batch_norm",
    "convert_syncbn_model",
    "CommStats",
    "launch",
    "RankError",
    "end_group",
    "free_port",
    "under_torchrun",
    "ReduceOp",
    "full_state_dict",
    "load_full_state_dict",
    "GradOverflowError",
]
