"""FP8 state across checkpoints and conversions, and power-of-two scales at their edges."""

from __future__ import annotations

import copy

import pytest
import torch

from mpnb import fp8

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _model():
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    model = fp8.convert_to_float8_training(net, "delayed")
    for _ in range(2):
        model(torch.randn(4, 8)).sum().backward()
    return model


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize(
    "key, value",
    [
        ("2.fp8_scale", float("nan")),
        ("2.fp8_scale", 0.0),
        ("2.fp8_scale", -1.0),
        ("2.fp8_amax_history", float("inf")),
        ("2.fp8_amax_history", -3.0),
    ],
)
def test_corrupt_fp8_state_is_refused_before_anything_loads(key, value):
    ck = _snapshot(_model())
    ck["0.weight"] = torch.zeros_like(ck["0.weight"])  # loaded first, were it not refused
    ck[key][0] = value
    model = _model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=rf"'2'.*{key}.*must be .*Nothing was loaded.*drop"):
        model.load_state_dict(ck)
    after = model.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())
    x = torch.randn(4, 8)
    assert torch.isfinite(model(x)).all()


def test_a_lone_layer_refuses_a_corrupt_scale_too():
    layer = fp8.Float8Linear(8, 4, recipe="delayed")
    sd = copy.deepcopy(layer.state_dict())
    sd["fp8_scale"][1] = float("nan")
    with pytest.raises(ValueError, match="fp8_scale has 1 value"):
        layer.load_state_dict(sd)
    assert torch.equal(layer.fp8_scale, torch.ones(3))


def test_a_healthy_checkpoint_and_a_plain_linear_one_still_load():
    model = _model()
    other = _model()
    other.load_state_dict(model.state_dict())
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    other.load_state_dict(plain.state_dict())
    assert torch.equal(other[0].fp8_scale, torch.ones(3))  # fresh FP8 state


@pytest.mark.parametrize("second", ["tensorwise", "rowwise", "mxfp8"])
def test_converting_a_converted_model_takes_the_new_recipe(second):
    model = _model()
    params = list(model.parameters())
    out = fp8.convert_to_float8_training(model, second)
    assert out is model
    assert [layer.recipe.name for layer in fp8.float8_layers(model).values()] == [second] * 2
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert "0.fp8_scale" not in model.state_dict()  # the delayed recipe's state is gone
    same = fp8.convert_to_float8_training(model, second)
    assert all(isinstance(m, fp8.Float8Linear) for m in (same[0], same[2]))


def test_converting_again_with_the_same_recipe_keeps_the_state():
    model = _model()
    history = model[0].fp8_amax_history.clone()
    layer = model[0]
    fp8.convert_to_float8_training(model, "delayed")
    assert model[0] is layer and torch.equal(model[0].fp8_amax_history, history)


def _just_above(top: float, k: int, ulps: int) -> torch.Tensor:
    a = torch.tensor(top / 2.0**k, dtype=torch.float32)
    for _ in range(ulps):
        a = torch.nextafter(a, torch.tensor(float("inf")))
    return a


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_power_of_two_scales_equal_the_reference_a_few_ulps_above_max_over_2k(dtype):
    top = fp8.fp8_max(dtype)
    amaxes = [_just_above(top, k, n) for k in range(-12, 30) for n in range(0, 5)]
    x = torch.zeros(len(amaxes), 16)
    x[:, 3] = torch.stack(amaxes)
    x[:, 7] = -x[:, 3] / 3
    op = fp8.quantize_rowwise(x, dtype, power_of_2=True)
    q, inv = fp8.reference_quantize_rowwise(x, dtype, power_of_2=True)
    assert torch.equal(op.dequant_scale, inv)
    assert torch.equal(op.data.view(torch.uint8), q.view(torch.uint8))
    # the scale is the largest power of two under which the row's amax does not clip
    scale = op.dequant_scale.reciprocal().flatten()
    assert (x[:, 3] * scale <= top).all() and (x[:, 3] * scale * 2 > top).all()
    for a in amaxes[::7]:
        t = fp8.quantize_tensorwise(torch.stack([a, -a / 3]), dtype, power_of_2=True)
        assert torch.equal(t.dequant_scale, 1.0 / fp8.reference_scale(a.item(), dtype, True))
