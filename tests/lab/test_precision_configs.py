"""The configurations of mpnb.core.precision_configs beyond O0-O3, through compare and
`mpnb compare`."""

import json
import subprocess
import sys

import pytest
import torch

import mpnb.lab
from mpnb.core.hardware import half_support
from mpnb.core.optimizers import FusedAdam, FusedSGD
from mpnb.core.precision_configs import (
    PRECISION_CONFIGS,
    Float8Config,
    config_names,
    get_config,
    make_optimizer,
)
from mpnb.lab.config import expand
from mpnb.lab.machine import fp8_support
from mpnb.lab.memory import ROLES, MemoryTracker
from mpnb.lab.runner import emulation_note

#: mpnb's configurations beyond O0-O3 (the peers, PyTorch's own ways, are tested in test_peers)
NEW = [
    n
    for n in config_names()
    if n not in ("O0", "O1", "O2", "O3") and not get_config(n).peer and "+graph" not in n
]
GRAPHED = ("O0+graph", "O1+graph", "O2+graph", "O3+graph")  # CUDA only: test_graphed_step
PEERS = ("torch-amp", "tf32", "torch-amp+compile")
FP8 = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8")
FP4 = {  # the four-bit recipes and their formats
    **dict.fromkeys(("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-1d", "nvfp4-torchao"), "nvfp4"),
    **dict.fromkeys(("mxfp4", "mxfp4+sr+rht"), "mxfp4"),
}
MIB = 2.0**20


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
    with pytest.raises(ValueError, match="fp8-delayed.*bf16-pure\\+kahan"):
        expand("mlp", ("O0", "fp8"), steps=4, device="cpu")
    with pytest.raises(ValueError, match="letter O, not zero"):
        expand("mlp", ("02",), steps=4, device="cpu")


@pytest.mark.parametrize(
    "name, cls, mode",
    [("adam", FusedAdam, "adam"), ("adamw", FusedAdam, "adamw"), ("sgd", FusedSGD, "sgd")],
)
@pytest.mark.parametrize("option", ["stochastic_rounding", "kahan_summation"])
def test_option_configs_get_the_fused_optimizer_of_the_same_rule(name, cls, mode, option):
    p = torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))
    opt = make_optimizer(name, [p], 1e-3, option)
    assert type(opt) is cls and opt.defaults[option] is True
    if mode == "adamw":
        assert opt.defaults["weight_decay"] == 1e-2  # torch.optim.AdamW's default
    if mode == "sgd":
        assert opt.defaults["momentum"] == 0.9
    assert type(make_optimizer(name, [p], 1e-3)).__module__.startswith("torch.optim")


def test_memory_tracker_counts_fp8_histories_and_kahan_buffers_as_their_roles():
    from mpnb.core.fp8 import convert_to_float8_training

    assert {"fp8_scales", "kahan_buffers"} <= set(ROLES)
    model = convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(32, 16)), "delayed")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with MemoryTracker(model, opt) as m:
        model(torch.randn(8, 32)).sum().backward()
    hist = model[0].fp8_amax_history.numel() * 4 + model[0].fp8_scale.numel() * 4
    assert m.breakdown()["fp8_scales"] == hist
    assert m.breakdown()["params"] == (32 * 16 + 16) * 4

    w = torch.nn.Parameter(torch.randn(64, 64).bfloat16())
    opt = FusedAdam([w], lr=1e-3, kahan_summation=True)
    w.grad = torch.randn_like(w)
    opt.step()
    with MemoryTracker(None, opt) as m:
        w.grad = torch.randn_like(w)
        opt.step()
    assert m.breakdown()["kahan_buffers"] == 64 * 64 * 2  # one bf16 buffer per param
    assert m.breakdown()["optimizer_state"] >= 2 * 64 * 64 * 4  # fp32 exp_avg, exp_avg_sq


def test_emulation_note_names_fp8_on_a_cpu():
    w = mpnb.lab.workloads.get("mlp", "small")
    note = emulation_note(w, "auto", "cpu", ("O0", "fp8-delayed"))
    assert fp8_support("cpu") == "emulated" and "fp8" in note and "emulated" in note
    assert "bf16" not in note.split(" is emulated")[0]  # O0 + FP8 run no bf16
    pure = emulation_note(w, "auto", "cpu", ("O0", "bf16-pure"))
    if half_support("cpu")["bfloat16"] == "emulated":  # native on CPUs with avx512_bf16 or AMX
        assert "bf16" in pure
    else:
        assert "bf16" not in pure


@pytest.fixture(scope="module")
def rows():
    df = mpnb.lab.compare(
        "mlp", opt_levels=("O0", "O2", *NEW), size="small", steps=6, progress=False, threads=1
    )
    return {r.opt_level: r for r in df.itertuples()}


@pytest.mark.parametrize("name", NEW)
def test_every_configuration_trains_through_compare(rows, name):
    r, base = rows[name], rows["O0"]
    assert r.status == "ok", r.error
    assert 0.2 < r.metric <= 1.0 and abs(r.metric - base.metric) < 0.2  # it learned
    assert r.timed_steps > 0 and r.rounds > 0 and r.peak_mem_mib > 0
    assert r.configuration == f"{name} b64"
    roles = sum(getattr(r, f"mem_{k}_mib") for k in ROLES)
    assert abs(roles - r.peak_mem_mib) < 1e-9  # the roles split the peak
    params = 64 * 128 + 128 + 128 * 10 + 10  # the small MLP
    cfg = get_config(name)
    if name in FP8:
        assert r.precision == f"fp8 ({'emulated' if name == 'mxfp8' else fp8_support('cpu')})"
        if r.precision == "fp8 (emulated)":
            assert f"{name}: fp8 is emulated on this CPU" in r.warnings
        assert r.mem_params_mib * MIB == params * 4  # fp32 weights stay
    elif name in FP4:  # emulated on every device; the weights stay fp32
        assert r.precision == f"{FP4[name]} (emulated)"
        assert f"{name}: {FP4[name]} is emulated on this CPU" in r.warnings
        assert r.mem_params_mib * MIB == params * 4
    else:
        assert r.precision.startswith("bf16") and r.mem_params_mib * MIB == params * 2
        assert r.mem_master_weights_mib == 0  # no fp32 masters
    hist = 2 * (1024 * 3 + 3) * 4 if name == "fp8-delayed" else 0
    hist = 2 * 8 if name in FP4 else hist  # the stochastic rounding's draw counter per layer
    assert r.mem_fp8_scales_mib * MIB == hist
    kahan = params * 2 if name == "bf16-pure+kahan" else 0
    assert r.mem_kahan_buffers_mib * MIB == kahan
    if getattr(cfg, "optimizer_option", None):
        assert f"FusedAdam({cfg.optimizer_option}=True)" in r.warnings
    assert r.mem_optimizer_state_mib > 0


def test_cli_json_runs_every_new_configuration(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "mpnb.cli",
        "compare",
        "--workload",
        "mlp",
        "--size",
        "small",
        "--steps",
        "3",
        "--opt-levels",
        ",".join(["O0", *NEW]),
        "--threads",
        "1",
        "--optimizer",
        "sgd",
        "--json",
        "--out",
        "",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    doc = json.loads(p.stdout)
    rows = {r["opt_level"]: r for r in doc["rows"]}
    assert list(rows) == ["O0", *NEW]
    assert all(r["status"] == "ok" for r in rows.values()), [r["error"] for r in doc["rows"]]
    assert rows["fp8-delayed"]["mem_fp8_scales_mib"] > 0
    assert rows["bf16-pure+kahan"]["mem_kahan_buffers_mib"] > 0
    assert "FusedSGD(stochastic_rounding=True)" in rows["bf16-pure+sr"]["warnings"]
    assert all(rows[n]["precision"].startswith("fp8") for n in FP8)
    assert doc["hardware"]["fp8"] == "emulated" and "fp8 emulated" in doc["hardware"]["summary"]
    assert "fp8" in p.stderr and "emulated" in p.stderr  # the note before the run


def test_cli_rejects_an_unknown_configuration():
    cmd = [sys.executable, "-m", "mpnb.cli", "compare", "--opt-levels", "O0,fp4", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "fp4" in p.stderr and "mxfp8" in p.stderr and not p.stdout


# ---- the lab asks the configuration ---------------------------------------------------------


def test_a_new_configuration_runs_through_the_lab_by_its_table_entry_alone(monkeypatch):
    import types
    from pathlib import Path

    import mpnb.core.precision_configs as pcs
    from mpnb.core.hardware import dtype_support

    fp16 = pcs.PureHalfConfig(
        "fp16-pure",
        "Pure fp16.",
        ("float16",),
        ("float16",),
        ("float16",),
        "float16",
        half="float16",
    )
    table = types.MappingProxyType({**pcs.PRECISION_CONFIGS, "fp16-pure": fp16})
    monkeypatch.setattr(pcs, "PRECISION_CONFIGS", table)
    [cfg] = expand("mlp", ("fp16-pure",), "bf16", (32,), steps=4, device="cpu")
    assert cfg.config is fp16 and cfg.half_dtype == "fp16" and cfg.label == "fp16-pure b32"
    # SGD: Adam's eps=1e-8 is 0 in fp16, and the lab says so (the divergence note)
    df = mpnb.lab.compare(
        "mlp",
        configs=("O0", "fp16-pure"),
        size="small",
        steps=4,
        optimizer="sgd",
        progress=False,
        threads=1,
    )
    r = df.set_index("opt_level").loc["fp16-pure"]
    assert r.status == "ok", r.error
    assert r.precision == f"fp16 ({dtype_support('cpu')['float16'].status})"
    assert r.mem_params_mib * MIB == (64 * 128 + 128 + 128 * 10 + 10) * 2  # fp16 weights
    assert df.attrs["verdict"]["text"]
    # the lab and the widgets hold no test of a configuration's kind
    root = Path(mpnb.lab.__file__).parents[1]
    kinds = (
        "AmpConfig",
        "Float8Config",
        "PureHalfConfig",
        "TorchAmpConfig",
        "TF32Config",
        "TorchAmpCompileConfig",
        "optimizer_option",
        "is_fp8",
    )
    found = [
        f"{f.relative_to(root)}: {k}"
        for f in [*(root / "lab").rglob("*.py"), *(root / "widgets").rglob("*.py")]
        for k in kinds
        if k in f.read_text()
    ]
    assert not found, found


def test_configs_is_the_name_and_opt_levels_still_works(tmp_path):
    from mpnb.cli import build_parser
    from mpnb.lab.config import RunConfig

    for flag in ("--configs", "--opt-levels"):
        args = build_parser().parse_args(["compare", flag, "O0,bf16-pure"])
        assert args.configs == ("O0", "bf16-pure")
    with pytest.raises(TypeError, match="configs= or its former name opt_levels="):
        mpnb.lab.compare("mlp", configs=("O0",), opt_levels=("O0",), steps=4)
    df = mpnb.lab.compare("mlp", opt_levels=("O0",), size="small", steps=3, progress=False)
    assert list(df["opt_level"]) == ["O0"]
    run = RunConfig("mlp", "O2", "bf16", 32, 4)
    assert run.config is PRECISION_CONFIGS["O2"] and run.label == "O2 bf16 b32"
    assert run.dtype is torch.bfloat16


def test_a_rows_layer_fallback_notes_are_said_once_per_recipe_and_cause():
    import warnings

    from mpnb.core.fp8 import Float8FallbackWarning, convert_to_float8_training
    from mpnb.lab._train import row_warnings

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(6)])
    convert_to_float8_training(model, "nvfp4")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(torch.randn(4, 32)).sum().backward()
        warnings.warn("another warning. With a second sentence.", UserWarning, stacklevel=1)
    fell = [c for c in caught if issubclass(c.category, Float8FallbackWarning)]
    assert {c.message.layer for c in fell} == {str(i) for i in range(6)}  # one per layer
    notes = row_warnings(caught)
    layer_notes = [n for n in notes if n.startswith("mpnb.fp8:")]
    cause = fell[0].message.cause.split(". ")[0]  # a note is the first sentence
    assert layer_notes == [f"mpnb.fp8: 6 layers (0, 1, ..., 5) {cause}"]
    assert notes[-1] == "another warning"  # others keep their first sentence, in order
    one = row_warnings(fell[:1])
    assert one == [f"mpnb.fp8: layer '0' {cause}"]
