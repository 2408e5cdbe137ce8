"""``python -m mpnb.apex --check``: every Apex name a script uses, found with ast without running
it, with its status (provides/emulates/lacks), its home in mpnb and its torch.amp port."""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from mpnb.apex import main
from mpnb.compat import check_script, format_report

ROOT = pathlib.Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "apex" / "simple_distributed.py"

SCRIPT = """\
raise SystemExit("--check must never run the script")
import importlib
import torch
import apex
import apex.parallel as P
import amp_C
from apex import amp
from apex.parallel import DistributedDataParallel as DDP
from apex.fp16_utils import FP16Model
from apex.contrib.optimizers import DistributedFusedAdam
syncbn = importlib.import_module("syncbn")
model = DDP(P.convert_syncbn_model(torch.nn.BatchNorm2d(3)).cuda())
model, opt = amp.initialize(model, None, opt_level="O2")
print(amp._amp_state.loss_scalers[0].loss_scale(), apex.optimizers.FusedLAMB)
amp.init()
torch.distributed.init_process_group("nccl")
x = torch.zeros(1, device=f"cuda:{0}")
"""


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "apex_script.py"
    path.write_text(SCRIPT)
    return path


def test_every_apex_name_with_status_home_port_and_lines(script):
    report = check_script(str(script))
    rows = {r.name: r for r in report.names}
    expected = {  # name: (status, home in mpnb, lines)
        "apex": ("provides", "mpnb", (4,)),
        "apex.parallel": ("provides", "mpnb.parallel", (5,)),
        "amp_C": ("provides", "mpnb.amp_C", (6,)),
        "apex.amp": ("provides", "mpnb.amp", (7,)),
        "apex.parallel.DistributedDataParallel": (
            "provides",
            "mpnb.parallel.DistributedDataParallel",
            (8, 12),
        ),
        "apex.fp16_utils.FP16Model": ("provides", "mpnb.fp16_utils.FP16Model", (9,)),
        "apex.contrib.optimizers.DistributedFusedAdam": ("lacks", None, (10,)),
        "syncbn": ("emulates", "mpnb.compat.syncbn", (11,)),
        "apex.parallel.convert_syncbn_model": (
            "provides",
            "mpnb.parallel.convert_syncbn_model",
            (12,),
        ),
        "apex.amp.initialize": ("provides", "mpnb.amp.initialize", (13,)),
        "apex.amp._amp_state.loss_scalers": (
            "emulates",
            "mpnb.compat.amp_state.loss_scalers",
            (14,),
        ),
        "apex.optimizers.FusedLAMB": ("provides", "mpnb.optimizers.FusedLAMB", (14,)),
        "apex.amp.init": ("provides", "mpnb.amp.init", (15,)),
    }
    assert set(rows) == set(expected)
    for name, (status, home, lines) in expected.items():
        assert (rows[name].status, rows[name].mpnb, rows[name].lines) == (status, home, lines)
        assert rows[name].port, f"{name} has no port"
    assert "GradScaler" in rows["apex.amp.initialize"].port + rows["apex.amp"].port
    assert rows["apex.parallel.DistributedDataParallel"].port.startswith(
        "torch.nn.parallel.DistributedDataParallel"
    )
    assert "read-only" in rows["apex.amp._amp_state.loss_scalers"].note
    assert report.count("lacks") == 1 and report.count("emulates") == 2
    assert report.cuda_only == {
        ".cuda()": [12],
        'backend="nccl"': [16],
        'device="cuda"': [17],
    }
    text = format_report(report)
    assert "13 Apex names: 10 provided by mpnb, 2 emulated, 1 lacking" in text
    assert "python -m mpnb.apex --cpu" in text and "Porting to torch.amp" in text


def test_cli_check_json_on_the_apex_example_and_exit_codes(script):
    r = subprocess.run(
        [sys.executable, "-m", "mpnb.apex", "--check", "--json", str(EXAMPLE)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    report = json.loads(r.stdout)
    names = {n["name"]: n["status"] for n in report["names"]}
    assert names == {
        "apex.amp": "provides",
        "apex.parallel.DistributedDataParallel": "provides",
        "apex.parallel.convert_syncbn_model": "provides",
        "apex.amp.initialize": "provides",
        "apex.amp.scale_loss": "provides",
        "apex.amp._amp_state.loss_scalers": "emulates",
    }
    assert report["counts"] == {"provides": 5, "emulates": 1, "lacks": 0}
    assert {".cuda()", 'backend="nccl"', "torch.cuda.set_device"} <= set(report["cuda_only"])
    assert main(["--check", str(script)]) == 1  # a lacking name fails the check


def test_cli_usage_errors_name_the_fix(capsys, tmp_path):
    assert main(["--help"]) == 0
    assert main(["--bogus", "x.py"]) == 2
    assert "options go before SCRIPT" in capsys.readouterr().err
    assert main(["--cpu", "--check", str(EXAMPLE)]) == 2
    assert main(["--json", str(EXAMPLE)]) == 2
    assert main([str(tmp_path / "missing.py")]) == 2
    assert main([]) == 2
    bad = tmp_path / "bad.py"
    bad.write_text("def f(:\n")
    assert main(["--check", str(bad)]) == 2  # one clear line, no traceback
    assert "not valid Python" in capsys.readouterr().err
    with pytest.raises(SyntaxError, match="not valid Python"):
        check_script(str(bad))


def test_the_script_is_only_parsed(tmp_path):
    marker = tmp_path / "ran"
    script = tmp_path / "side_effect.py"
    script.write_text(
        textwrap.dedent(f"""
        import pathlib
        pathlib.Path({str(marker)!r}).write_text("ran")
        from apex import amp
        """)
    )
    assert [r.name for r in check_script(str(script)).names] == ["apex.amp"]
    assert not marker.exists()


def test_the_ports_name_what_a_literal_port_gets_wrong():
    """A GradScaler without a device is CUDA's (off on a CPU), AdamW's default decay is not
    FusedAdam's, and grads read before unscale_ are scaled: each port says so."""
    from mpnb.compat.names import NAMES

    assert "GradScaler(device_type)" in NAMES["apex.amp.scale_loss"].port
    assert "weight_decay=0.0" in NAMES["apex.optimizers.FusedAdam"].port
    assert "unscale_(optimizer)" in NAMES["apex.amp.master_params"].port
