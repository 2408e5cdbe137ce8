"""Apex's ``FusedScaleMaskSoftmax`` and the autograd functions over mpnb's softmax kernels.

``FusedScaleMaskSoftmax`` computes ``softmax(mask(scores * scale))`` over the last dim of
``[b, np, sq, sk]`` attention scores. It takes the fused kernel whenever fusion is on and the
mask fits (``[b or 1, np or 1, sq, sk]``, or no mask, or causal); otherwise it runs the
PyTorch expression with the user's ``mask_func``, exactly as Apex does. Inside a
``torch.autocast`` region the fused functions run in the region's dtype (Apex's rule).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from mpnb.core.amp.casts import in_autocast_dtype
from mpnb.core.ops import softmax as ops
from mpnb.core.transformer.enums import AttnMaskType

__all__ = [
    "FusedScaleMaskSoftmax",
    "FusedSoftmaxConfigError",
    "scaled_softmax",
    "scaled_masked_softmax",
    "scaled_upper_triang_masked_softmax",
    "generic_scaled_masked_softmax",
    "attention_mask_func",
]


class FusedSoftmaxConfigError(ValueError, RuntimeError):
    """A :class:`FusedScaleMaskSoftmax` configuration that cannot work (both half flags, a
    scale without ``softmax_in_fp32``, an unknown mask type).

    A ``ValueError`` (a bad argument) that is also the ``RuntimeError`` Apex raises there, so
    code catching either keeps working.
    """


def attention_mask_func(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Megatron's mask function: masked (True) scores become -10000."""
    return scores.masked_fill(mask, ops.MASKED_VALUE)


def scaled_softmax(input: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """``softmax(input * scale, -1)``, fused (fp32 math for half input)."""
    return in_autocast_dtype(ops.scaled_softmax_fwd, input, scale)


def scaled_masked_softmax(input: torch.Tensor, mask: torch.Tensor, scale: float = 1.0):
    """Fused ``softmax(masked_fill(input * scale, mask, -10000), -1)`` for ``[b, np, sq, sk]``."""
    return in_autocast_dtype(ops.scaled_masked_softmax_fwd, input, mask, scale)


def generic_scaled_masked_softmax(input: torch.Tensor, mask: torch.Tensor, scale: float = 1.0):
    """Apex's generic (any ``sk``) masked softmax: as :func:`scaled_masked_softmax`, except that
    a row whose every position is masked attends to nothing (all zeros, zero gradient)."""
    return ops.generic_scaled_masked_softmax_fwd(input, mask, scale)


def scaled_upper_triang_masked_softmax(input: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    """Causal fused softmax of ``[attn_batches, sq, sq]`` scores (no mask tensor)."""
    return in_autocast_dtype(ops.scaled_upper_triang_masked_softmax_fwd, input, scale)


class FusedScaleMaskSoftmax(nn.Module):
    """Fused ``scale -> mask -> softmax`` over attention scores (Apex/Megatron API).

    Args:
        input_in_fp16: the scores are fp16.
        input_in_bf16: the scores are bf16.
        attn_mask_type: :class:`AttnMaskType` ``padding`` (mask tensor) or ``causal``.
        scaled_masked_softmax_fusion: use the fused kernel when the inputs fit it.
        mask_func: ``(scores, mask) -> masked scores`` for the unfused path.
        softmax_in_fp32: compute the unfused softmax in fp32 (the kernel always does).
        scale: multiply the scores by this first (``None``: no scaling).

    Example::

        >>> sm = FusedScaleMaskSoftmax(False, True, AttnMaskType.causal, True,
        ...                            attention_mask_func, True, 0.125)
        >>> sm(torch.randn(2, 4, 16, 16, dtype=torch.bfloat16), None).shape
        torch.Size([2, 4, 16, 16])
    """

    def __init__(
        self,
        input_in_fp16: bool,
        input_in_bf16: bool,
        attn_mask_type: AttnMaskType,
        scaled_masked_softmax_fusion: bool,
        mask_func: Callable | None,
        softmax_in_fp32: bool,
        scale: float | None,
    ) -> None:
        super().__init__()
        if input_in_fp16 and input_in_bf16:
            raise FusedSoftmaxConfigError(
                "FusedScaleMaskSoftmax: input_in_fp16 and input_in_bf16 cannot both "
                "be True; set the one that matches the scores' dtype."
            )
        if not isinstance(attn_mask_type, AttnMaskType):
            raise FusedSoftmaxConfigError(
                f"FusedScaleMaskSoftmax: attn_mask_type must be an AttnMaskType (padding or "
                f"causal), got {attn_mask_type!r}."
            )
        if not (scale is None or softmax_in_fp32):
            raise FusedSoftmaxConfigError(
                "FusedScaleMaskSoftmax: a scale needs softmax_in_fp32=True (as in "
                "Apex); pass softmax_in_fp32=True or scale=None."
            )
        self.input_in_fp16, self.input_in_bf16 = input_in_fp16, input_in_bf16
        self.input_in_float16 = input_in_fp16 or input_in_bf16
        self.attn_mask_type = attn_mask_type
        self.scaled_masked_softmax_fusion = scaled_masked_softmax_fusion
        self.mask_func = mask_func or attention_mask_func
        self.softmax_in_fp32 = softmax_in_fp32
        self.scale = scale

    def forward(self, input: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """Probabilities of the ``[b, np, sq, sk]`` scores under ``mask`` (True = masked)."""
        if input.dim() != 4:
            raise ValueError(
                f"FusedScaleMaskSoftmax: scores must be [b, np, sq, sk], got shape "
                f"{tuple(input.shape)}."
            )
        if self.is_kernel_available(mask, *input.shape):
            return self.forward_fused_softmax(input, mask)
        return self.forward_torch_softmax(input, mask)

    def is_kernel_available(self, mask: torch.Tensor | None, b: int, np: int, sq: int, sk: int):
        """True when the fused kernel can take these scores (any size on the CPU)."""
        if not self.scaled_masked_softmax_fusion:
            return False
        if self.attn_mask_type == AttnMaskType.causal:
            return sq == sk
        if mask is None:
            return True
        return (
            mask.dim() == 4
            and mask.dtype in (torch.bool, torch.uint8)
            and mask.shape[0] in (1, b)
            and mask.shape[1] in (1, np)
            and tuple(mask.shape[2:]) == (sq, sk)
        )

    def forward_fused_softmax(self, input: torch.Tensor, mask: torch.Tensor | None):
        """The fused kernels (fp32 math, output in the input dtype)."""
        scale = self.scale if self.scale is not None else 1.0
        if self.attn_mask_type == AttnMaskType.causal:
            b, np, sq, sk = input.shape
            probs = scaled_upper_triang_masked_softmax(input.reshape(-1, sq, sk), scale)
            return probs.view(b, np, sq, sk)
        if mask is not None:
            return scaled_masked_softmax(input, mask, scale)
        return scaled_softmax(input, scale)

    def forward_torch_softmax(self, input: torch.Tensor, mask: torch.Tensor | None):
        """The unfused PyTorch expression (Apex's fallback)."""
        dtype = input.dtype
        if self.input_in_float16 and self.softmax_in_fp32:
            input = input.float()
        if self.scale is not None:
            input = input * self.scale
        if self.attn_mask_type == AttnMaskType.causal and mask is None:
            sq, sk = input.shape[-2:]
            mask = torch.ones(sq, sk, dtype=torch.bool, device=input.device).triu(1)[None, None]
        masked = self.mask_func(input, mask) if mask is not None else input
        probs = torch.softmax(masked, dim=-1)
        return probs.to(dtype) if self.input_in_float16 and self.softmax_in_fp32 else probs
