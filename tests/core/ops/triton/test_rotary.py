"""The Triton RoPE kernel against its reference (CPU interpreter, or the GPU when there is one):
fp32, fp16, bf16 (and fp64), odd and empty shapes, every layout."""

from __future__ import annotations

import itertools

import pytest
import torch

import mpnb.core.ops as R

from .triton_cases import close, gen, kernel, on, poison, randn

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
HALF_OR_32 = [torch.float32, torch.float16, torch.bfloat16]

# ---- RoPE ----------------------------------------------------------------------------------

# (s, b, h, d, rotary dims d2, group): whole rows rotated, a partial rotary dim with the rest
# passing through, several groups, one head, empty.
ROPE = [(5, 2, 3, 8, 8, 8), (3, 1, 2, 10, 4, 2), (4, 2, 1, 12, 8, 4), (0, 2, 2, 4, 4, 4)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ROPE, ids=str)
def test_rope_matches_reference(device, ulps, dtype, case):
    s, b, h, d, d2, group = case
    g = gen(30)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    angles = torch.randn(s, d2, generator=g).to(acc)
    cos, sin = angles.cos(), angles.sin()
    inputs = [randn((s, b, h, d), dtype, g), randn((b, s, h, d), dtype, g).transpose(0, 1)]
    if dtype != torch.float64 and s:
        poison(inputs[:1], g, count=2)
    for t in inputs:
        for transpose_output in (False, True):
            for backward, stepwise in itertools.product((False, True), (False, True)):
                args = (group, transpose_output, backward, stepwise)
                got = kernel("rope")(*on(device, [t, cos, sin]), *args)
                want = R.reference_rope(t, cos, sin, *args)
                close(got, want, ulps)
                if transpose_output:  # laid out as [b, s, h, d] in memory
                    assert got.transpose(0, 1).is_contiguous()


def test_rope_refuses_bad_tables(device):
    t = torch.ones(4, 1, 2, 8, device=device)
    with pytest.raises(ValueError, match="must be a float32 table"):
        kernel("rope")(t, torch.ones(3, 8, device=device), torch.ones(3, 8, device=device), 8)
    with pytest.raises(ValueError, match="even group"):
        kernel("rope")(t, torch.ones(4, 6, device=device), torch.ones(4, 6, device=device), 4)


# [b, s, h, d] and [b, h, s, d] contiguous, and each as the strided view of another layout's
# memory (what attention code holds): (layout passed, memory made, permutation memory -> layout)
ROPE_LAYOUTS = [
    ("bshd", (2, 5, 3, 12), (0, 1, 2, 3)),
    ("bshd", (2, 3, 5, 12), (0, 2, 1, 3)),
    ("bhsd", (2, 3, 5, 12), (0, 1, 2, 3)),
    ("bhsd", (2, 5, 3, 12), (0, 2, 1, 3)),
    ("sbhd", (2, 3, 5, 12), (2, 0, 1, 3)),
]


@pytest.mark.parametrize("dtype", HALF_OR_32)
@pytest.mark.parametrize("case", ROPE_LAYOUTS, ids=str)
def test_rope_layouts_match_reference(device, ulps, dtype, case):
    layout, memory, perm = case
    g = gen(31)
    angles = torch.randn(5, 8, generator=g)
    cos, sin = angles.cos(), angles.sin()
    t = randn(memory, dtype, g).to(device).permute(perm)
    for backward, stepwise in itertools.product((False, True), (False, True)):
        args = (8, False, backward, stepwise, layout)
        got = kernel("rope")(t, *on(device, [cos, sin]), *args)
        want = R.reference_rope(t.cpu(), cos, sin, *args[:4], layout=layout)
        close(got, want, ulps)
        assert got.stride() == t.stride()  # laid out as the input
