"""``mpnb.lab.config``: the configurations the lab expands (exactly the core list), the names it
refuses, ``configs=`` and its former name, and the counts it checks before a run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import mpnb.lab
from mpnb.core.precision_configs import (
    PRECISION_CONFIGS,
    Float8Config,
    config_names,
    get_config,
)
from mpnb.lab import workloads
from mpnb.lab.config import expand

#: mpnb's configurations beyond O0-O3 (the peers, PyTorch's own ways, are tested in test_peers)
NEW = [
    n
    for n in config_names()
    if n not in ("O0", "O1", "O2", "O3") and not get_config(n).peer and "+graph" not in n
]
PEERS = ("torch-amp", "tf32", "torch-amp+compile")
FP8 = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8")
FP4 = {  # the four-bit recipes and their formats
    **dict.fromkeys(("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-1d", "nvfp4-torchao"), "nvfp4"),
    **dict.fromkeys(("mxfp4", "mxfp4+sr+rht"), "mxfp4"),
}


def test_the_lab_offers_exactly_the_core_list():
    from mpnb.widgets._compare_controls import DEFAULT_LEVELS, LEVELS

    assert set(FP8) | set(FP4) | {"bf16-pure", "bf16-pure+sr", "bf16-pure+kahan"} == set(NEW)
    assert [n for n in config_names() if get_config(n).peer] == list(PEERS)
    assert LEVELS == config_names() and DEFAULT_LEVELS == ("O0", "O1", "O2", "O3", "torch-amp")
    cfgs = expand("mlp", config_names(), ("bf16", "fp16"), (32,), steps=4, device="cpu")
    labels = [c.label for c in cfgs]
    # O1-O3 and torch-amp once per half dtype; every other configuration fixes its precision
    assert labels[:7] == ["O0 fp32 b32"] + [
        f"O{i} {h} b32" for i in (1, 2, 3) for h in ("bf16", "fp16")
    ]
    assert labels[7:14] == ["O0 fp32 graph b32"] + [
        f"O{i} {h} graph b32" for i in (1, 2, 3) for h in ("bf16", "fp16")
    ]
    labels = labels[:7] + labels[14:]
    assert labels[7:12] == [
        "torch-amp bf16 b32",
        "torch-amp fp16 b32",
        "tf32 b32",
        "torch-amp+compile bf16 b32",
        "torch-amp+compile fp16 b32",
    ]
    assert labels[12:] == [f"{n} b32" for n in NEW]
    halves = {c.half_dtype for c in cfgs if isinstance(c.config, Float8Config)}
    assert halves == {"fp8", "nvfp4", "mxfp4"}
    assert all(c.config is PRECISION_CONFIGS[c.config.name] for c in cfgs)


def test_unknown_configuration_names_the_choices():
    with pytest.raises(ValueError, match="configuration 'fp8'") as e:
        expand("mlp", ("O0", "fp8"), steps=4, device="cpu")
    assert "fp8-delayed" in str(e.value) and "bf16-pure+kahan" in str(e.value)  # the choices
    with pytest.raises(ValueError, match="letter O, not zero"):
        expand("mlp", ("02",), steps=4, device="cpu")


# ---- the lab asks the configuration ---------------------------------------------------------


def test_configs_is_the_name_and_opt_levels_still_works(tmp_path):
    from mpnb.cli import build_parser
    from mpnb.lab.config import RunConfig

    for flag in ("--configs", "--opt-levels"):
        args = build_parser().parse_args(["compare", flag, "O0,bf16-pure"])
        assert args.configs == ("O0", "bf16-pure")
    with pytest.raises(TypeError, match="former name") as e:
        mpnb.lab.compare("mlp", configs=("O0",), opt_levels=("O0",), steps=4)
    assert "configs=" in str(e.value) and "opt_levels=" in str(e.value)
    df = mpnb.lab.compare("mlp", opt_levels=("O0",), size="small", steps=3, progress=False)
    assert list(df["opt_level"]) == ["O0"]
    run = RunConfig("mlp", "O2", "bf16", 32, 4)
    assert run.config is PRECISION_CONFIGS["O2"] and run.label == "O2 bf16 b32"
    assert run.dtype is torch.bfloat16


def _data(n=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :4].argmax(1)


def _tiny():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def test_compare_refuses_zero_steps_and_an_unknown_device():
    with pytest.raises(ValueError, match="steps=0"):
        mpnb.lab.compare("mlp", steps=0, progress=False)
    with pytest.raises(ValueError, match="is not a device"):
        mpnb.lab.compare("mlp", device="tpu", progress=False)


@pytest.mark.parametrize(
    "kw, says",
    [
        (dict(opt_levels=("O0", "O1", "O1")), r"lists O1 more than once.*O0,O1\)"),
        (dict(batch_sizes=(16, 16)), r"lists 16 more than once.*e\.g\. 16\)"),
    ],
)
def test_a_configuration_given_twice_is_refused(kw, says):
    """They ran again under the same label (one row reading '0.10x O0')."""
    w = workloads.custom(_tiny, _data(), nn.functional.cross_entropy, batch_size=16)
    args = dict(opt_levels=("O0", "O1"), batch_sizes=(16,), steps=4, progress=False)
    with pytest.raises(ValueError, match=says):
        mpnb.lab.compare(w, **{**args, **kw})
