"""The FP8 recipes: ``recipe()`` and its errors, the delayed scales against the reference, MXFP8's
scale rounding rule in a layer, and delayed scaling under underflow and overflow, against a
TransformerEngine-style simulation.

The simulation below restates TransformerEngine's delayed-scaling update in a few lines: an amax
history (newest first), reduced by ``max``; ``scale = fp8_max / amax / 2**margin``, clamped to
the largest finite float32; the previous scale kept when the reduced amax is 0 or non-finite.
mpnb follows it step for step on finite data. Where an amax is inf (an overflowing step), mpnb
does not record it, so the scale recovers at once instead of staying frozen for the history's
length, and the inf reaches the output and the gradients, so a loss scaler skips the step.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from mpnb import amp, fp8
from mpnb.core.precision import PRECISION_CONFIGS

E4M3 = torch.float8_e4m3fn
BIG = torch.finfo(torch.float32).max


def test_recipe_errors_name_the_fix():
    with pytest.raises(ValueError, match="valid choices") as e:
        fp8.recipe("blockwise")
    assert all(name in str(e.value) for name in fp8.RECIPES)
    with pytest.raises(ValueError, match="'max' or 'most_recent'"):
        fp8.DelayedScaling(amax_compute_algo="mean")
    with pytest.raises(ValueError, match="int >= 1"):
        fp8.DelayedScaling(amax_history_len=0)
    with pytest.raises(ValueError, match="'hybrid'"):
        fp8.TensorwiseScaling(fp8_format="e5m2")
    with pytest.raises(ValueError, match="see help"):
        fp8.recipe("rowwise", amax_history_len=3)
    assert fp8.recipe("delayed").amax_history_len == 1024  # TransformerEngine's defaults
    assert fp8.recipe("delayed").amax_compute_algo == "max" and fp8.recipe("delayed").margin == 0


@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len, margin", [(3, 0), (1024, 1)])
def test_delayed_scales_follow_the_amax_history(algo, history_len, margin):
    """Per step, the scale a layer used equals the reference over the same amaxes."""
    rec = fp8.DelayedScaling(amax_history_len=history_len, amax_compute_algo=algo, margin=margin)
    layer = fp8.Float8Linear(16, 16, bias=False, recipe=rec)
    amaxes = [2.0, 40.0, 0.5, 0.0, 3.0, 0.25, 7.0]
    used = []
    for a in amaxes:
        used.append(layer.fp8_scale[0].item())
        x = torch.zeros(4, 16)
        x[0, 0] = a
        layer(x)
    ref = fp8.reference_delayed_scales(amaxes, E4M3, history_len, algo, margin)
    assert used == ref
    assert layer.fp8_amax_history[: min(history_len, 7), 0].tolist() == amaxes[::-1][:history_len]
    layer.eval()  # eval forwards use the scales without recording
    before = layer.fp8_amax_history.clone()
    layer(torch.randn(4, 16) * 100)
    assert torch.equal(layer.fp8_amax_history, before)


def test_delayed_quantization_uses_the_previous_steps_scale():
    layer = fp8.Float8Linear(16, 16, bias=False, recipe="delayed")
    x = torch.full((2, 16), 1000.0)  # step 1: scale 1.0, so 1000 saturates at 448
    layer(x)
    s = layer.fp8_scale[0]
    assert s.item() == pytest.approx(448 / 1000)
    op = fp8.quantize_with_scale(x, s, E4M3, "tensorwise")
    q, inv = fp8.reference_quantize_tensorwise(x, E4M3, scale=s)
    assert torch.equal(op.data.view(torch.uint8), q.view(torch.uint8)) and torch.equal(
        op.dequant_scale, inv
    )


def test_the_mxfp8_recipe_rounds_scales_up_by_default_and_names_its_rule():
    rec = fp8.recipe("mxfp8")
    assert rec.scale_rounding == "rceil" and rec.label == "mxfp8 (rceil scales)"
    floor = fp8.recipe("mxfp8", scale_rounding="floor")
    assert floor.label == "mxfp8 (floor scales)" and "floor" in repr(floor)
    assert "RCEIL" in PRECISION_CONFIGS["mxfp8"].description
    with pytest.raises(ValueError, match="'rceil'.*'floor'"):
        fp8.MXFP8BlockScaling(scale_rounding="nearest")
    layer = fp8.Float8Linear(64, 8, recipe=floor)
    with pytest.warns(fp8.Float8FallbackWarning, match="floor scales"):
        layer(torch.randn(4, 64))


@pytest.mark.parametrize("rounding", ["rceil", "floor"])
def test_a_layer_follows_the_reference_with_either_rounding(rounding):
    torch.manual_seed(0)
    layer = fp8.Float8Linear(64, 32, recipe=fp8.MXFP8BlockScaling(scale_rounding=rounding))
    x = torch.randn(16, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        y = layer(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    ref = fp8.reference_float8_linear(
        x.detach(),
        layer.weight.detach(),
        layer.bias.detach(),
        gy,
        (E4M3, E4M3),
        "mx",
        mx_rounding=rounding,
    )
    for got, want in zip((y, x.grad, layer.weight.grad), ref[:3], strict=False):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-6)


# ---- delayed scaling under underflow and overflow ----------------------------------------


class TESimulation:
    """TransformerEngine's delayed scaling for one tensor role (the update after each step)."""

    def __init__(self, fp8_max: float, history_len: int, margin: int = 0):
        self.fp8_max, self.margin = fp8_max, margin
        self.history = torch.zeros(history_len, dtype=torch.float32)
        self.scale = torch.ones((), dtype=torch.float32)

    def record(self, amax: float) -> None:
        self.history = torch.roll(self.history, 1)
        self.history[0] = amax  # recorded as computed, inf included
        reduced = self.history.max()
        new = torch.tensor(self.fp8_max, dtype=torch.float32) / reduced / 2.0**self.margin
        new = torch.where(torch.isinf(new), torch.tensor(BIG), new)
        keep = ~((reduced > 0) & torch.isfinite(reduced))
        self.scale = torch.where(keep, self.scale, new)


def _layer(history_len=16, margin=0):
    rec = fp8.DelayedScaling(amax_history_len=history_len, margin=margin)
    return fp8.Float8Linear(8, 4, recipe=rec)


def _x(amax: float, rows=2):
    x = torch.zeros(rows, 8)
    x[0, 0] = amax
    x[1, 1:] = amax / 3
    return x


def _drive(layer, amaxes):
    """The input scale a layer holds after each forward/backward with the given input amax."""
    out = []
    for a in amaxes:
        layer(_x(a)).float().sum().backward()
        out.append(layer.fp8_scale[0].clone())
    return out


def test_a_tiny_amax_gives_the_largest_finite_scale_and_the_next_step_stays_finite():
    model = fp8.convert_to_float8_training(torch.nn.Linear(4, 4), "delayed")
    model(torch.full((2, 4), 1e-38)).sum().backward()
    assert model.fp8_scale[0].item() == BIG  # 448 / 1e-38 overflows float32
    x = torch.tensor([[0.0, 1.0, -2.0, 3.0], [0.5, 0.0, 0.0, 0.0]])
    y = model(x)
    assert torch.isfinite(y).all()  # was all NaN (0 * inf) with an infinite scale
    y.sum().backward()
    assert torch.isfinite(model.weight.grad).all()
    # the step after, the scale comes from this input's amax: FP8 again
    ref = torch.nn.functional.linear(x, model.weight, model.bias)
    assert torch.allclose(model(x), ref, rtol=0.15, atol=0.05)


@pytest.mark.parametrize("margin", [0, 2])
def test_delayed_scales_equal_a_transformer_engine_simulation_on_finite_data(margin):
    g = torch.Generator().manual_seed(0)
    amaxes = [1e-38, 2.0, 0.0, 1e-42, 1e-30, 3.5, 0.0, 1e30, 0.25]
    amaxes += (torch.rand(40, generator=g) * torch.logspace(-40, 30, 40)).tolist()
    layer, te = _layer(history_len=8, margin=margin), TESimulation(448.0, 8, margin)
    ours = _drive(layer, amaxes)
    sim = []
    for a in amaxes:
        te.record(_x(a).abs().max().item())
        sim.append(te.scale.clone())
    assert sum(torch.equal(a, b) for a, b in zip(ours, sim, strict=True)) == len(amaxes)
    assert all(torch.isfinite(s) for s in ours)
    ref = fp8.reference_delayed_scales([_x(a).abs().max() for a in amaxes], E4M3, 8, "max", margin)
    assert [1.0] + [s.item() for s in ours[:-1]] == ref  # ref: the scale each step used


def test_an_inf_reaches_the_output_and_the_gradients():
    layer = _layer()
    x = torch.randn(2, 8, requires_grad=True)
    with torch.no_grad():
        x[0, 3] = float("inf")
    y = layer(x)
    assert not torch.isfinite(y[0]).any()  # was a finite row: inf saturated at 448
    assert torch.isfinite(y[1]).all()
    layer2 = _layer()
    x2 = torch.randn(2, 8, requires_grad=True)
    y2 = layer2(x2)
    gy = torch.ones_like(y2)
    gy[1, 2] = float("inf")
    y2.backward(gy)
    assert not torch.isfinite(layer2.weight.grad).all() and not torch.isfinite(x2.grad).all()


def test_one_inf_step_leaves_the_amax_history_and_the_scale_as_without_it():
    clean = [4e-3] * 30
    a, b = _layer(history_len=1024), _layer(history_len=1024)
    _drive(a, clean)
    _drive(b, [float("inf")] + clean)  # an overflowing first step, then 30 clean ones
    assert torch.isfinite(b.fp8_amax_history).all()
    # the input's history and scale are those of a layer that never saw the inf
    assert torch.equal(a.fp8_amax_history[:, 0], b.fp8_amax_history[:, 0])
    assert torch.equal(a.fp8_scale[0], b.fp8_scale[0])
    te = TESimulation(448.0, 1024)
    for v in [float("inf")] + clean:
        te.record(v)
    assert te.scale.item() == 1.0  # the simulation keeps its first scale for 1024 steps
    # what each scale does to such an input: the frozen one flushes most of it to zero
    x = torch.randn(4096, 8, generator=torch.Generator().manual_seed(0)) * 1e-3
    frozen = fp8.quantize_with_scale(x, te.scale, E4M3, "tensorwise").data.float()
    ours = fp8.quantize_with_scale(x, b.fp8_scale[0], E4M3, "tensorwise").data.float()
    assert (ours == 0).sum() == (x == 0).sum() and (frozen == 0).float().mean() > 0.5


def _amp_run(recipe: str):
    torch.manual_seed(0)
    # no bias: the bias gradient (a plain sum of the output gradient) would flag the inf itself
    net = torch.nn.Sequential(torch.nn.Linear(8, 4, bias=False))
    model = fp8.convert_to_float8_training(net, recipe)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(
            model, opt, opt_level="O1", half_dtype=torch.float16, verbosity=0
        )
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.randn(4, 8)
    # d(loss)/d(y) = 65536 (the loss scale): inf in float16, the output's dtype under O1
    with amp.scale_loss(model(x).float().sum(), opt) as scaled:
        scaled.backward()
    opt.step()
    unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    return unchanged, amp.state_dict()["loss_scaler0"]["loss_scale"]


@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_an_overflowing_o1_fp16_step_is_skipped_and_the_scale_backs_off(recipe):
    skipped, scale = _amp_run(recipe)
    assert skipped, f"{recipe}: the overflowing step was taken"
    assert scale == 2.0**15
