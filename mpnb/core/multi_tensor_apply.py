"""Apex's ``multi_tensor_apply``: ``multi_tensor_applier(op, noop_flag, tensor_lists, *args)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

__all__ = ["MultiTensorApply", "multi_tensor_applier"]


class MultiTensorApply:
    """Calls an ``amp_C``-style op with a chunk size: ``op(chunk_size, noop_flag, lists, *args)``.

    Args:
        chunk_size: elements per chunk, passed through to the op (Apex's default is 2048*32).

    Attributes:
        available: always True: mpnb's multi-tensor ops exist on every device (compiled on the
            CPU, PyTorch's own ops on CUDA, references otherwise).

    Example::

        >>> from mpnb import amp_C
        >>> flag = torch.zeros(1, dtype=torch.int32)
        >>> multi_tensor_applier(amp_C.multi_tensor_scale, flag, [grads, master_grads], 1 / 512)
    """

    available = True
    warned = False

    def __init__(self, chunk_size: int) -> None:
        if chunk_size <= 0:
            raise ValueError(f"MultiTensorApply: chunk_size must be positive, got {chunk_size}.")
        self.chunk_size = int(chunk_size)

    def check_avail(self) -> None:
        """Apex API: raises when the kernels are unavailable (they always are here)."""

    def __call__(self, op: Callable, noop_flag_buffer: torch.Tensor, tensor_lists: Sequence, *args):
        return op(self.chunk_size, noop_flag_buffer, tensor_lists, *args)


multi_tensor_applier = MultiTensorApply(2048 * 32)
