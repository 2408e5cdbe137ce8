"""``mpnb.lab.quant_stats``: one measured step of a copy of the model under a configuration,
or what a format would do to another configuration's step; the caller's model is untouched."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.core.fp8.stats import METRICS


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16))


def _x():
    return torch.randn(24, 32, generator=torch.Generator().manual_seed(1))


def test_a_low_precision_config_is_measured_on_a_copy():
    model = _model()
    before = [p.detach().clone() for p in model.parameters()]
    stats = mpnb.lab.quant_stats(model, _x(), "nvfp4")
    assert not stats.what_if and stats.format == "nvfp4 (TE v2.14, 2d, rht, sr)"
    df = stats.rows()
    assert df[["layer", "tensor"]].values.tolist() == [
        [n, t] for n in ("0", "2") for t in ("input", "weight", "grad_output")
    ]
    assert df[list(METRICS)].notna().all().all()
    assert all(type(m) is not nn.Linear or m.weight.grad is None for m in model.modules())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_what_if_on_fp32_measures_the_same_forward_operands_as_the_converted_step():
    model, x = _model(), _x()
    guess = mpnb.lab.quant_stats(model, x, "O0", what_if="mxfp4")
    real = mpnb.lab.quant_stats(model, x, "mxfp4")
    assert guess.what_if and guess.format == real.format == "mxfp4 (rceil scales)"
    a, b = guess.rows(), real.rows()
    first = ((a.layer == "0") & (a.tensor == "input")) | (a.tensor == "weight")
    assert a[first][list(METRICS)].values.tolist() == b[first][list(METRICS)].values.tolist()


def test_what_if_takes_a_configuration_name_and_runs_under_autocast():
    stats = mpnb.lab.quant_stats(_model(), _x(), "O1", what_if="nvfp4-no-rht")
    assert stats.format == "nvfp4 (TE v2.14, 2d, sr)"
    assert len(stats.rows()) == 6


def test_errors_name_the_fix():
    with pytest.raises(ValueError, match="Drop what_if.*'O0', 'O1'"):
        mpnb.lab.quant_stats(_model(), _x(), "nvfp4", what_if="mxfp4")
    with pytest.raises(ValueError, match="names no number format") as e:
        mpnb.lab.quant_stats(_model(), _x(), "O0", what_if="O2")
    assert "use a recipe" in str(e.value)  # the fix
    with pytest.raises(ValueError, match="no parameters"):
        mpnb.lab.quant_stats(nn.GELU(), _x(), "nvfp4")
