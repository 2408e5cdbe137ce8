"""``mpnb.lab.diagnosis``: trace_overflow finds a planted overflow; underflow_report."""

import torch
from torch import nn

import mpnb.lab


class Scale(nn.Module):
    """Multiplies by a constant: 1e5 overflows fp16 (max 65504), not bf16."""

    def __init__(self, s):
        super().__init__()
        self.s = s

    def forward(self, x):
        return x * self.s


def _planted():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Scale(1e5), nn.Linear(16, 4))


def test_trace_overflow_finds_the_planted_layer_under_fp16():
    model = _planted()
    before = [p.clone() for p in model.parameters()]
    r = mpnb.lab.trace_overflow(model, torch.randn(4, 8), dtype=torch.float16)
    assert (r.module, r.phase) == ("2", "forward")
    assert r.op == "aten.mul.Tensor"
    assert "keep `2` (Scale) in fp32" in r.advice
    row = r.table[(r.table.module == "2") & (r.table.phase == "forward")].iloc[0]
    assert row.absmax > 65504 and row.status == "overflow"
    first = r.table[(r.table.module == "0") & (r.table.phase == "forward")].iloc[0]
    assert first.status == "ok"
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert next(model.parameters()).dtype == torch.float32  # the user's model is untouched


def test_trace_overflow_bf16_has_fp32_range():
    r = mpnb.lab.trace_overflow(_planted(), torch.randn(4, 8), dtype=torch.bfloat16)
    assert r.module is None and "nothing to keep" in r.advice


def test_underflow_report_flushes_less_with_a_larger_scale():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    r = mpnb.lab.underflow_report(
        model,
        torch.randn(4, 8),
        loss_fn=lambda o: o.mean() * 1e-6,
        dtype=torch.float16,
        loss_scale=(1.0, 2.0**16),
    )
    s = r.summary.set_index("loss_scale")
    assert s.loc[1.0, "flushed"] > 0.1 and s.loc[2.0**16, "flushed"] == 0
    assert r.histogram["count"].sum() == s.loc[1.0, "nonzero"]
    assert r.thresholds["min_normal"] == -14 and r.thresholds["min_subnormal"] == -24
    assert set(r.params.loss_scale) == {1.0, 2.0**16}
