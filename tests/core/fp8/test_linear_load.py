"""FP8 layers across recipes and dtypes: a checkpoint of another recipe is named, not raw."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mpnb.core.fp8 import convert_to_float8_training
from mpnb.core.fp8.linear import Float8Linear


def test_delayed_state_into_an_mxfp8_layer_names_both_recipes():
    saved = Float8Linear(64, 32, recipe="delayed").state_dict()
    layer = Float8Linear(64, 32, recipe="mxfp8")
    before = layer.weight.detach().clone()
    with pytest.raises(ValueError, match=r"'delayed'.*mxfp8") as e:
        layer.load_state_dict(saved)
    assert "recipe=" in str(e.value)  # the fix: build the layer with the checkpoint's recipe
    assert torch.equal(layer.weight, before)  # nothing loaded


def test_delayed_model_checkpoint_into_an_mxfp8_model_is_refused_before_any_load():
    def model():
        return nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32))

    saved = convert_to_float8_training(model(), "delayed").state_dict()
    target = convert_to_float8_training(model(), "mxfp8")
    first = target[0].weight.detach().clone()
    with pytest.raises(ValueError, match=r"'0'.*'delayed' recipe"):
        target.load_state_dict(saved, strict=False)
    assert torch.equal(target[0].weight, first)


def test_plain_linear_checkpoint_still_loads_into_any_recipe():
    plain = nn.Linear(64, 32)
    for rec in ("delayed", "mxfp8", "tensorwise"):
        layer = Float8Linear(64, 32, recipe=rec)
        layer.load_state_dict(plain.state_dict())
        assert torch.equal(layer.weight, plain.weight)


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_float64_layer_trains(recipe):
    """``.to(torch.float64)`` casts the delayed recipe's buffers too; its float32 amax and
    scale math must still fit them (was: 'value cannot be converted to type float')."""
    layer = Float8Linear(64, 32, recipe=recipe).to(torch.float64)
    for _ in range(2):
        layer(torch.randn(16, 64, dtype=torch.float64)).sum().backward()
    assert layer.weight.grad.dtype == torch.float64
    if recipe == "delayed":
        assert torch.isfinite(layer.fp8_scale).all() and (layer.fp8_amax_history[0] > 0).all()


def test_half_buffers_clamp_to_their_own_range():
    """Buffers cast to fp16 keep the clamp at fp16's max (no inf in the history)."""
    layer = Float8Linear(64, 32, recipe="delayed").half()
    x = torch.full((16, 64), 1e4, dtype=torch.float16)
    with torch.no_grad():
        layer.weight.fill_(1e-3)
    layer(x)
    assert torch.isfinite(layer.fp8_amax_history).all()
