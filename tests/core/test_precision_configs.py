"""What each precision configuration answers when asked, and what its apply() does
(mpnb.core.precision_configs: the one table)."""

import pytest
import torch

from mpnb import amp, fp8
from mpnb.core import precision
from mpnb.core.optimizers import FusedAdam, FusedSGD
from mpnb.core.precision_configs import (
    PRECISION_CONFIGS,
    STORED_ROLES,
    PrecisionConfig,
    config_names,
    get_config,
)

NAMES = (
    "O0 O1 O2 O3 O0+graph O1+graph O2+graph O3+graph torch-amp tf32 torch-amp+compile "
    "fp8-tensorwise fp8-delayed fp8-rowwise mxfp8 nvfp4 nvfp4-no-rht nvfp4-no-sr nvfp4-1d "
    "nvfp4-torchao mxfp4 mxfp4+sr+rht bf16-pure bf16-pure+sr bf16-pure+kahan"
).split()
PEERS = ("torch-amp", "tf32", "torch-amp+compile")
GRAPHED = ("O0+graph", "O1+graph", "O2+graph", "O3+graph")
FP8 = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8")
NVFP4 = ("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-1d", "nvfp4-torchao")
FP4 = (*NVFP4, "mxfp4", "mxfp4+sr+rht")
PURE = ("bf16-pure", "bf16-pure+sr", "bf16-pure+kahan")
#: facts keyed as a compare DataFrame keys them: bf16 emulated, fp16 and fp8 native
FACTS = {"bf16": "emulated", "fp16": "native", "fp8": "native"}


def _pair():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return m, m.parameters()


def test_the_old_module_is_the_same_table():
    assert precision.PRECISION_CONFIGS is PRECISION_CONFIGS
    assert precision.get_config is get_config


@pytest.mark.parametrize("name", config_names())
def test_runs_labels_and_precision_text(name):
    cfg = get_config(name)
    runs = cfg.halves(("bf16", "fp16"))
    graphed = name in GRAPHED
    name = name.removesuffix("+graph")  # a captured level runs as its level, labelled so
    want = {
        "O0": ("fp32",),
        "tf32": ("tf32",),
        **dict.fromkeys(FP8, ("fp8",)),
        **dict.fromkeys(NVFP4, ("nvfp4",)),
        **dict.fromkeys(FP4[len(NVFP4) :], ("mxfp4",)),
        **dict.fromkeys(PURE, ("bf16",)),
    }
    assert runs == want.get(name, ("bf16", "fp16"))
    texts = [cfg.precision_text(h, cfg.status(h, FACTS)) for h in runs]
    labels = [cfg.label(h).removesuffix(" graph") if graphed else cfg.label(h) for h in runs]
    assert all(cfg.label(h).endswith(" graph") for h in runs) == graphed
    if name == "O0":
        assert texts == ["fp32"] and labels == ["O0 fp32"]
    elif name in ("O1", "O2", "O3", "torch-amp", "torch-amp+compile"):
        assert texts == ["bf16 (emulated)", "fp16 (native)"]
        assert labels == [f"{name} bf16", f"{name} fp16"]
    elif name == "tf32":  # a CUDA mode: these facts name no device, so the CPU's
        assert texts == ["tf32 (unsupported)"] and labels == ["tf32"]
        assert cfg.status("tf32", {"device": "cpu"}) == "unsupported"
    elif name == "mxfp8":  # its GEMM is emulated on every device, native FP8 or not
        assert texts == ["fp8 (emulated)"] and cfg.gemm_dtype("fp8") == "fp32"
    elif name in FP8:
        assert texts == ["fp8 (native)"] and cfg.gemm_dtype("fp8") == "fp8"
    elif name in FP4:  # emulated on every device: no FP4 GEMM is called
        assert texts == [f"{runs[0]} (emulated)"] and cfg.gemm_dtype(runs[0]) == "fp32"
    else:
        assert texts == ["bf16 (emulated)"] and labels == [name]
    assert cfg.note_subject == (name if name in FP8 + FP4 else "")


def test_what_each_configuration_says_of_itself():
    by = {n: get_config(n) for n in config_names()}
    amp_peers = ["torch-amp", "torch-amp+compile"]
    half_levels = ["O1", "O2", "O3", "O1+graph", "O2+graph", "O3+graph"]
    assert [n for n, c in by.items() if c.loss_scaling] == [*half_levels, *amp_peers]
    assert [n for n, c in by.items() if c.autocast] == ["O1", "O1+graph", *amp_peers]
    assert [n for n, c in by.items() if not c.uses_amp] == [*PEERS, *FP8, *FP4]
    assert [n for n, c in by.items() if c.peer] == list(PEERS)
    assert [n for n, c in by.items() if c.verdict_reference] == ["torch-amp"]
    assert [n for n, c in by.items() if c.unavailable("cpu")] == [*GRAPHED, "tf32"]
    assert [n for n, c in by.items() if not c.low_precision] == ["O0", "O0+graph"]
    assert [n for n, c in by.items() if c.divergence_note()] == ["O3", "O3+graph", "bf16-pure"]
    no_fp16 = ["O0", "O0+graph", "tf32", *FP8, *FP4]
    assert [n for n, c in by.items() if c.half_dtype("fp16") is None] == no_fp16
    assert by["O2"].half_dtype("fp16") is torch.float16 and by["O2"].half_dtype() is torch.bfloat16
    assert by["bf16-pure+sr"].half_dtype("fp16") is torch.bfloat16
    assert [r.role for r in STORED_ROLES] == ["fp8_scales", "kahan_buffers"]
    assert [n for n, c in by.items() if c.stores] == [*FP8, *FP4, "bf16-pure+kahan"]


def test_status_reads_doctor_when_no_facts_are_given():
    from mpnb.core.hardware import dtype_support

    bf16 = dtype_support("cpu")["bfloat16"].status
    assert get_config("bf16-pure").status("bf16") == bf16 == get_config("O1").status("bf16")
    native = dtype_support("cpu")["float8_e4m3fn"].status == "native"
    assert get_config("fp8-delayed").status("fp8") == ("native" if native else "emulated")


@pytest.mark.parametrize(
    "name, cls, option",
    [
        ("bf16-pure", torch.optim.Adam, None),
        ("bf16-pure+sr", FusedAdam, "stochastic_rounding"),
        ("bf16-pure+kahan", FusedAdam, "kahan_summation"),
        ("O2", torch.optim.Adam, None),
    ],
)
def test_a_configuration_builds_the_optimizer_it_needs(name, cls, option):
    cfg = get_config(name)
    _, params = _pair()
    opt = cfg.make_optimizer("adam", params, 1e-3)
    assert type(opt) is cls
    if option:
        assert opt.defaults[option] is True
        assert (
            cfg.optimizer_note("adam")
            == f"{name} trains with mpnb's FusedAdam({option}=True) for 'adam'"
        )
        assert "FusedSGD" in cfg.optimizer_note("sgd")
        assert type(cfg.make_optimizer("sgd", _pair()[1], 1e-3)) is FusedSGD
    else:
        assert cfg.optimizer_note("adam") == ""


@pytest.mark.parametrize("name", [n for n in config_names() if not get_config(n).peer])
def test_setup_leaves_every_configuration_under_one_training_loop(name):
    cfg = get_config(name)
    model, params = _pair()
    opt = cfg.make_optimizer("sgd", params, 0.1)
    model, opt = cfg.setup(model, opt, half_dtype=torch.bfloat16, loss_scale=2.0**4)
    handle = amp.current_handle()
    assert handle is not None
    want = 2.0**4 if cfg.loss_scaling else 1.0  # the run's loss scale applies to O1-O3 only
    assert handle.properties.loss_scale == want
    x = torch.randn(4, 8)  # amp casts it where the model is half
    before = [p.detach().clone() for p in model.parameters()]
    loss = model(x).float().pow(2).mean()
    with amp.scale_loss(loss, opt) as scaled:
        scaled.backward()
    opt.step()
    assert any(
        not torch.equal(a, p.detach()) for a, p in zip(before, model.parameters(), strict=True)
    )


def test_a_config_of_a_new_kind_needs_only_its_own_answers():
    class Fp32Twin(PrecisionConfig):
        def apply(self, model, optimizer=None, half_dtype=None):
            return model, optimizer

        def halves(self, asked):
            return ("fp32",)

    twin = Fp32Twin(
        "twin", "fp32, by another name.", ("float32",), ("float32",), ("float32",), "float32"
    )
    assert twin.status("fp32", FACTS) == "" and twin.precision_text("fp32", "") == "fp32"
    assert twin.label("fp32") == "twin" and not twin.loss_scaling and not twin.autocast
    assert get_config(twin) is twin


def _model_and_sgd():
    m, params = _pair()
    return m, torch.optim.SGD(params, lr=0.1)


def test_the_table_lists_every_configuration_once():
    assert config_names() == tuple(NAMES)
    for name, cfg in PRECISION_CONFIGS.items():
        assert cfg.name == name and cfg.description and "\n" not in cfg.description
        dts = cfg.dtypes(torch.float16)
        assert set(dts) == {"weights", "grads", "optimizer_state"}
        assert all(isinstance(d, torch.dtype) for v in dts.values() for d in v)
    assert get_config("O2").dtypes(torch.float16)["weights"] == (torch.float16, torch.float32)
    assert get_config("bf16-pure").dtypes(torch.float16)["weights"] == (torch.bfloat16,)
    with pytest.raises(TypeError):
        PRECISION_CONFIGS["O9"] = PRECISION_CONFIGS["O0"]  # read-only


def test_unknown_names_list_the_choices():
    with pytest.raises(ValueError, match="letter O, not zero.*fp8-delayed"):
        get_config("02")
    assert get_config(PRECISION_CONFIGS["O1"]) is PRECISION_CONFIGS["O1"]


@pytest.mark.parametrize("name", ["O0", "O1", "O2", "O3"])
def test_opt_levels_apply_through_amp_initialize(name):
    model, opt = _model_and_sgd()
    model, opt = get_config(name).apply(model, opt, half_dtype=torch.bfloat16)
    assert amp.current_handle().properties.opt_level == name
    want = {"O0": torch.float32, "O1": torch.float32}.get(name, torch.bfloat16)
    assert model[0].weight.dtype == want


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8"])
def test_fp8_configs_swap_the_linear_layers(name):
    model, opt = _model_and_sgd()
    model, opt2 = get_config(name).apply(model, opt)
    assert opt2 is opt
    layers = fp8.float8_layers(model)
    assert set(layers) == {"0", "2"}
    assert layers["0"].recipe.name == get_config(name).recipe
    assert layers["0"].weight is opt.param_groups[0]["params"][0]


def test_bf16_pure_applies_and_its_variants_name_the_missing_option():
    model, opt = _model_and_sgd()
    model, opt = get_config("bf16-pure").apply(model, opt)
    assert model[0].weight.dtype == torch.bfloat16
    assert opt.param_groups[0]["params"][0].dtype == torch.bfloat16  # no fp32 masters
    for name, option in (("bf16-pure+sr", "stochastic_rounding"), ("bf16-pure+kahan", "kahan")):
        model, opt = _model_and_sgd()
        with pytest.raises(ValueError, match=f"{option}.*FusedAdam"):
            get_config(name).apply(model, opt)
        assert model[0].weight.dtype == torch.float32  # nothing changed
