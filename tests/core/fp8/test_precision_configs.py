"""The one list of precision configurations (mpnb.core.precision) and what apply() does."""

import pytest
import torch

from mpnb import fp8
from mpnb.core.precision import PRECISION_CONFIGS, config_names, get_config

NAMES = (
    "O0 O1 O2 O3 fp8-tensorwise fp8-delayed fp8-rowwise mxfp8 bf16-pure bf16-pure+sr "
    "bf16-pure+kahan"
).split()


def _pair():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    return m, torch.optim.SGD(m.parameters(), lr=0.1)


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
    from mpnb import amp

    model, opt = _pair()
    model, opt = get_config(name).apply(model, opt, half_dtype=torch.bfloat16)
    assert amp.current_handle().properties.opt_level == name
    want = {"O0": torch.float32, "O1": torch.float32}.get(name, torch.bfloat16)
    assert model[0].weight.dtype == want


@pytest.mark.parametrize("name", ["fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8"])
def test_fp8_configs_swap_the_linear_layers(name):
    model, opt = _pair()
    model, opt2 = get_config(name).apply(model, opt)
    assert opt2 is opt
    layers = fp8.float8_layers(model)
    assert set(layers) == {"0", "2"}
    assert layers["0"].recipe.name == get_config(name).recipe
    assert layers["0"].weight is opt.param_groups[0]["params"][0]


def test_bf16_pure_applies_and_its_variants_name_the_missing_option():
    model, opt = _pair()
    model, opt = get_config("bf16-pure").apply(model, opt)
    assert model[0].weight.dtype == torch.bfloat16
    assert opt.param_groups[0]["params"][0].dtype == torch.bfloat16  # no fp32 masters
    for name, option in (("bf16-pure+sr", "stochastic_rounding"), ("bf16-pure+kahan", "kahan")):
        model, opt = _pair()
        with pytest.raises(ValueError, match=f"{option}.*FusedAdam"):
            get_config(name).apply(model, opt)
        assert model[0].weight.dtype == torch.float32  # nothing changed
