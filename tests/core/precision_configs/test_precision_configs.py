"""What each precision configuration answers when asked, and what its apply() does
(mpnb.core.precision_configs: the one table)."""

import warnings

import pytest
import torch

from mpnb import amp, fp8
from mpnb.core import precision
from mpnb.core.fp8.keep import KeepList, KeptLayersWarning
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
    with pytest.raises(ValueError, match="letter O, not zero") as e:
        get_config("02")
    assert "fp8-delayed" in str(e.value)  # the valid choices are listed
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


# ---- keep-lists in configuration names (issue 49 point 4) ------------------------------------


class _Blocks(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(4))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        for b in self.blocks:
            x = torch.relu(b(x))
        return self.head(x)


def test_the_nvfp4_configurations_keep_the_reports_layers_and_no_other_keeps_any():
    from mpnb.core.precision_configs import KEEP_CONFIGS, NVFP4_KEEP

    assert KEEP_CONFIGS == (*FP8, *FP4)
    keeps = {n: get_config(n).keep for n in KEEP_CONFIGS}
    assert keeps == {n: NVFP4_KEEP if n in NVFP4 else "" for n in KEEP_CONFIGS}
    assert NVFP4_KEEP == "keep-last=15%:keep-head"
    assert get_config("nvfp4").description.endswith(f"(linear layers left fp32): {NVFP4_KEEP}.")
    model, _ = get_config("nvfp4").apply(_Blocks())  # ceil(0.15 * 4) = 1 block, and the head
    assert set(fp8.float8_layers(model)) == {"blocks.0", "blocks.1", "blocks.2"}


@pytest.mark.parametrize(
    "name, canonical, kept",
    [
        ("nvfp4:keep-last=2", "nvfp4:keep-last=2", {"blocks.2", "blocks.3"}),
        ("nvfp4:keep-none", "nvfp4:keep-none", set()),
        ("nvfp4:keep-last=0", "nvfp4:keep-none", set()),
        (
            "mxfp4:keep-last=1:keep-first=1",
            "mxfp4:keep-first=1:keep-last=1",
            {"blocks.0", "blocks.3"},
        ),
        ("mxfp8:keep=head", "mxfp8:keep=head", {"head"}),
        ("fp8-delayed:keep=blocks.*+head", "fp8-delayed:keep=blocks.*+head", None),
        ("nvfp4-no-rht:keep-head", "nvfp4-no-rht:keep-head", {"head"}),
    ],
)
def test_a_name_carries_a_keep_list(name, canonical, kept):
    cfg = get_config(name)
    assert cfg.name == canonical and cfg.keep == canonical.partition(":")[2]
    assert get_config(cfg.name) == cfg and cfg.label("fp8") == canonical
    base = PRECISION_CONFIGS[name.partition(":")[0]]
    assert cfg.recipe_options == base.recipe_options and cfg.format_name == base.format_name
    assert cfg.description.count("Keep-list") == 1 and cfg.description.endswith(f"{cfg.keep}.")
    assert f'keep="{cfg.keep}"' in cfg.snippet(cfg.halves(())[0])
    if kept is None:  # keeps every linear layer: the swap warns that nothing runs in FP8
        with pytest.warns(fp8.NoFloat8LayerWarning, match="keep-list kept all 5"):
            cfg.apply(_Blocks())
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model, _ = cfg.apply(_Blocks())
    notes = [str(w.message) for w in caught if issubclass(w.category, KeptLayersWarning)]
    names = {f"blocks.{i}" for i in range(4)} | {"head"}
    assert set(fp8.float8_layers(model)) == names - kept
    assert all(type(model.get_submodule(n)) is torch.nn.Linear for n in kept)
    if kept:
        assert notes == [f"{canonical}: " + KeepList.parse(cfg.keep).describe(model)]
        assert notes[0].startswith(f"{canonical}: kept in fp32: ")
    else:
        assert notes == []


def test_a_plain_configuration_says_nothing_of_keeping():
    with warnings.catch_warnings():
        warnings.simplefilter("error", KeptLayersWarning)
        model, _ = get_config("mxfp4").apply(_Blocks())
    assert len(fp8.float8_layers(model)) == 5
    assert "keep" not in get_config("mxfp4").snippet("mxfp4")


@pytest.mark.parametrize(
    "name, match",
    [
        ("O2:keep-last=1", "O2 takes no keep-list .*keep-lists go with fp8-tensorwise, "),
        ("bf16-pure:keep=head", "bf16-pure takes no keep-list"),
        ("nvfp4:keep-lats=1", "'keep-lats=1' is not an option"),
        ("nvfp4:keep-first=1,keep-last=1", "join the options with ':', not ','"),
        ("nvfp5:keep-last=1", "unknown precision config 'nvfp5'; valid choices"),
    ],
)
def test_a_bad_keep_list_in_a_name_is_refused(name, match):
    with pytest.raises(ValueError, match=match):
        get_config(name)


def test_config_names_are_checked_with_their_keep_lists():
    from mpnb.core.precision_configs import check_config_names

    check_config_names(["O0", "nvfp4:keep-last=2", "mxfp8"])
    with pytest.raises(ValueError, match="'keep-last=1': keep") as e:
        check_config_names(["O0", "nvfp4:keep-first=1", "keep-last=1"], "configs: unknown")
    assert "keep-first=1:keep-last=1" in str(e.value)  # the spelling that works
    with pytest.raises(ValueError, match="unknown 'O9'"):
        check_config_names(["O9"], "unknown")
    with pytest.raises(ValueError, match="keep-none keeps nothing"):
        check_config_names(["nvfp4:keep-none:keep-head"])
