"""The troubleshooting diagnoses: GEMM sizes for tensor cores, step overhead, inf/NaN advice."""

import math

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.lab.troubleshoot import OverheadReport, _overhead_advice, overhead_share


class Attention(nn.Module):
    """A bmm in the module's own forward, after its child Linear ran."""

    def __init__(self, d):
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, -1)
        return torch.softmax(q @ k.transpose(1, 2), -1) @ v


def test_gemm_shapes_lists_each_gemm_with_its_sizes_and_module():
    model = nn.Sequential(nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 1001))
    before = [p.clone() for p in model.parameters()]
    r = mpnb.lab.gemm_shapes(model, torch.randn(6, 100))
    t = r.table
    assert list(t.module) == ["0", "2"] and list(t.op) == ["addmm", "addmm"]
    assert (t.m.tolist(), t.n.tolist(), t.k.tolist()) == ([6, 6], [64, 1001], [100, 64])
    assert r.multiple == 8 and not t.aligned.any()
    assert t.pad.tolist() == ["m=6->8, k=100->104", "m=6->8, n=1001->1008"]
    assert "2 of 2 GEMMs" in r.advice and "1001 -> 1008" in r.advice
    assert "cpu has no tensor cores" in r.advice and not r.tensor_cores
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_gemm_shapes_names_the_module_running_a_bmm_after_its_child():
    r = mpnb.lab.gemm_shapes(Attention(16), torch.randn(2, 8, 16))
    t = r.table
    assert list(zip(t.module, t.op, t.m, t.n, t.k, strict=True)) == [
        ("qkv", "addmm", 16, 48, 16),  # the batch and sequence dims are flattened into m
        ("(model)", "bmm", 8, 8, 16),  # q @ k^T, back in the parent once qkv returned
        ("(model)", "bmm", 8, 16, 8),  # scores @ v
    ]
    assert r.misaligned.empty and "all 3 GEMMs" in r.advice


@pytest.mark.parametrize(
    "dtype, multiple",
    [(torch.float16, 8), (torch.bfloat16, 8), (torch.float8_e4m3fn, 16), (torch.float32, 4)],
)
def test_gemm_shapes_wants_16_bytes_of_the_dtype(dtype, multiple):
    r = mpnb.lab.gemm_shapes(nn.Linear(12, 12), torch.randn(12, 12), dtype=dtype)
    assert r.multiple == multiple
    assert r.table.aligned.tolist() == [12 % multiple == 0]


def test_gemm_shapes_reads_a_convolution_as_its_implicit_gemm():
    r = mpnb.lab.gemm_shapes(nn.Conv2d(3, 16, 3, padding=1), torch.randn(2, 3, 5, 5))
    row = r.table.iloc[0]
    assert (row.op, row.m, row.n, row.k) == ("convolution", 2 * 5 * 5, 16, 3)
    assert row.pad == "m=50->56, k=3->8"


def test_overhead_share_inverts_the_linear_model():
    # t(b) = 3 + 1 * b at b = 2: t = 5; at 8b = 16: t = 19, ratio 3.8 -> fixed 3/5
    assert overhead_share(19 / 5, 8) == pytest.approx(3 / 5)
    assert overhead_share(1.0, 8) == 1.0 and overhead_share(8.0, 8) == 0.0
    assert overhead_share(0.5, 8) == 1.0 and overhead_share(9.0, 8) == 0.0  # clamped
    with pytest.raises(ValueError, match="must be > 1"):
        overhead_share(1.0, 1)


def test_step_overhead_report_is_consistent_and_leaves_the_model_alone():
    model = nn.Linear(16, 4)
    before = [p.clone() for p in model.parameters()]
    r = mpnb.lab.step_overhead(model, (torch.randn(4, 16),), factor=4, rounds=3)
    assert (r.batch, r.factor) == (4, 4) and r.small_ms > 0 and r.large_ms > 0
    assert r.share == overhead_share(r.ratio, 4)
    assert r.bound == ("overhead" if r.share > 0.5 else "compute")
    assert f"4x the batch took {r.ratio:.2f}x the time" in r.advice
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(ValueError, match="batched tensor"):
        mpnb.lab.step_overhead(model, {"mask": None})


def test_step_overhead_advice_says_when_other_processes_competed():
    r = OverheadReport(8, 8, 1.0, 1.5, 1.5, (1.2, 1.8), overhead_share(1.5, 8), "overhead")
    r.load = dict(start=[6.0, 5.0, 4.0], end=None, threads=2, cpus=2, competed=True)
    text = _overhead_advice(r, torch.device("cpu"))
    assert "overhead-bound" in text and "load average 6.0 on 2 CPUs" in text
    r.load["competed"] = False
    assert "competed" not in _overhead_advice(r, torch.device("cpu"))


class NaiveSoftmax(nn.Module):
    def forward(self, x):
        e = (x * 40).exp()
        return e / e.sum(-1, keepdim=True)


def test_trace_overflow_advice_names_an_overflow_inside_a_module_whose_output_fits():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), NaiveSoftmax(), nn.Linear(16, 2))
    r = mpnb.lab.trace_overflow(model, torch.randn(4, 8), dtype=torch.float16)
    assert (r.module, r.op, r.phase) == ("1", "aten.exp.default", "forward")
    row = r.table[(r.table.module == "1") & (r.table.phase == "forward")].iloc[0]
    assert row.absmax <= 1.0 + 1e-6  # probabilities: the module's output fits fp16
    assert "inside it, aten.exp.default gives inf/NaN in fp16" in r.advice
    assert "beyond fp16's max" not in r.advice
    assert math.isfinite(row.absmax)
