"""The training steps of the peers: PyTorch's own ways to train in lower precision.

:class:`TorchAmpStep` is PyTorch's AMP recipe (``torch.autocast`` around the forward and the
loss, ``torch.amp.GradScaler`` around the backward and the step), :class:`TF32Step` fp32 with
TF32 matmuls (inside :func:`tf32_enabled`, so that the configurations around it in a
round-robin keep their own settings), and :class:`CompiledTorchAmpStep` the AMP recipe through
``torch.compile`` of the model. None of them reads a device value on the host.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from mpnb.core.precision_configs._step import TrainStep

__all__ = ["TorchAmpStep", "TF32Step", "CompiledTorchAmpStep", "tf32_enabled"]


@contextlib.contextmanager
def tf32_enabled() -> Iterator[None]:
    """TF32 for CUDA fp32 matmuls and cuDNN convolutions inside the block; the previous
    settings are restored after it, also when the body raises.

    Uses ``fp32_precision`` (PyTorch 2.9+; reading the legacy ``allow_tf32`` flags after
    setting it raises there), else the legacy ``allow_tf32`` flags. On a CPU the flags change
    nothing: CPU fp32 matmuls have no TF32.

    Example::

        >>> with tf32_enabled():
        ...     y = a @ b          # TF32 on an Ampere or newer GPU
    """
    matmul, conv = torch.backends.cuda.matmul, torch.backends.cudnn.conv
    new = hasattr(matmul, "fp32_precision") and hasattr(conv, "fp32_precision")
    if new:
        before = (matmul.fp32_precision, conv.fp32_precision)
    else:
        before = (matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        if new:
            matmul.fp32_precision = conv.fp32_precision = "tf32"
        else:
            matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        yield
    finally:
        if new:
            matmul.fp32_precision, conv.fp32_precision = before
        else:
            matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


class TF32Step(TrainStep):
    """fp32 training with TF32 matmuls: the forward and the backward run in
    :func:`tf32_enabled` (the optimizer's step has no matmul)."""

    def forward_context(self) -> contextlib.AbstractContextManager:
        """:func:`tf32_enabled`."""
        return tf32_enabled()

    def backward(self, loss: torch.Tensor) -> None:
        """``loss.backward()`` in :func:`tf32_enabled` (the backward's GEMMs in TF32 too)."""
        with tf32_enabled():
            loss.backward()


class TorchAmpStep(TrainStep):
    """``torch.autocast`` + ``torch.amp.GradScaler``, PyTorch's recipe.

    Args:
        model: the fp32 model (unchanged: autocast casts inside the forward).
        optimizer: ``torch.optim.AdamW(fused=True)`` (with a fused optimizer the scaler's
            skip is decided on the device, inside the optimizer's kernel).
        device_type: ``"cpu"`` or ``"cuda"``; dtype: the autocast dtype.
        scaler: the ``GradScaler`` keyword arguments (``init_scale``, ``growth_factor``,
            ``backoff_factor``, ``growth_interval``), or None for a disabled scaler (bf16,
            which has fp32's range: PyTorch recommends no scaling; the scaler is then a
            no-op, so the loop stays the same).

    The skip is observed without a host read: a skipped fused step leaves the optimizer's
    ``state["step"]`` unchanged (``_fused_adamw`` subtracts ``found_inf`` from it), so
    :attr:`found_inf` is ``step_before == step_after`` of a stepped parameter, on the device.
    """

    def __init__(self, model, optimizer, device_type: str, dtype, scaler: dict | None):
        super().__init__(model, optimizer)
        self.device_type, self.dtype = device_type, dtype
        self.grad_scaler = torch.amp.GradScaler(
            device_type, enabled=scaler is not None, **(scaler or {})
        )
        self._found: torch.Tensor | None = None

    def forward_context(self) -> contextlib.AbstractContextManager:
        """``torch.autocast(device_type, dtype)``."""
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        """``grad_scaler.scale(loss).backward()``."""
        self.grad_scaler.scale(loss).backward()

    def _watched(self):
        # the first parameter this step updates (one without a grad is never stepped)
        return next(
            (p for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None),
            None,
        )

    def _step_count(self, p) -> torch.Tensor:
        count = self.optimizer.state.get(p, {}).get("step")
        if isinstance(count, torch.Tensor):
            return count.detach().float().reshape(1)
        return torch.full((1,), float(count or 0), device=p.device)

    def step(self) -> None:
        """``grad_scaler.step(optimizer)``, ``grad_scaler.update()``; notes whether it skipped."""
        p = self._watched()
        before = self._step_count(p).clone() if p is not None and self.skips else None
        self.grad_scaler.step(self.optimizer)
        self.grad_scaler.update()
        if before is not None:
            self._found = (self._step_count(p) == before).float()

    @property
    def found_inf(self) -> torch.Tensor:
        """1 when the last step was skipped (its ``state["step"]`` did not advance), else 0."""
        return self._found if self._found is not None else self._device_zero()

    @property
    def scale(self) -> torch.Tensor:
        """The scaler's scale tensor (1 when the scaler is disabled)."""
        # GradScaler.get_scale() reads the scale on the host (.item()); its tensor is kept in
        # _scale, which _get_scale_async returns as is (None before the first scale()).
        scale = self.grad_scaler._get_scale_async() if self.skips else None
        return super().scale if scale is None else scale.reshape(1)

    @property
    def skips(self) -> bool:
        """True where the scaler is enabled (fp16): it skips a step with inf/NaN grads."""
        return self.grad_scaler.is_enabled()


class CompiledTorchAmpStep(TorchAmpStep):
    """:class:`TorchAmpStep` training through ``torch.compile(model)`` (the loss and the
    backward call stay outside the compiled region; AOTAutograd compiles the model's backward).

    Args:
        model, optimizer, device_type, dtype, scaler: as for :class:`TorchAmpStep`.
        budget_s: the seconds a caller allows the compile (:attr:`compile_budget_s`).

    :attr:`model` is the compiled wrapper (it shares ``model``'s parameters); :attr:`module`
    the eager model, for evaluation, whose other modes (eval, no_grad) would compile again.
    """

    def __init__(self, model, optimizer, device_type: str, dtype, scaler, budget_s: float):
        super().__init__(model, optimizer, device_type, dtype, scaler)
        self.model = torch.compile(model)
        self.compile_budget_s = budget_s
