"""Apex's ``SyncBatchNorm``: batch norm whose statistics cover every rank's batch.

Unlike ``torch.nn.SyncBatchNorm`` it runs on CPU tensors (gloo) as well as CUDA (NCCL).
"""

from __future__ import annotations

import torch
from torch.nn.modules.batchnorm import _BatchNorm

from mpnb.core.parallel.sync_batchnorm_kernel import check_channels, sync_batch_norm, world_of

__all__ = ["SyncBatchNorm"]

_NHWC = {
    4: ((0, 2, 3, 1), (0, 3, 1, 2), torch.channels_last),
    5: ((0, 2, 3, 4, 1), (0, 4, 1, 2, 3), torch.channels_last_3d),
}


class SyncBatchNorm(_BatchNorm):
    """Batch norm over the union of all ranks' batches (1d, 2d and 3d inputs).

    Statistics are fp32 for fp16/bf16 input (per rank from a Welford kernel, merged across
    ranks with Chan's formula, so ranks with different batch sizes are weighted correctly)
    and the running statistics are the same on every rank. Without an initialized process
    group it is a plain batch norm. The first training forward checks that every rank has the
    same channel count (a ValueError naming the ranks otherwise); under
    :func:`~mpnb.parallel.launch`, a rank left waiting because another is in ``eval()`` fails
    naming both.

    Args:
        num_features: channels C.
        eps, momentum, affine, track_running_stats: as in ``torch.nn.BatchNorm2d``
            (``momentum=None``: cumulative average).
        process_group: the ranks that share statistics (default: the world).
        channel_last: the input's LAST dim is the channel, ``(N, ..., C)``. A channels-first
            tensor in ``torch.channels_last`` memory format needs no flag: it is read in place.
        fuse_relu: apply ReLU to the output (after adding ``z``, if given).

    Example::

        >>> bn = SyncBatchNorm(16, fuse_relu=True)
        >>> y = bn(torch.randn(8, 16, 4, 4))          # mean/var over all ranks' batches
    """

    _channels_checked = False  # across ranks, once: on the first training forward

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group=None,
        channel_last: bool = False,
        fuse_relu: bool = False,
        device=None,
        dtype=None,
    ):
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device, dtype)
        self.process_group = process_group
        self.channel_last = channel_last
        self.fuse_relu = fuse_relu

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(
                f"SyncBatchNorm: expected an input with a batch and a channel dim (2-5 dims), "
                f"got shape {tuple(input.shape)}; add the batch dim with input.unsqueeze(0)."
            )
        c = input.shape[-1] if self.channel_last else input.shape[1]
        if c != self.num_features:
            where = "last" if self.channel_last else "second (dim 1)"
            raise ValueError(
                f"SyncBatchNorm: the {where} dim of input {tuple(input.shape)} is {c}, but "
                f"num_features is {self.num_features}; "
                + (
                    "pass channel_last=False for (N, C, ...) input."
                    if self.channel_last
                    else "pass channel_last=True for (N, ..., C) input."
                )
            )

    def _momentum(self) -> float:
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:
                return 1.0 / float(self.num_batches_tracked)
        return 0.0 if self.momentum is None else self.momentum

    def forward(self, input: torch.Tensor, z: torch.Tensor | None = None) -> torch.Tensor:
        """Normalize ``input`` (plus ``z`` before the ReLU when ``fuse_relu``)."""
        self._check_input_dim(input)
        training = self.training or not self.track_running_stats
        if training and not self._channels_checked and world_of(self.process_group) > 1:
            check_channels(input, self.channel_last, self.process_group)
            self._channels_checked = True
        momentum = self._momentum()
        keep = not self.training or self.track_running_stats
        rm, rv = (self.running_mean, self.running_var) if keep else (None, None)
        x, channel_last, back = input, self.channel_last, None
        nhwc = _NHWC.get(input.dim())
        if (
            not channel_last
            and nhwc
            and not input.is_contiguous()
            and input.is_contiguous(memory_format=nhwc[2])
        ):
            x, channel_last, back = input.permute(nhwc[0]), True, nhwc[1]
            z = None if z is None else z.permute(nhwc[0])
        y = sync_batch_norm(
            x,
            self.weight,
            self.bias,
            rm,
            rv,
            self.eps,
            momentum,
            self.process_group,
            channel_last,
            self.fuse_relu,
            z,
            training,
        )
        return y if back is None else y.permute(back)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, channel_last={self.channel_last}, fuse_relu={self.fuse_relu}"
        )
