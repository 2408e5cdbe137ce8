"""mpnb's objects with Apex's numerics, where mpnb's default rounds differently: what the alias
serves for these names (the rows of :mod:`mpnb.compat.names` with ``rules=`` this module).

mpnb keeps its more accurate rule by default and offers Apex's as an argument of the same op
or a property of the same object; code run through the alias is Apex code and gets Apex's:

* ``FusedSGD`` with ``stepwise_rounding=True``: half params without master weights keep the
  momentum buffer in their own dtype and round every operation to it, ``torch.optim.SGD``'s
  arithmetic, which Apex's tests hold FusedSGD to (within 1e-3 of torch after 7 steps; an fp32
  buffer, and Apex's own kernel rule, fp32 math with a half buffer, are both 0.00146 away by
  the fourth step). mpnb's default keeps the fp32 buffer (as near to the exact result or, with
  momentum 0.9 and weight decay, 11% nearer).
* the four fused RoPE functions with ``stepwise=True``: Apex's kernel (cos/sin cast to the
  input's dtype, each product and the sum rounded to it), which equals its unfused reference
  ``t * cos + rotate_half(t) * sin`` in the input's dtype. mpnb's default rounds once from
  fp32.

Example::

    >>> from apex.optimizers import FusedSGD            # under the alias: this class
    >>> FusedSGD(model.half().parameters(), lr=0.1, momentum=0.9).stepwise_rounding
    True
"""

from __future__ import annotations

import torch

from mpnb.core.optimizers.fused_sgd import FusedSGD as _FusedSGD
from mpnb.core.transformer.functional import fused_rope as _rope

__all__ = [
    "FusedSGD",
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
    "fused_apply_rotary_pos_emb_2d",
]


class FusedSGD(_FusedSGD):
    """:class:`mpnb.optimizers.FusedSGD` with ``stepwise_rounding=True`` by default
    (torch.optim.SGD's rounding for half params without masters; see the module docstring)."""

    def __init__(self, *args, stepwise_rounding: bool = True, **kwargs) -> None:
        super().__init__(*args, stepwise_rounding=stepwise_rounding, **kwargs)


def fused_apply_rotary_pos_emb(
    t: torch.Tensor, freqs: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """:func:`mpnb.transformer.functional.fused_apply_rotary_pos_emb`, rounded as Apex."""
    return _rope.fused_apply_rotary_pos_emb(t, freqs, transpose_output_memory, stepwise=True)


def fused_apply_rotary_pos_emb_cached(
    t: torch.Tensor, cos_: torch.Tensor, sin_: torch.Tensor, transpose_output_memory: bool = False
) -> torch.Tensor:
    """:func:`mpnb.transformer.functional.fused_apply_rotary_pos_emb_cached`, rounded as Apex."""
    return _rope.fused_apply_rotary_pos_emb_cached(
        t, cos_, sin_, transpose_output_memory, stepwise=True
    )


def fused_apply_rotary_pos_emb_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor
) -> torch.Tensor:
    """:func:`mpnb.transformer.functional.fused_apply_rotary_pos_emb_thd`, rounded as Apex."""
    return _rope.fused_apply_rotary_pos_emb_thd(t, cu_seqlens, freqs, stepwise=True)


def fused_apply_rotary_pos_emb_2d(
    t: torch.Tensor,
    img_h: int,
    img_w: int,
    cos_h: torch.Tensor,
    sin_h: torch.Tensor,
    cos_w: torch.Tensor,
    sin_w: torch.Tensor,
) -> torch.Tensor:
    """:func:`mpnb.transformer.functional.fused_apply_rotary_pos_emb_2d`, rounded as Apex."""
    return _rope.fused_apply_rotary_pos_emb_2d(
        t, img_h, img_w, cos_h, sin_h, cos_w, sin_w, stepwise=True
    )
