"""Apex's ``apex.transformer.functional``: fused softmax and fused RoPE on mpnb's kernels."""

from mpnb.core.transformer.functional.fused_rope import (
    fused_apply_rotary_pos_emb,
    fused_apply_rotary_pos_emb_2d,
    fused_apply_rotary_pos_emb_cached,
    fused_apply_rotary_pos_emb_thd,
)
from mpnb.core.transformer.functional.fused_softmax import (
    FusedScaleMaskSoftmax,
    attention_mask_func,
    generic_scaled_masked_softmax,
    scaled_masked_softmax,
    scaled_softmax,
    scaled_upper_triang_masked_softmax,
)

__all__ = [
    "FusedScaleMaskSoftmax",
    "attention_mask_func",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_2d",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
    "generic_scaled_masked_softmax",
    "scaled_masked_softmax",
    "scaled_softmax",
    "scaled_upper_triang_masked_softmax",
]
