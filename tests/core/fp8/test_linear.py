"""Float8Linear: forward and gradients against the dequantized reference, fallbacks, autocast.

Tolerance: the reference multiplies the same FP8 operands in float64; the layer accumulates in
float32. A float32 dot product of length K is within ``(K + 2) * 2**-24 * sum|a_i b_i|`` of the
exact one (recursive summation's bound, one more rounding for the bias add), so each element
is checked against that bound, computed from ``|A| @ |B|`` (quantization is sign-symmetric, so
the reference of the absolute values gives it). A bfloat16 output adds two bf16 roundings
(``2**-8`` relative each: the GEMM's output cast and the bias add) of the same magnitude.
"""

import copy
import warnings

import pytest
import torch
from torch import nn

from mpnb import fp8
from mpnb.core.fp8 import convert_to_float8_training
from mpnb.core.fp8.linear import Float8Linear

RECIPES = ["tensorwise", "delayed", "rowwise", "mxfp8"]
U32 = 2.0**-24


def _ref(layer, x, g, scales):
    rec = layer.recipe
    dtypes = (rec.dtype("input"), rec.dtype("grad_output"))
    p2 = getattr(rec, "power_of_2_scales", False)
    w, b = layer.weight.detach().float(), layer.bias
    b = None if b is None else b.detach()
    args = (rec.granularity, p2, scales)
    exact = fp8.reference_float8_linear(x.float(), w, b, g.float(), dtypes, *args)
    absb = None if b is None else b.abs()
    xa, ga = x.abs().float(), g.abs().float()
    bound = fp8.reference_float8_linear(xa, w.abs(), absb, ga, dtypes, *args)
    return exact, bound


def _check(out, exact, bound, k):
    tol = (k + 2) * U32 * bound
    if out.dtype == torch.bfloat16:  # the GEMM's cast, then the bias add: two bf16 roundings
        tol = tol + 2 * 2.0**-8 * bound
    err = (out.double() - exact).abs()
    assert (err <= tol + 1e-30).all(), f"max excess {(err - tol).max().item():.3g}"


def _run(recipe, shape=(30, 40), n=24, bias=True, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    lin = torch.nn.Linear(shape[-1], n, bias=bias)
    layer = fp8.Float8Linear.from_linear(lin, recipe, "blk.fc")
    x = (torch.randn(*shape) * 3).to(dtype).requires_grad_(True)
    scales = None
    if layer.recipe.name == "delayed":  # one step first, so the scales come from a history
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            layer(x.detach()).sum().backward()
        lin.zero_grad(set_to_none=True)
        scales = tuple(layer.fp8_scale.tolist())
    g = torch.randn(*shape[:-1], n).to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        y = layer(x)
        y.backward(g)
    return layer, x, g, y, scales


@pytest.mark.parametrize("recipe", RECIPES)
@pytest.mark.parametrize("shape, n", [((30, 40), 24), ((2, 16, 64), 32), ((5, 7), 3)])
def test_forward_and_grads_match_dequantized_reference(recipe, shape, n):
    layer, x, g, y, scales = _run(recipe, shape, n)
    k, m = shape[-1], x.numel() // shape[-1]
    x2, g2 = x.detach().reshape(m, k), g.reshape(m, n)
    (ey, egx, egw, egb), (by, bgx, bgw, _) = _ref(layer, x2, g2, scales)
    _check(y.detach().reshape(m, n), ey, by, k)
    _check(x.grad.reshape(m, k), egx, bgx, n)
    _check(layer.weight.grad, egw, bgw, m)
    assert torch.allclose(layer.bias.grad.double(), egb, rtol=1e-6, atol=1e-6)
    # and the FP8 result is an approximation of the exact linear, not something else
    exact = x2.double() @ layer.weight.double().T + layer.bias.double()
    assert (y.detach().reshape(m, n).double() - exact).norm() / exact.norm() < 0.1


@pytest.mark.parametrize("recipe", RECIPES)
def test_bfloat16_inputs_and_autocast(recipe):
    """bf16 activations: bf16 output and input grad, fp32 weight grad (the master's dtype)."""
    layer, x, g, y, scales = _run(recipe, dtype=torch.bfloat16, bias=False)
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16
    assert layer.weight.grad.dtype == torch.float32
    (ey, egx, egw, _), (by, bgx, bgw, _) = _ref(layer, x.detach(), g, scales)
    _check(y.detach(), ey, by, 40)
    _check(x.grad, egx, bgx, 24)
    _check(layer.weight.grad, egw, bgw, 30)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # fp32 input, autocast: a bf16 output
        assert layer(torch.randn(3, 40)).dtype == torch.bfloat16


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant", [fp8.quantize_tensorwise, fp8.quantize_rowwise])
def test_emulated_gemm_equals_cpu_scaled_mm_bitwise(quant, out_dtype):
    """The fallback is not an approximation of torch._scaled_mm on the CPU: it is the same."""
    a = quant(torch.randn(33, 72) * 5, torch.float8_e4m3fn)
    b = quant(torch.randn(20, 72), torch.float8_e5m2)
    fast = fp8.fp8_mm(a, b, out_dtype, scaled_mm=True)
    slow = fp8.fp8_mm(a, b, out_dtype, scaled_mm=False)
    assert fast.dtype == out_dtype and torch.equal(fast, slow)
    blocker = fp8.scaled_mm_blocker(a, b, out_dtype)  # the CPU runs any shape...
    assert blocker is None or blocker[0] == "speed"  # ...unless the probe found it slower


def _model(recipe="mxfp8"):
    torch.manual_seed(0)
    enc = torch.nn.Sequential()
    enc.add_module("fc1", torch.nn.Linear(40, 32))
    enc.add_module("act", torch.nn.ReLU())
    model = torch.nn.Sequential()
    model.add_module("encoder", enc)
    model.add_module("head", torch.nn.Linear(32, 4))
    return fp8.convert_to_float8_training(model, recipe)


def test_fallback_warns_once_per_layer_with_its_qualified_name():
    model = _model("mxfp8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            model(torch.randn(8, 40)).sum().backward()
    msgs = [str(w.message) for w in caught if w.category is fp8.Float8FallbackWarning]
    assert len(msgs) == 2, msgs
    assert "'encoder.fc1'" in msgs[0] and "'head'" in msgs[1]
    assert all("float8_e8m0fnu" in m and "same numerics" in m for m in msgs)


def test_unsupported_device_falls_back_with_one_warning():
    """On the meta device torch._scaled_mm has no FP8 GEMM: one warning, same graph."""
    layer = fp8.Float8Linear(32, 16, device="meta", recipe="tensorwise", fqn="proj")
    with pytest.warns(fp8.Float8FallbackWarning, match=r"'proj'.*on meta") as rec:
        for _ in range(2):
            layer(torch.randn(4, 32, device="meta", requires_grad=True)).sum().backward()
    assert len(rec) == 1
    assert layer.weight.grad.shape == (16, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_cuda_shapes_not_multiple_of_16_fall_back_and_match(recipe):
    layer, x, g, y, _ = _run(recipe, (30, 40), 24)  # CPU result
    cuda = fp8.Float8Linear.from_linear(torch.nn.Linear(40, 24).cuda(), recipe, "odd")
    with torch.no_grad():
        cuda.weight.copy_(layer.weight)
        cuda.bias.copy_(layer.bias)
    with pytest.warns(fp8.Float8FallbackWarning, match="'odd'.*multiples of 16"):
        yc = cuda(x.detach().cuda())
    assert torch.allclose(yc.cpu(), y.detach(), rtol=1e-5, atol=1e-5)


def _train(recipe, steps=30):
    """Final loss of 30 full-batch Adam steps on a small regression (None: fp32)."""
    g = torch.Generator().manual_seed(0)
    x, w_true = torch.randn(96, 32, generator=g), torch.randn(32, 8, generator=g) / 4
    y = torch.tanh(x @ w_true)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh(), torch.nn.Linear(32, 8))
    if recipe is not None:
        model = fp8.convert_to_float8_training(model, recipe)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        first = (model(x) - y).pow(2).mean().item()
        for _ in range(steps):
            loss = (model(x) - y).pow(2).mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
        return first, (model(x) - y).pow(2).mean().item()


@pytest.fixture(scope="module")
def fp32_training():
    return _train(None)


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_training_tracks_fp32_training(recipe, fp32_training):
    """The FP8 model's loss after 30 steps stays near the fp32 model's."""
    first, fp32 = fp32_training
    assert fp32 < first / 10
    _, loss = _train(recipe)
    assert loss < 1.5 * fp32 + 0.005, (loss, fp32)


def test_input_feature_mismatch_names_the_layer():
    layer = fp8.Float8Linear(8, 4, fqn="decoder.out")
    with pytest.raises(ValueError, match="in_features=8") as e:
        layer(torch.randn(2, 5))
    assert "decoder.out" in str(e.value)


def test_empty_batch_gives_an_empty_output():
    layer = fp8.Float8Linear(8, 4)
    out = layer(torch.randn(0, 8, requires_grad=True))
    assert out.shape == (0, 4)
    out.sum().backward()
    assert torch.equal(layer.weight.grad, torch.zeros(4, 8))


@pytest.mark.parametrize("recipe", RECIPES)
def test_bfloat16_master_weights(recipe):
    """A bf16 model: the bf16 weight is quantized from itself and gets a bf16 gradient."""
    torch.manual_seed(0)
    layer = fp8.Float8Linear(32, 16, recipe=recipe, dtype=torch.bfloat16)
    x = torch.randn(8, 32, dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(8, 16, dtype=torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", fp8.Float8FallbackWarning)
        y = layer(x)
        y.backward(g)
    assert y.dtype == layer.weight.grad.dtype == x.grad.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.bfloat16
    scales = (1.0, 1.0, 1.0) if recipe == "delayed" else None  # the first step's scales
    (ey, egx, egw, _), (by, bgx, bgw, _) = _ref(layer, x.detach(), g, scales)
    _check(y.detach(), ey, by, 32)
    _check(x.grad, egx, bgx, 16)
    _check(layer.weight.grad, egw, bgw, 8)


# ---- checkpoints: FP8 state checked before anything loads; other recipes' state named


def _delayed_model():
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
    ck = _snapshot(_delayed_model())
    ck["0.weight"] = torch.zeros_like(ck["0.weight"])  # loaded first, were it not refused
    ck[key][0] = value
    model = _delayed_model()
    before = _snapshot(model)
    with pytest.raises(ValueError, match=rf"'2'.*{key}") as e:
        model.load_state_dict(ck)
    assert "Nothing was loaded" in str(e.value) and "drop" in str(e.value)  # the fix
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
    model = _delayed_model()
    other = _delayed_model()
    other.load_state_dict(model.state_dict())
    plain = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 4))
    other.load_state_dict(plain.state_dict())
    assert torch.equal(other[0].fp8_scale, torch.ones(3))  # fresh FP8 state


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
