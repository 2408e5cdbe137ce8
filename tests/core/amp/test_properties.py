"""amp.initialize: opt-level defaults, overrides, invalid input, return shapes, hardware notes."""

import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp._initialize import EmulatedHalfWarning, HardwareCheck
from mpnb.core.amp._properties import resolve_properties

HALVES = [torch.bfloat16, torch.float16]


def _net():
    return torch.nn.Sequential(
        torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 2)
    )


def _init(level, half=torch.bfloat16, **kw):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return (*amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0, **kw),)


@pytest.mark.parametrize("half", HALVES)
def test_defaults_per_level(half):
    p = {lvl: resolve_properties(lvl, half_dtype=half) for lvl in ("O0", "O1", "O2", "O3")}
    assert p["O0"].cast_model_type == torch.float32 and p["O0"].loss_scale == 1.0
    assert p["O1"].patch_torch_functions and p["O1"].cast_model_type is None
    # fp16: Apex's dynamic scale; bf16 (fp32's range): no scaling, as torch.amp does
    scale = "dynamic" if half == torch.float16 else 1.0
    assert p["O1"].loss_scale == scale and not p["O1"].master_weights
    assert p["O2"].cast_model_type == half and p["O2"].keep_batchnorm_fp32
    assert p["O2"].master_weights and p["O2"].loss_scale == scale
    assert p["O3"].cast_model_type == half and p["O3"].loss_scale == 1.0
    assert not p["O3"].master_weights and p["O3"].keep_batchnorm_fp32 is False


def test_default_half_dtype_is_bf16_on_cpu_and_cast_model_type_sets_it():
    assert resolve_properties("O2").half_dtype == torch.bfloat16
    assert resolve_properties("O2", cast_model_type=torch.float16).half_dtype == torch.float16
    assert resolve_properties("O2", keep_batchnorm_fp32="False").keep_batchnorm_fp32 is False
    assert resolve_properties("O1", loss_scale=128).loss_scale == 128.0


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_dtypes_of_params_buffers_masters_outputs(level, half):
    m, opt = _init(level, half)
    lin, bn = m[0], m[1]
    model_dt = {"O0": torch.float32, "O1": torch.float32, "O2": half, "O3": half}[level]
    bn_dt = half if level == "O3" else torch.float32
    assert lin.weight.dtype == lin.bias.dtype == m[3].weight.dtype == model_dt
    assert bn.weight.dtype == bn.running_mean.dtype == bn.running_var.dtype == bn_dt
    masters = list(amp.master_params(opt))
    if level == "O2":
        assert all(p.dtype == torch.float32 for p in masters)
        assert not any(p is lin.weight for p in masters)
        assert torch.equal(masters[0].to(half), lin.weight)
    else:
        assert [id(p) for p in masters] == [id(p) for p in m.parameters()]
    out = m(torch.randn(3, 4))
    assert out.dtype == torch.float32  # every level casts the outputs to fp32 by default


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(opt_level="O4"), ["O0, O1, O2, O3"]),
        (dict(opt_level="02"), ["letter O"]),
        (dict(opt_level="O2", keep_batchnorm_fp32="yes"), ["True, False"]),
        (dict(opt_level="O1", master_weights=True), ["O1", "O2"]),
        (dict(opt_level="O1", keep_batchnorm_fp32=True), ["keep_batchnorm_fp32"]),
        (dict(opt_level="O1", cast_model_type=torch.float16), ["cast_model_type"]),
        (dict(opt_level="O2", loss_scale=-1), ["dynamic", "positive"]),
        (dict(opt_level="O2", loss_scale="auto"), ["dynamic"]),
        (dict(opt_level="O2", half_dtype=torch.float64), ["torch.float16", "torch.bfloat16"]),
        (
            dict(opt_level="O2", half_dtype=torch.bfloat16, cast_model_type=torch.float16),
            ["conflicts"],
        ),
        (dict(opt_level="O0", master_weights=True), ["master_weights"]),
        (dict(opt_level="O2", num_losses=0), ["num_losses"]),
    ],
)
def test_invalid_input_names_the_choices(kw, words):
    m = _net()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    before = [p.detach().clone() for p in m.parameters()]
    with pytest.raises(ValueError) as e:
        amp.initialize(m, opt, verbosity=0, **kw)
    for w in words:
        assert w in str(e.value)
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=False))


def test_wrong_types_and_double_initialize():
    with pytest.raises(TypeError, match="modules.module.Module"):
        amp.initialize("model", verbosity=0)
    m = _net()
    with pytest.raises(TypeError, match="Optimizer"):
        amp.initialize(m, object(), verbosity=0)
    amp.initialize(m, verbosity=0)
    with pytest.raises(ValueError, match="already initialized"):
        amp.initialize(m, verbosity=0)


def test_scale_loss_before_initialize_or_unknown_optimizer():
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.1)
    with pytest.raises(ValueError, match="amp.initialize"):
        with amp.scale_loss(p.sum(), opt):
            pass


def test_return_shapes_match_apex():
    ms, os_ = [_net(), _net()], None
    assert isinstance(amp.initialize(ms, verbosity=0), list)
    m = _net()
    assert amp.initialize(m, verbosity=0) is m
    m1, m2 = _net(), _net()
    o1 = torch.optim.SGD(m1.parameters(), lr=1)
    o2 = torch.optim.SGD(m2.parameters(), lr=1)
    out_m, out_o = amp.initialize([m1, m2], [o1, o2], opt_level="O2", verbosity=0)
    assert out_m == [m1, m2] and out_o == [o1, o2]
    m3 = _net()
    o3 = torch.optim.SGD(m3.parameters(), lr=1)
    assert amp.initialize(m3, o3, verbosity=0) == (m3, o3)
    assert os_ is None


def test_verbosity_prints_properties(capsys):
    _net_ = _net()
    amp.initialize(_net_, opt_level="O2", verbosity=1)
    out = capsys.readouterr().out
    assert "Selected optimization level O2" in out and "master_weights" in out


def test_fp16_on_cpu_warns_once_and_bf16_does_not():
    check = HardwareCheck()
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        check(torch.device("cpu"), torch.bfloat16)
        check(torch.device("cpu"), torch.float16)
        check(torch.device("cpu"), torch.float16)
    from mpnb.core.hardware import half_support

    expected = 1 if half_support("cpu")["float16"] == "emulated" else 0
    msgs = [str(r.message) for r in rec if issubclass(r.category, EmulatedHalfWarning)]
    assert len(msgs) == expected
    if expected:
        assert "bfloat16" in msgs[0] and "emulated" in msgs[0]


def test_bf16_unsupported_device_raises_with_reason(monkeypatch):
    import mpnb.core.amp._initialize as init

    monkeypatch.setattr(
        init, "half_support", lambda d: {"bfloat16": "unsupported", "float16": "native"}
    )
    monkeypatch.setattr(init, "cuda_info", lambda i: {"name": "Tesla V100", "capability": "7.0"})
    with pytest.raises(ValueError, match="7.0.*8.0.*float16"):
        HardwareCheck()(torch.device("cuda", 0), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_default_is_fp16_and_o2_dtypes():
    m = _net().cuda()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = amp.initialize(m, opt, opt_level="O2", verbosity=0)
    assert m[0].weight.dtype == torch.float16 and m[1].weight.dtype == torch.float32
    assert m(torch.randn(3, 4, device="cuda")).dtype == torch.float32


def test_bf16_default_is_no_loss_scaling_and_the_listing_says_why():
    from mpnb.core.amp._properties import format_properties

    bf16 = resolve_properties("O1", half_dtype=torch.bfloat16)
    assert bf16.loss_scale == 1.0 and "needs no loss scaling" in format_properties(bf16)
    fp16 = resolve_properties("O1", half_dtype=torch.float16)
    assert fp16.loss_scale == "dynamic" and "needs no" not in format_properties(fp16)
    assert resolve_properties("O2", half_dtype=torch.bfloat16, loss_scale="dynamic").loss_scale == (
        "dynamic"
    )  # still available on request
