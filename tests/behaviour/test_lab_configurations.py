"""Every configuration of ``mpnb.core.precision_configs`` beyond O0-O3 trains through the lab
(``compare`` and ``mpnb compare --json``), and a new one runs by its table entry alone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import mpnb.lab
from mpnb.core.precision_configs import (
    config_names,
    get_config,
)
from mpnb.lab.config import expand
from mpnb.lab.machine import fp8_support
from mpnb.lab.memory import ROLES

#: mpnb's configurations beyond O0-O3 (the peers, PyTorch's own ways, are tested in test_peers)
NEW = [
    n
    for n in config_names()
    if n not in ("O0", "O1", "O2", "O3") and not get_config(n).peer and "+graph" not in n
]


FP8 = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8")


FP4 = {  # the four-bit recipes and their formats
    **dict.fromkeys(("nvfp4", "nvfp4-no-rht", "nvfp4-no-sr", "nvfp4-1d", "nvfp4-torchao"), "nvfp4"),
    **dict.fromkeys(("mxfp4", "mxfp4+sr+rht"), "mxfp4"),
}


MIB = 2.0**20


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
    sr = rows["bf16-pure+sr"]["warnings"]
    assert "FusedSGD(" in sr and "stochastic_rounding=True" in sr
    assert all(rows[n]["precision"].startswith("fp8") for n in FP8)
    assert doc["hardware"]["fp8"] == "emulated" and "fp8 emulated" in doc["hardware"]["summary"]
    assert "fp8" in p.stderr and "emulated" in p.stderr  # the note before the run


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
