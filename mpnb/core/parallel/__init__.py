"""Apex's ``apex.parallel`` (LARC now; DistributedDataParallel and SyncBatchNorm to come)."""

from mpnb.core.parallel.larc import LARC

__all__ = ["LARC"]
