"""SyncBatchNorm: the Welford kernels, the module in one process, and 2 gloo ranks vs BatchNorm
(also a ResNet block with ReLU(inplace=True) after each SyncBN).

The 2-rank checks run inside one launch; each rank holds a slice of one global batch (slices
of different sizes, one of them empty) and compares with ``nn.BatchNorm`` on the whole batch.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from mpnb.core.ops.welford import (
    reference_welford_mean_var,
    reference_welford_parallel,
    welford_mean_var,
    welford_parallel,
)
from mpnb.parallel import SyncBatchNorm, convert_syncbn_model, launch

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16]
SHAPES = [
    ((7, 5), False),
    ((4, 3, 33), False),
    ((3, 6, 4, 5), False),
    ((2, 3, 2, 3, 4), False),
    ((9, 17), True),
    ((2, 5, 6, 19), True),
    ((1200, 40), True),
    ((300, 2, 70), False),
    ((0, 4, 3), False),
    ((0, 6), True),
]
BN = {
    2: torch.nn.BatchNorm1d,
    3: torch.nn.BatchNorm1d,
    4: torch.nn.BatchNorm2d,
    5: torch.nn.BatchNorm3d,
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,channel_last", SHAPES)
def test_welford_kernel_matches_reference(kernels, dtype, shape, channel_last):
    x = (torch.randn(shape, dtype=torch.float64) * 3 + 5).to(dtype)
    got = welford_mean_var(x, channel_last)
    want = reference_welford_mean_var(x, channel_last)
    for g, w in zip(got, want, strict=True):
        assert g.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        tol = 1e-12 if dtype == torch.float64 else 3e-6
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)


def test_welford_parallel_matches_reference_with_an_empty_rank(kernels):
    mean, var = torch.randn(3, 6, dtype=torch.float64), torch.rand(3, 6, dtype=torch.float64)
    count = torch.tensor([5.0, 0.0, 11.0], dtype=torch.float64)
    got, want = welford_parallel(mean, var, count), reference_welford_parallel(mean, var, count)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    # merging the halves of a batch gives the statistics of the whole batch
    x = torch.randn(16, 6, dtype=torch.float64)
    parts = [welford_mean_var(h, True) for h in (x[:5], x[5:])]
    m, v = welford_parallel(
        torch.stack([p[0] for p in parts]),
        torch.stack([p[1] for p in parts]),
        torch.tensor([5.0, 11.0], dtype=torch.float64),
    )
    torch.testing.assert_close(v, x.var(0, correction=0), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(m, x.mean(0), rtol=1e-12, atol=1e-12)


def test_welford_opcheck(kernels):
    if not kernels:
        pytest.skip("kernels disabled (MPNB_DISABLE_EXT=1)")
    for x, cl in ((torch.randn(4, 3, 5), False), (torch.randn(6, 7).bfloat16(), True)):
        torch.library.opcheck(torch.ops.mpnb.welford_mean_var, (x, cl))
    args = (torch.randn(2, 3), torch.rand(2, 3), torch.tensor([2.0, 3.0]))
    torch.library.opcheck(torch.ops.mpnb.welford_parallel, args)


def test_welford_errors_name_the_fix():
    with pytest.raises(ValueError, match="channel dim"):
        welford_mean_var(torch.randn(5))
    with pytest.raises(TypeError, match="one floating dtype"):
        welford_parallel(torch.zeros(2, 3), torch.zeros(2, 3), torch.tensor([1, 2]))


def _pair(shape, seed=0, **kw):
    torch.manual_seed(seed)
    ref = BN[len(shape)](shape[1], **kw)
    if ref.affine:
        ref.weight.data.uniform_(0.5, 1.5)
        ref.bias.data.uniform_(-0.5, 0.5)
    return ref, convert_syncbn_model(ref)


@pytest.mark.parametrize("shape", [(6, 4), (5, 4, 7), (3, 4, 3, 5), (2, 4, 2, 3, 3)])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_single_process_matches_batchnorm(kernels, shape, momentum):
    ref, ours = _pair(shape, momentum=momentum)
    assert isinstance(ours, SyncBatchNorm) and ours is not ref
    for _ in range(2):
        x = torch.randn(shape, requires_grad=True)
        x2 = x.detach().clone().requires_grad_()
        g = torch.randn(shape)
        y_ref = ref(x)
        (y_ref * g).sum().backward()
        y = ours(x2)
        (y * g).sum().backward()
        torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x2.grad, x.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.weight.grad, ref.weight.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    torch.testing.assert_close(ours.running_var, ref.running_var)
    ref.eval()
    ours.eval()
    x = torch.randn(shape)
    torch.testing.assert_close(ours(x), ref(x), rtol=1e-5, atol=1e-5)


def test_fuse_relu_residual_and_channel_layouts(kernels):
    ref, ours = _pair((4, 6, 3, 5))
    ours.fuse_relu = True
    x, z = torch.randn(4, 6, 3, 5), torch.randn(4, 6, 3, 5)
    want = torch.relu(ref(x) + z)
    torch.testing.assert_close(ours(x, z), want, rtol=1e-5, atol=1e-5)
    # torch.channels_last memory format is read in place and keeps its layout
    xcl = x.to(memory_format=torch.channels_last)
    y = ours(xcl, z)
    assert y.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    # channel_last=True: (N, H, W, C) tensors
    nhwc = convert_syncbn_model(ref, channel_last=True)
    y = nhwc(x.permute(0, 2, 3, 1).contiguous())
    torch.testing.assert_close(y.permute(0, 3, 1, 2), ref(x), rtol=1e-5, atol=1e-5)


def test_bad_channel_count_names_the_fix():
    with pytest.raises(ValueError, match="channel_last=True"):
        SyncBatchNorm(5)(torch.randn(4, 3, 5))
    with pytest.raises(ValueError, match="more than 1"):
        SyncBatchNorm(3)(torch.randn(1, 3))


# ---- two ranks ------------------------------------------------------------------------------

CASES = {  # name: (global shape, rows of rank 0, layout kw, input dtype)
    "2d_equal": ((8, 4, 3, 3), 4, {}, torch.float32),
    "2d_unequal": ((8, 4, 3, 3), 3, {}, torch.float32),
    "1d_unequal": ((9, 5), 2, {}, torch.float32),
    "1d_seq": ((7, 5, 6), 5, {}, torch.float32),
    "3d": ((5, 3, 2, 3, 2), 2, {}, torch.float32),
    "empty_rank": ((6, 4, 5), 6, {}, torch.float32),
    "channel_last": ((8, 4, 3, 3), 3, {"channel_last": True}, torch.float32),
    "fuse_relu": ((8, 4, 3, 3), 5, {"fuse_relu": True}, torch.float32),
    "bf16": ((8, 4, 3, 3), 3, {}, torch.bfloat16),
}


def _rank_case(shape, n0, kw, dtype):
    r = dist.get_rank()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype).float() * 2 + 1
    dy = torch.randn(shape, generator=g)
    ref = BN[len(shape)](shape[1]).double()
    ref.weight.data.uniform_(0.5, 1.5, generator=g)
    ref.bias.data.uniform_(-0.5, 0.5, generator=g)
    ours = convert_syncbn_model(ref, channel_last=kw.get("channel_last", False)).float()
    ours.fuse_relu = kw.get("fuse_relu", False)
    xd = x.double().requires_grad_()
    y_ref = ref(xd)
    if ours.fuse_relu:
        y_ref = torch.relu(y_ref)
    (y_ref * dy.double()).sum().backward()
    sl = slice(0, n0) if r == 0 else slice(n0, shape[0])
    xs = x[sl].to(dtype).requires_grad_()
    inp = xs.movedim(1, -1) if ours.channel_last else xs
    y = ours(inp)
    y = y.movedim(-1, 1) if ours.channel_last else y
    (y.float() * dy[sl]).sum().backward()
    gw = torch.stack([ours.weight.grad, ours.bias.grad])
    dist.all_reduce(gw)
    stats = torch.stack([ours.running_mean, ours.running_var])
    parts = [torch.empty_like(stats) for _ in range(2)]
    dist.all_gather(parts, stats)

    def err(a, b):
        return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0

    return {
        "y": err(y, y_ref[sl]),
        "dx": err(xs.grad, xd.grad[sl]),
        "dw": err(gw[0], ref.weight.grad),
        "db": err(gw[1], ref.bias.grad),
        "running": err(stats, torch.stack([ref.running_mean, ref.running_var])),
        "ranks_equal": err(parts[0], parts[1]),
    }


class _ResBlock(torch.nn.Module):
    """torchvision's BasicBlock: conv-BN-ReLU(inplace), conv-BN, ``out += x``, ReLU(inplace)."""

    def __init__(self, c: int, dims: int):
        super().__init__()
        if dims == 4:
            self.a = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
            self.b = torch.nn.Conv2d(c, c, 3, padding=1, bias=False)
            bn = torch.nn.BatchNorm2d
        else:
            self.a, self.b = torch.nn.Linear(c, c, bias=False), torch.nn.Linear(c, c, bias=False)
            bn = torch.nn.BatchNorm1d
        self.bn1, self.bn2 = bn(c), bn(c)
        self.relu = torch.nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.relu(self.bn1(self.a(x)))
        out = self.bn2(self.b(out))
        out += x
        return self.relu(out)


BLOCKS = {  # name: (global input shape, rows of rank 0, dtype)
    "block_4d_fp32": ((6, 4, 5, 5), 2, torch.float32),
    "block_4d_bf16": ((6, 4, 5, 5), 4, torch.bfloat16),
    "block_2d_fp32": ((10, 6), 3, torch.float32),
    "block_2d_bf16": ((10, 6), 5, torch.bfloat16),
}


def _rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def _block_case(shape, n0, dtype):
    """Each rank runs the converted block on its rows; the gradients summed over the ranks must
    equal those of one process running plain BatchNorm on the whole batch, in the same precision
    (fp32, or bf16 as amp O1 runs it: fp32 params, the forward under autocast)."""
    r = dist.get_rank()
    g = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=g)
    dy = torch.randn(shape, generator=g, dtype=torch.float64)
    torch.manual_seed(3)
    ref = _ResBlock(shape[1], len(shape))
    for bn in (ref.bn1, ref.bn2):
        bn.weight.data.uniform_(0.5, 1.5, generator=g)
        bn.bias.data.uniform_(-0.5, 0.5, generator=g)
    ours = convert_syncbn_model(ref)
    assert isinstance(ours.bn1, SyncBatchNorm) and isinstance(ours.bn2, SyncBatchNorm)
    half = dtype == torch.bfloat16
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        y_ref = ref(xr)
    (y_ref.double() * dy).sum().backward()
    sl = slice(0, n0) if r == 0 else slice(n0, shape[0])
    xs = x[sl].clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=half):
        y = ours(xs)
    assert y.dtype == dtype
    (y.double() * dy[sl]).sum().backward()
    grads = {}
    for (name, p), (_, p_ref) in zip(ours.named_parameters(), ref.named_parameters(), strict=True):
        gsum = p.grad.double()
        dist.all_reduce(gsum)
        grads[name] = _rel(gsum, p_ref.grad)
    return {"y": _rel(y, y_ref[sl].detach()), "dx": _rel(xs.grad, xr.grad[sl]), **grads}


def _all_cases():
    out = {name: _rank_case(*case) for name, case in CASES.items()}
    out.update({name: _block_case(*case) for name, case in BLOCKS.items()})
    return out


@pytest.fixture(scope="module")
def two_ranks():
    return launch(_all_cases, 2, backend="gloo", timeout=120, threads=1)


@pytest.mark.dist
@pytest.mark.parametrize("name", list(CASES))
def test_two_ranks_match_batchnorm_on_the_concatenated_batch(two_ranks, name):
    tol = 3e-2 if CASES[name][3] == torch.bfloat16 else 1e-5
    for rank, res in enumerate(two_ranks):
        r = res[name]
        assert r["ranks_equal"] == 0.0, f"rank {rank}: running stats differ across ranks"
        for key in ("y", "dx", "dw", "db", "running"):
            assert r[key] <= tol, f"rank {rank} {name}: {key} off by {r[key]:.3g}"


@pytest.mark.dist
@pytest.mark.parametrize("name", list(BLOCKS))
def test_two_ranks_resnet_block_with_inplace_relu_matches_full_batch_batchnorm(two_ranks, name):
    """conv/linear, SyncBN, ReLU(inplace=True) and ``out += x`` on 2 ranks: the output, the input
    gradient and every parameter gradient equal single-process full-batch BatchNorm's (relative
    L2 error; under bf16 autocast within bf16 rounding of the per-rank activations)."""
    tol = 1e-2 if BLOCKS[name][2] == torch.bfloat16 else 1e-5
    for rank, res in enumerate(two_ranks):
        errs = res[name]
        assert set(errs) >= {"y", "dx", "bn1.weight", "bn2.bias", "a.weight", "b.weight"}
        for key, err in errs.items():
            assert err <= tol, f"rank {rank} {name}: {key} off by {err:.3g} (relative)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(6, 4), (3, 4, 3, 5)])
@pytest.mark.parametrize("fuse_relu", [False, True])
def test_inplace_ops_after_syncbn_keep_exact_gradients(kernels, dtype, shape, fuse_relu):
    """One process: an in-place add then ReLU(inplace=True) on SyncBN's output (Apex's failure
    mode: 'Output 0 of SyncBatchnormFunction is a view and is being modified inplace')."""
    ref_bn, ours_bn = _pair(shape)
    ours_bn.fuse_relu = fuse_relu
    ours_bn.to(dtype)
    ref_bn.double()
    x = torch.randn(shape, dtype=torch.float64).to(dtype)
    dy = torch.randn(shape, dtype=torch.float64)
    xo, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    y = ours_bn(xo)
    assert y._base is None  # a fresh tensor, not a view
    y = torch.nn.functional.relu(y.add_(0.25), inplace=True)
    (y.double() * dy).sum().backward()
    y_ref = (
        torch.relu(torch.relu(ref_bn(xr)) + 0.25) if fuse_relu else torch.relu(ref_bn(xr) + 0.25)
    )
    (y_ref * dy).sum().backward()
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    assert _rel(y, y_ref.detach()) <= tol
    assert _rel(xo.grad, xr.grad) <= tol
    assert _rel(ours_bn.weight.grad, ref_bn.weight.grad) <= tol
    assert _rel(ours_bn.bias.grad, ref_bn.bias.grad) <= tol
