"""Apex's fused rotary position embedding: ``sbhd``, cached, ``thd`` and 2-D (image) forms.

All four build fp32 cos/sin tables (small: one row per position) and call one kernel that
reads ``t`` once and writes the result once; gradients flow to ``t`` only (the frequencies
are not differentiated, as in Apex).

Rounding: for fp16/bf16 ``t`` the result is computed in fp32 and rounded once (mpnb's rule,
the more accurate). ``stepwise=True`` rounds as Apex's kernel does, and as
``t * cos + rotate_half(t) * sin`` does in ``t``'s dtype: the tables are cast to ``t``'s
dtype, each product and the sum are rounded to it (:func:`mpnb.core.ops.rope`). Code run
under the Apex alias gets that rule (:mod:`mpnb.compat.transformer_functional`).
"""

from __future__ import annotations

import torch

from mpnb.core.ops._checks import acc_dtype
from mpnb.core.ops.rotary import rope

__all__ = [
    "fused_apply_rotary_pos_emb",
    "fused_apply_rotary_pos_emb_cached",
    "fused_apply_rotary_pos_emb_thd",
    "fused_apply_rotary_pos_emb_2d",
]


def _table(op: str, x: torch.Tensor, s: int, name: str, t: torch.Tensor) -> torch.Tensor:
    """``[s, 1, 1, d2]`` (or ``[s, d2]``) frequencies/cos/sin -> a contiguous ``[s, d2]`` table."""
    if (
        not isinstance(x, torch.Tensor)
        or x.dim() not in (2, 4)
        or x.shape[0] != s
        or (x.dim() == 4 and (x.shape[1] != 1 or x.shape[2] != 1))
    ):
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{op}: {name} must be [s={s}, 1, 1, d2], got {shape}.")
    return x.reshape(s, x.shape[-1]).to(acc_dtype(t)).contiguous()


def _check_t(op: str, t: torch.Tensor, dims: int, layout: str) -> None:
    # The layout only: the op checks the dtype (and the tables) itself.
    if t.dim() != dims:
        raise ValueError(f"{op}: t must be [{layout}], got shape {tuple(t.shape)}.")


def fused_apply_rotary_pos_emb(
    t: torch.Tensor,
    freqs: torch.Tensor,
    transpose_output_memory: bool = False,
    *,
    stepwise: bool = False,
) -> torch.Tensor:
    """RoPE of ``t`` ``[s, b, h, d]`` by ``freqs`` ``[s, 1, 1, d2]`` (``d2 <= d``, even).

    ``y = t * cos(freqs) + rotate_half(t) * sin(freqs)`` on the first ``d2`` channels.
    ``stepwise``: Apex's rounding (see the module docstring).

    ``t`` may be contiguous or a strided view (last dim of stride 1), such as
    ``q.permute(2, 0, 1, 3)`` of a ``[b, h, s, d]`` tensor: no copy is made and every view runs
    at the contiguous speed. The result has ``t``'s memory layout (``torch.empty_like(t)``:
    contiguous for a contiguous ``t`` or heads sliced out of a contiguous ``[s, b, h, 3d]``
    tensor, as Apex's; a permuted view gets its own strides, where Apex's is contiguous), or
    ``[b, s, h, d]`` memory with ``transpose_output_memory``. For ``[b, s, h, d]`` and
    ``[b, h, s, d]`` tensors without the permute, see :func:`mpnb.core.ops.rope`'s ``layout``.

    Example::

        >>> t = torch.randn(16, 2, 4, 64)
        >>> inv = 1.0 / 10000 ** (torch.arange(0, 32, 2) / 32)
        >>> f = torch.outer(torch.arange(16.0), inv)
        >>> freqs = torch.cat([f, f], -1)[:, None, None, :]  # [16, 1, 1, 32]
        >>> fused_apply_rotary_pos_emb(t, freqs).shape
        torch.Size([16, 2, 4, 64])
    """
    op = "fused_apply_rotary_pos_emb"
    _check_t(op, t, 4, "s, b, h, d")
    f = _table(op, freqs, t.shape[0], "freqs", t)
    return rope(t, torch.cos(f), torch.sin(f), f.shape[1], transpose_output_memory, False, stepwise)


def fused_apply_rotary_pos_emb_cached(
    t: torch.Tensor,
    cos_: torch.Tensor,
    sin_: torch.Tensor,
    transpose_output_memory: bool = False,
    *,
    stepwise: bool = False,
) -> torch.Tensor:
    """RoPE with precomputed ``cos_``/``sin_`` ``[s, 1, 1, d2]`` (fp32 or ``t``'s dtype);
    ``stepwise``: Apex's rounding. ``t``'s layouts and the result's: as
    :func:`fused_apply_rotary_pos_emb`."""
    op = "fused_apply_rotary_pos_emb_cached"
    _check_t(op, t, 4, "s, b, h, d")
    c = _table(op, cos_, t.shape[0], "cos_", t)
    s = _table(op, sin_, t.shape[0], "sin_", t)
    if c.shape != s.shape:
        raise ValueError(f"{op}: cos_ {tuple(cos_.shape)} and sin_ {tuple(sin_.shape)} differ.")
    return rope(t, c, s, c.shape[1], transpose_output_memory, False, stepwise)


def fused_apply_rotary_pos_emb_thd(
    t: torch.Tensor, cu_seqlens: torch.Tensor, freqs: torch.Tensor, *, stepwise: bool = False
) -> torch.Tensor:
    """RoPE of packed sequences ``t`` ``[total, h, d]``; ``cu_seqlens`` ``[b + 1]`` (int).

    Token ``k`` of sequence ``i`` (``cu_seqlens[i] <= k < cu_seqlens[i + 1]``) gets position
    ``k - cu_seqlens[i]``; ``freqs`` ``[max_s, 1, 1, d2]`` covers the longest sequence.
    ``stepwise``: Apex's rounding.
    """
    op = "fused_apply_rotary_pos_emb_thd"
    _check_t(op, t, 3, "t, h, d")
    cu = cu_seqlens.to(device=t.device, dtype=torch.long)
    if cu.dim() != 1 or cu.numel() < 1 or int(cu[0]) != 0 or int(cu[-1]) != t.shape[0]:
        raise ValueError(
            f"{op}: cu_seqlens must run from 0 to t.shape[0]={t.shape[0]}, got "
            f"{cu_seqlens.tolist()}."
        )
    lengths = cu.diff()
    if bool((lengths < 0).any()):
        raise ValueError(f"{op}: cu_seqlens must be non-decreasing, got {cu_seqlens.tolist()}.")
    f = _table(op, freqs, freqs.shape[0], "freqs", t)
    if lengths.numel() and int(lengths.max()) > f.shape[0]:
        raise ValueError(
            f"{op}: freqs has {f.shape[0]} positions but a sequence has "
            f"{int(lengths.max())}; pass freqs for the longest sequence."
        )
    pos = torch.arange(t.shape[0], device=t.device) - cu[:-1].repeat_interleave(lengths)
    f = f[pos]
    cos, sin = torch.cos(f), torch.sin(f)
    return rope(t.unsqueeze(1), cos, sin, f.shape[1], False, False, stepwise).squeeze(1)


def fused_apply_rotary_pos_emb_2d(
    t: torch.Tensor,
    img_h: int,
    img_w: int,
    cos_h: torch.Tensor,
    sin_h: torch.Tensor,
    cos_w: torch.Tensor,
    sin_w: torch.Tensor,
    *,
    stepwise: bool = False,
) -> torch.Tensor:
    """2-D RoPE of image tokens ``t`` ``[b, img_h * img_w, h, d]`` (row-major tokens).

    The first ``d/2`` channels rotate by the token's row (``cos_h``/``sin_h`` ``[1, H, 1, d/2]``,
    ``H >= img_h``), the last ``d/2`` by its column (``cos_w``/``sin_w`` ``[1, W, 1, d/2]``).
    ``stepwise``: Apex's rounding.
    """
    op = "fused_apply_rotary_pos_emb_2d"
    _check_t(op, t, 4, "b, img_h * img_w, h, d")
    b, s, h, d = t.shape
    if s != img_h * img_w or d % 4:
        raise ValueError(
            f"{op}: t {tuple(t.shape)} needs s == img_h * img_w ({img_h}*{img_w}) and "
            "a head dim divisible by 4."
        )
    tabs = []
    for name, x, n in (
        ("cos_h", cos_h, img_h),
        ("sin_h", sin_h, img_h),
        ("cos_w", cos_w, img_w),
        ("sin_w", sin_w, img_w),
    ):
        if (
            x.dim() != 4
            or x.shape[0] != 1
            or x.shape[2] != 1
            or x.shape[3] != d // 2
            or x.shape[1] < n
        ):
            raise ValueError(
                f"{op}: {name} must be [1, >= {n}, 1, {d // 2}], got {tuple(x.shape)}."
            )
        tabs.append(x[0, :, 0, :].to(acc_dtype(t)))
    rows = torch.arange(s, device=t.device) // img_w
    cols = torch.arange(s, device=t.device) % img_w
    cos = torch.cat([tabs[0][rows], tabs[2][cols]], -1).contiguous()
    sin = torch.cat([tabs[1][rows], tabs[3][cols]], -1).contiguous()
    return rope(t, cos, sin, d // 2, False, False, stepwise, layout="bshd")
