"""Triton ``multi_tensor_scale`` against its reference (CPU interpreter, or the GPU when there
is one; see conftest.py)."""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import (
    reference_multi_tensor_scale,
)

from .triton_cases import SIZES, bitwise, gen, kernel, on, poison, randn

PAIRS = [
    (torch.bfloat16, torch.float32),  # the unscale of a half backward into fp32 masters
    (torch.float16, torch.float32),
    (torch.float32, torch.float32),
    (torch.float32, torch.bfloat16),
    (torch.float32, torch.float16),
    (torch.float64, torch.float64),
]


def _scale_both(device, src, dst_dtype, scale, st, in_place=False, flag_dtype=torch.int32):
    outs = []
    for fn, dev in ((kernel("multi_tensor_scale"), device), (reference_multi_tensor_scale, "cpu")):
        s = on(dev, src)
        d = s if in_place else [torch.full_like(t, 7, dtype=dst_dtype) for t in s]
        flag = torch.zeros(1, dtype=flag_dtype, device=dev)
        fn(flag, s, d, scale, None if st is None else st.to(dev))
        outs.append((d, flag.cpu()))
    return outs


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS)
@pytest.mark.parametrize("with_tensor", [False, True])
def test_scale_matches_reference(device, src_dtype, dst_dtype, with_tensor):
    g = gen(1)
    src = [randn(n, src_dtype, g, 100.0) for n in SIZES]
    st = torch.tensor([0.37], dtype=torch.float64) if with_tensor else None
    (dk, fk), (dr, fr) = _scale_both(device, src, dst_dtype, 1 / 3, st)
    bitwise(dk, dr)
    assert fk.item() == fr.item() == 0


@pytest.mark.parametrize("src_dtype,dst_dtype", PAIRS[:4])
def test_scale_flags_inf_nan_and_still_writes(device, src_dtype, dst_dtype):
    g = gen(2)
    src = [randn(n, src_dtype, g) for n in SIZES]
    poison(src, g)
    (dk, fk), (dr, fr) = _scale_both(device, src, dst_dtype, 0.5, None, flag_dtype=torch.float32)
    bitwise(dk, dr)
    assert fk.item() == fr.item() == 1.0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_scale_in_place(device, dtype):
    g = gen(3)
    src = [randn(n, dtype, g) for n in SIZES]
    (dk, fk), (dr, fr) = _scale_both(device, src, dtype, 1 / 1024, None, in_place=True)
    bitwise(dk, dr)


def test_scale_empty_list_and_flag_kept(device):
    flag = torch.ones(1, dtype=torch.int32, device=device)
    kernel("multi_tensor_scale")(flag, [], [], 2.0)
    out = torch.empty(3, device=device)
    kernel("multi_tensor_scale")(flag, [torch.ones(3, device=device)], [out], 2.0)
    assert flag.item() == 1 and out.tolist() == [2.0] * 3  # a set flag is never cleared


def test_scale_bool_flag(device):
    flag = torch.zeros(1, dtype=torch.bool, device=device)
    src = torch.tensor([1.0, float("nan")], device=device)
    kernel("multi_tensor_scale")(flag, [src], [torch.empty(2, device=device)], 1.0)
    assert flag.item() is True


@pytest.mark.parametrize(
    "src,dst,err",
    [
        ([torch.ones(3)], [torch.ones(4)], "4 elements but its partner has 3"),
        ([torch.ones(3)], [], "has 0 tensors"),
        ([torch.ones(3), torch.ones(2).half()], [torch.ones(3), torch.ones(2)], "share a dtype"),
        ([torch.ones(4, 2).t()], [torch.ones(8)], "not contiguous"),
        ([torch.ones(3).double()], [torch.ones(3)], "float64 lists"),
        ([torch.ones(3, dtype=torch.int32)], [torch.ones(3)], "supported dtypes"),
    ],
)
def test_scale_refuses_bad_lists(device, src, dst, err):
    with pytest.raises((ValueError, TypeError), match=err):
        kernel("multi_tensor_scale")(
            torch.zeros(1, device=device), on(device, src), on(device, dst), 1.0
        )


def test_scale_refuses_a_flag_elsewhere(device):
    with pytest.raises(ValueError, match="noop_flag is on"):
        kernel("multi_tensor_scale")(
            torch.zeros(1, device="meta"),
            [torch.ones(2, device=device)],
            [torch.ones(2, device=device)],
            1.0,
        )
