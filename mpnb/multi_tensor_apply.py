"""Apex-compatible name: ``mpnb.multi_tensor_apply`` (see :mod:`mpnb.core.multi_tensor_apply`)."""

from mpnb.core.multi_tensor_apply import MultiTensorApply, multi_tensor_applier

__all__ = ["MultiTensorApply", "multi_tensor_applier"]
