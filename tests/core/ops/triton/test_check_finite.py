"""Triton ``multi_tensor_check_finite`` against its reference (CPU interpreter, or the GPU when
there is one; see conftest.py): every inf and NaN found by its bits, no finite value taken
for one, the flag only ever raised, the tensors never written, one launch per list."""

from __future__ import annotations

import pytest
import torch

from mpnb.core.ops import reference_multi_tensor_check_finite

from .triton_cases import SIZES, gen, kernel, on, poison, randn, triton_as_kernels

DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
#: dtype -> (integer of its width, mantissa bits): the raw bits of the special values
_BITS = {
    torch.float16: (torch.int16, 10),
    torch.bfloat16: (torch.int16, 7),
    torch.float32: (torch.int32, 23),
    torch.float64: (torch.int64, 52),
}
CHUNK = 8192  # elements per program of the chunk table (mpnb.core.ops.triton._chunks.CHUNK)
#: sizes crossing the chunk boundary several times, with an empty tensor
LONG = (*SIZES, 3 * CHUNK + 5)


def _pattern(dtype, sign: int, exponent: int, mantissa: int) -> torch.Tensor:
    """The one value of ``dtype`` with these raw fields."""
    itype, mbits = _BITS[dtype]
    width = torch.iinfo(itype).bits
    raw = (sign << (width - 1)) | (exponent << mbits) | mantissa
    if raw >= 1 << (width - 1):  # as the signed integer of the same bits
        raw -= 1 << width
    return torch.tensor([raw], dtype=itype).view(dtype)


def _nonfinite(dtype) -> list[torch.Tensor]:
    """inf, -inf, and NaNs of every payload bit alone (alternating signs), all bits, quiet only."""
    _, mbits = _BITS[dtype]
    top = (1 << (_BITS[dtype][0].itemsize * 8 - 1 - mbits)) - 1  # the exponent all ones
    out = [_pattern(dtype, s, top, 0) for s in (0, 1)]
    out += [_pattern(dtype, b % 2, top, 1 << b) for b in range(mbits)]
    out += [_pattern(dtype, s, top, (1 << mbits) - 1) for s in (0, 1)]
    return out


def _both(device, tensors, flag_dtype=torch.int32, start=0):
    """The flags the kernel (on ``device``) and the reference (on the CPU) leave."""
    fk = torch.full((1,), start, dtype=flag_dtype, device=device)
    fr = torch.full((1,), start, dtype=flag_dtype)
    kernel("multi_tensor_check_finite")(fk, on(device, tensors))
    reference_multi_tensor_check_finite(fr, tensors)
    return fk.cpu().item(), fr.item()


@pytest.mark.parametrize("dtype", DTYPES)
def test_finite_lists_leave_the_flag_down(device, dtype):
    g = gen(1)
    ts = [randn(n, dtype, g, 100.0) for n in LONG]
    assert _both(device, ts) == (0, 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_every_nan_payload_and_both_infs_raise_it(device, dtype):
    g = gen(2)
    base = [randn(n, dtype, g) for n in (1, 1025, 2 * CHUNK + 5)]
    # at a chunk's first and last element, in the last chunk's tail, in a one-element tensor
    spots = [(2, CHUNK), (2, CHUNK - 1), (2, 2 * CHUNK + 4), (0, 0), (1, 1024)]
    for k, value in enumerate(_nonfinite(dtype)):
        ts = [t.clone() for t in base]
        i, j = spots[k % len(spots)]
        ts[i][j] = value[0]
        assert _both(device, ts) == (1, 1), (value.view(_BITS[dtype][0]).item(), i, j)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_no_finite_half_value_raises_it(device, dtype):
    """Every one of the 16-bit patterns that is finite (the largest, subnormals, -0)."""
    every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    finite = every[torch.isfinite(every)]
    assert finite.numel() == 2**16 - (2 if dtype == torch.float16 else 2) * 2 ** _BITS[dtype][1]
    assert _both(device, [finite]) == (0, 0)
    assert _both(device, [every]) == (1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_largest_and_smallest_finite_values_do_not_raise_it(device, dtype):
    info = torch.finfo(dtype)
    _, mbits = _BITS[dtype]
    top = (1 << (_BITS[dtype][0].itemsize * 8 - 1 - mbits)) - 1
    edges = [info.max, -info.max, info.tiny, -info.tiny, info.smallest_normal, 0.0, -0.0]
    ts = [torch.tensor(edges, dtype=dtype)]
    # the exponent one below all ones with every mantissa (max), all zeros with all ones
    ts += [
        torch.cat([_pattern(dtype, s, e, (1 << mbits) - 1) for s in (0, 1)]) for e in (top - 1, 0)
    ]
    ts += [torch.cat([_pattern(dtype, s, 0, 1) for s in (0, 1)])]  # the smallest subnormals
    assert _both(device, ts) == (0, 0)


@pytest.mark.parametrize("flag_dtype", [torch.int32, torch.float32, torch.bool, torch.int64])
def test_a_raised_flag_stays_raised_and_any_flag_dtype_works(device, flag_dtype):
    g = gen(3)
    ts = [randn(n, torch.bfloat16, g) for n in SIZES]
    assert _both(device, ts, flag_dtype, start=1) == (1, 1)  # finite: still raised
    poison(ts, g, count=1)
    assert _both(device, ts, flag_dtype) == (1, 1)
    assert _both(device, ts, flag_dtype, start=1) == (1, 1)


def test_empty_lists_and_empty_tensors(device):
    for start in (0, 1):
        assert _both(device, [], start=start) == (start, start)
        empty = [torch.empty(0, dtype=torch.bfloat16) for _ in range(3)]
        assert _both(device, empty, start=start) == (start, start)


def test_many_tensors_of_odd_sizes(device):
    g = gen(4)
    numels = [int(n) for n in torch.randint(1, 2 * CHUNK, (120,), generator=g)]
    ts = [randn(n, torch.float16, g) for n in numels]
    assert _both(device, ts) == (0, 0)
    ts[101][numels[101] - 1] = float("-inf")  # the last element of a late tensor
    assert _both(device, ts) == (1, 1)


@pytest.mark.parametrize("dtype", DTYPES)
def test_views_at_odd_addresses(device, dtype):
    """Slices of one flat buffer (not 16-byte aligned: read element by element) beside an
    aligned tensor whose last elements are not a whole 16-byte group."""
    g = gen(7)
    flat = randn(3 * CHUNK, dtype, g).to(device)
    cuts = [(1, 1000), (1003, CHUNK + 1010), (CHUNK + 1011, 3 * CHUNK - 1)]
    views = [flat[a:b] for a, b in cuts] + [randn(CHUNK + 13, dtype, g).to(device)]
    assert {v.data_ptr() % 16 != 0 for v in views} == {True, False}
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    kernel("multi_tensor_check_finite")(flag, views)
    assert flag.item() == 0
    for i, j in [(0, 998), (1, CHUNK), (2, 5), (3, CHUNK + 12), (3, CHUNK - 1)]:
        old = views[i][j].clone()
        views[i][j] = float("nan")
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        kernel("multi_tensor_check_finite")(flag, views)
        views[i][j] = old
        assert flag.item() == 1, (i, j)


def test_the_tensors_are_only_read(device):
    g = gen(5)
    ts = on(device, [randn(n, torch.bfloat16, g) for n in LONG])
    ts[-1][CHUNK + 3] = _nonfinite(torch.bfloat16)[5][0]  # a NaN with a payload bit
    before = [t.view(torch.int16).clone() for t in ts]
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    kernel("multi_tensor_check_finite")(flag, ts)
    assert flag.item() == 1
    for t, b in zip(ts, before, strict=True):
        assert torch.equal(t.view(torch.int16), b)  # bit for bit, the NaN's payload too


def test_one_launch_for_a_list_of_76():
    from mpnb.core.ops.triton._common import counting_launches

    g = gen(6)
    ts = [randn(n, torch.bfloat16, g) for n in range(1, 5 * 76, 5)]
    flag = torch.zeros(1, dtype=torch.int32)
    with counting_launches() as names:
        kernel("multi_tensor_check_finite")(flag, ts)
        kernel("multi_tensor_check_finite")(flag, ts)  # the cached table: still one launch
    assert names == ["_check_finite_kernel"] * 2


def test_through_the_dispatcher_channels_last_too(device):
    from mpnb.core.ops import multi_tensor_check_finite

    x = torch.randn(2, 3, 4, 5).to(device, torch.bfloat16, memory_format=torch.channels_last)
    flag = torch.zeros(1, dtype=torch.int32, device=device)
    with triton_as_kernels(device) as called:
        multi_tensor_check_finite(flag, [x])
        assert flag.item() == 0
        x[1, 2, 3, 4] = float("nan")
        multi_tensor_check_finite(flag, [x])
    assert "multi_tensor_check_finite" in called and flag.item() == 1


@pytest.mark.parametrize(
    "tensors,err",
    [
        ([torch.ones(3), torch.ones(2).half()], "share a dtype"),
        ([torch.ones(3, dtype=torch.int32)], "supported dtypes"),
    ],
)
def test_bad_lists_get_the_ops_named_error(device, tensors, err):
    with pytest.raises((ValueError, TypeError), match=err):
        kernel("multi_tensor_check_finite")(torch.zeros(1, device=device), on(device, tensors))


def test_a_flag_elsewhere_is_refused(device):
    with pytest.raises(ValueError, match="noop_flag is on"):
        kernel("multi_tensor_check_finite")(
            torch.zeros(1, device="meta"), [torch.ones(2, device=device)]
        )
