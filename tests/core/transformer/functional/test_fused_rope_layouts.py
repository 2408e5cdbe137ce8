"""RoPE on the layouts attention code holds: ``[s, b, h, d]``, ``[b, s, h, d]`` and
``[b, h, s, d]``, contiguous and as the strided views of one another (``q.transpose(1, 2)``...).

For each layout x view x dtype, forward and backward (through autograd): the kernel against the
reference and against the contiguous ``[s, b, h, d]`` computation it must equal; the output laid
out as the input (``torch.empty_like``); no copy of the input or the output on the way (the
profiler records every aten op the C++ kernel calls); the layout errors.
"""

from __future__ import annotations

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

import mpnb.core.ops as ops
from mpnb.core.ops.rotary import LAYOUTS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
S, B, H, D, D2 = 7, 3, 2, 40, 32

# (layout passed, the memory order of the tensor made, the view passed): every layout
# contiguous, and each as the view of the others' memory.
_MEMORY = {"sbhd": (S, B, H, D), "bshd": (B, S, H, D), "bhsd": (B, H, S, D)}
_VIEW = {  # (layout passed, memory) -> the permutation from memory to the layout's dims
    ("sbhd", "sbhd"): (0, 1, 2, 3),
    ("sbhd", "bshd"): (1, 0, 2, 3),
    ("sbhd", "bhsd"): (2, 0, 1, 3),
    ("bshd", "bshd"): (0, 1, 2, 3),
    ("bshd", "bhsd"): (0, 2, 1, 3),
    ("bshd", "sbhd"): (1, 0, 2, 3),
    ("bhsd", "bhsd"): (0, 1, 2, 3),
    ("bhsd", "bshd"): (0, 2, 1, 3),
    ("bhsd", "sbhd"): (1, 2, 0, 3),
}
CASES = list(_VIEW)


def _ids(case):
    layout, memory = case
    return layout if layout == memory else f"{layout}-view-of-{memory}"


def _dt(dtype):
    return str(dtype).removeprefix("torch.")


def _tables():
    inv = 1.0 / 10000 ** (torch.arange(0, D2, 2, dtype=torch.float64) / D2)
    f = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    f = torch.cat([f, f], -1).float()
    return f.cos(), f.sin()


def _make(case, dtype, seed, grad=False):
    """A fresh leaf in ``memory`` order and its view in ``layout``'s dims."""
    layout, memory = case
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(_MEMORY[memory], generator=g, dtype=torch.float64).to(dtype)
    base.requires_grad_(grad)
    return base, base.permute(_VIEW[case])


def _to_sbhd(x, layout):
    return x.permute([layout.index(c) for c in "sbhd"])


@pytest.mark.parametrize("stepwise", [False, True], ids=["once", "stepwise"])
@pytest.mark.parametrize("dtype", DTYPES, ids=_dt)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_kernel_matches_reference_on_every_layout(kernels, case, dtype, stepwise):
    layout = case[0]
    cos, sin = _tables()
    base, t = _make(case, dtype, 0, grad=True)
    y = ops.rope(t, cos, sin, D2, stepwise=stepwise, layout=layout)
    _, dy = _make(case, dtype, 1)
    (gbase,) = torch.autograd.grad(y, base, dy)
    g = gbase.permute(_VIEW[case])  # the gradient of the view, in the layout's dims
    t = t.detach()
    # the reference, on the same view (kernel and reference agree bitwise)
    want = ops.reference_rope(t, cos, sin, D2, stepwise=stepwise, layout=layout)
    want_g = ops.reference_rope(dy, cos, sin, D2, False, True, stepwise, layout=layout)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    torch.testing.assert_close(g, want_g, rtol=0, atol=0)
    # and what the contiguous [s, b, h, d] kernel gives on a copy
    flat = ops.rope(_to_sbhd(t, layout).contiguous(), cos, sin, D2, stepwise=stepwise)
    flat_g = ops.rope(_to_sbhd(dy, layout).contiguous(), cos, sin, D2, False, True, stepwise)
    torch.testing.assert_close(_to_sbhd(y, layout), flat, rtol=0, atol=0)
    torch.testing.assert_close(_to_sbhd(g, layout), flat_g, rtol=0, atol=0)


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_output_is_laid_out_as_the_input(op_impl, case):
    layout = case[0]
    cos, sin = _tables()
    _, t = _make(case, torch.bfloat16, 2)
    y = ops.rope(t, cos, sin, D2, layout=layout)
    assert y.shape == t.shape
    assert y.stride() == t.stride()  # a dense view: its own strides
    # a view that is not dense (sliced out of a fused [s, b, h, 3d] QKV tensor): dense, in the
    # input's memory order (torch.empty_like's rule)
    qkv = torch.randn(S, B, H, 3 * D).to(torch.bfloat16).permute(_VIEW[(layout, "sbhd")])
    q = qkv[..., :D]
    y = ops.rope(q, cos, sin, D2, layout=layout)
    assert y.shape == q.shape and _to_sbhd(y, layout).is_contiguous()
    want = ops.rope(q.contiguous(), cos, sin, D2, layout=layout)
    torch.testing.assert_close(y, want, rtol=0, atol=0)


def _copies(fn):
    """The aten ops that copy a tensor among those ``fn`` runs (the C++ kernel's own calls
    included: the profiler records every op the dispatcher runs)."""
    copying = ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    return [e.name for e in prof.events() if e.name in copying]


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_no_copy_on_any_layout(kernels, case):
    if not kernels:
        pytest.skip("MPNB_DISABLE_EXT=1: the reference runs, and it copies")
    layout = case[0]
    cos, sin = _tables()
    base, t = _make(case, torch.bfloat16, 3, grad=True)
    _, dy = _make(case, torch.bfloat16, 4)

    def fwd_bwd():
        torch.autograd.grad(ops.rope(t, cos, sin, D2, layout=layout), base, dy)

    assert _copies(fwd_bwd) == []
    # the check sees a copy where there is one: a last dim of stride 2 is copied first
    wide = torch.randn(_MEMORY[case[1]][:3] + (2 * D,)).permute(_VIEW[case])[..., ::2]
    assert _copies(lambda: ops.rope(wide, cos, sin, D2, layout=layout)) != []


def test_layout_errors_name_the_fix(op_impl):
    cos, sin = _tables()
    t = torch.randn(B, H, S, D)
    with pytest.raises(ValueError, match="layout 'bsdh'"):
        ops.rope(t, cos, sin, D2, layout="bsdh")
    with pytest.raises(ValueError, match=r"table \[s=3"):
        ops.rope(t, cos, sin, D2)  # [b, h, s, d] passed as the default "sbhd": s is 3
    with pytest.raises(ValueError, match="drop it"):
        ops.rope(t, cos, sin, D2, True, layout="bhsd")
    with pytest.raises(ValueError, match=r"t must be \[b, h, s, d\]"):
        ops.rope(t[0], cos, sin, D2, layout="bhsd")
    assert LAYOUTS == ("sbhd", "bshd", "bhsd")


def test_apex_form_takes_views_and_keeps_apexs_layout_for_sliced_heads(op_impl):
    from mpnb.transformer.functional import fused_apply_rotary_pos_emb

    inv = 1.0 / 10000 ** (torch.arange(0, D2, 2, dtype=torch.float64) / D2)
    f = torch.outer(torch.arange(S, dtype=torch.float64), inv)
    freqs = torch.cat([f, f], -1)[:, None, None, :].float()
    q = torch.randn(B, H, S, D).permute(2, 0, 1, 3)  # [b, h, s, d] seen as [s, b, h, d]
    y = fused_apply_rotary_pos_emb(q, freqs)
    assert y.stride() == q.stride()
    torch.testing.assert_close(y, fused_apply_rotary_pos_emb(q.contiguous(), freqs))
    # heads sliced out of a fused [s, b, h, 3d] tensor: contiguous, as Apex's result
    qs = torch.randn(S, B, H, 3 * D)[..., :D]
    assert fused_apply_rotary_pos_emb(qs, freqs).is_contiguous()


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_long_rows_walk_positions_in_blocks(kernels, case):
    # d=520: the kernel walks 3 positions per block (2048 // d), so s=17 makes five full blocks
    # and a partial one, in every layout's walk order
    layout, memory = case
    s, d, d2 = 17, 520, 512
    g = torch.Generator().manual_seed(5)
    shape = {"s": s, "b": 2, "h": 3, "d": d}
    t = torch.randn([shape[c] for c in memory], generator=g).to(torch.bfloat16)
    t = t.permute(_VIEW[case])
    ang = torch.randn(s, d2, generator=g)
    y = ops.rope(t, ang.cos(), ang.sin(), d2, layout=layout)
    want = ops.reference_rope(t, ang.cos(), ang.sin(), d2, layout=layout)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert y.stride() == t.stride()


@pytest.mark.parametrize("case", [("bhsd", "bshd"), ("sbhd", "bhsd")], ids=_ids)
def test_opcheck_on_views(kernels, case):
    # the fake's strides (torch.compile's) are the kernel's, and autograd is registered
    cos, sin = _tables()
    _, t = _make(case, torch.float32, 6, grad=True)
    torch.library.opcheck(ops.rotary.OP.overload, (t, cos, sin, D2, False, False, False, case[0]))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_d_not_innermost_is_copied_and_the_output_contiguous(op_impl, layout):
    # a dense t whose d is not its innermost dim (the gradient autograd hands over after an
    # einsum can be one): t is copied, the output is contiguous, the values are right
    cos, sin = _tables()
    shape = {"s": S, "b": B, "h": H, "d": D}
    t = torch.randn([D] + [shape[c] for c in layout[:3]]).to(torch.bfloat16).permute(1, 2, 3, 0)
    assert t.stride(-1) != 1 and t.permute(3, 0, 1, 2).is_contiguous()
    for backward in (False, True):
        y = ops.rope(t, cos, sin, D2, False, backward, layout=layout)
        assert y.is_contiguous()
        want = ops.rope(t.contiguous(), cos, sin, D2, False, backward, layout=layout)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
    # and through autograd, with such a gradient
    base = t.detach().contiguous().requires_grad_(True)
    dy = torch.randn([D] + [shape[c] for c in layout[:3]]).to(torch.bfloat16).permute(1, 2, 3, 0)
    (g,) = torch.autograd.grad(ops.rope(base, cos, sin, D2, layout=layout), base, dy)
    want = ops.rope(dy.contiguous(), cos, sin, D2, False, True, layout=layout)
    torch.testing.assert_close(g, want, rtol=0, atol=0)
