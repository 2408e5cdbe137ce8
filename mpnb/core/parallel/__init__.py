"""Apex's ``apex.parallel``: DistributedDataParallel, Reducer, SyncBatchNorm, LARC, launch."""

from mpnb.core.parallel.distributed import CommStats, DistributedDataParallel
from mpnb.core.parallel.larc import LARC
from mpnb.core.parallel.launch import RankError, free_port, launch, under_torchrun
from mpnb.core.parallel.reducer import Reducer

__all__ = [
    "LARC",
    "DistributedDataParallel",
    "Reducer",
    "CommStats",
    "launch",
    "RankError",
    "free_port",
    "under_torchrun",
]
