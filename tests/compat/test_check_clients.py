"""``python -m mpnb.apex --check`` on client layouts it missed, written from them: NVIDIA's BERT
(``run_squad.py`` importing its own ``modeling``/``optimization`` modules, whose LAMB binds
``amp_C`` kernels at import, and whose resume path writes Apex's private stash), GNMT (its
trainer writes the loss scaler's ``_scale_seq_len``), a port per name that holds (torch has no
LAMB), and files that are not UTF-8."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from mpnb.apex import main
from mpnb.compat import MODULES, check_script, format_report
from mpnb.compat.check import resolve

RUN_SQUAD = """\
import torch
from apex import amp
from optimization import BertLAMB
import modeling
from utils.helpers import save_ckpt

def resume(optimizer, checkpoint):
    optimizer._lazy_init_maybe_master_weights()
    optimizer._amp_stash.lazy_init_called = True
    optimizer.load_state_dict(checkpoint["optimizer"])
    for p, s in zip(amp.master_params(optimizer), checkpoint["master params"]):
        p.data.copy_(s.data)
"""
OPTIMIZATION = """\
import amp_C
from apex.multi_tensor_apply import multi_tensor_applier
lamb_compute_update = amp_C.multi_tensor_lamb_stage1_cuda
lamb_apply_update = amp_C.multi_tensor_lamb_stage2_cuda

class BertLAMB(torch.optim.Optimizer):
    pass
"""
MODELING = """\
from apex.contrib.multihead_attn import SelfMultiheadAttn
from .helpers_not_a_package import x
"""
HELPERS = """\
from apex.normalization import FusedLayerNorm
"""
GNMT_TRAINER = """\
from apex import amp

class Trainer:
    def __init__(self, loss_scale, dls_upscale_interval):
        loss_scaler = amp._amp_state.loss_scalers[0]
        loss_scaler._loss_scale = loss_scale
        loss_scaler._scale_seq_len = dls_upscale_interval
        self.scaler = loss_scaler
        self.scaler._has_overflow = False
"""


@pytest.fixture
def bert(tmp_path):
    (tmp_path / "run_squad.py").write_text(RUN_SQUAD)
    (tmp_path / "optimization.py").write_text(OPTIMIZATION)
    (tmp_path / "modeling.py").write_text(MODELING)
    (tmp_path / "utils").mkdir()
    (tmp_path / "utils" / "__init__.py").write_text("")
    (tmp_path / "utils" / "helpers.py").write_text(HELPERS)
    return tmp_path / "run_squad.py"


def test_local_modules_are_read_and_named(bert):
    report = check_script(str(bert))
    assert report.modules == [
        "optimization.py",
        "modeling.py",
        "utils/__init__.py",
        "utils/helpers.py",
    ]
    rows = {r.name: r for r in report.names}
    stage1 = rows["amp_C.multi_tensor_lamb_stage1_cuda"]
    assert stage1.status == "provides" and stage1.lines == ()
    assert stage1.elsewhere == ("optimization.py:3",)
    assert rows["apex.normalization.FusedLayerNorm"].elsewhere == ("utils/helpers.py:1",)
    lacking = rows["apex.contrib.multihead_attn.SelfMultiheadAttn"]
    assert lacking.status == "lacks" and lacking.elsewhere == ("modeling.py:1",)
    text = format_report(report)
    assert "Read with the local modules it imports: optimization.py, modeling.py" in text
    assert main(["--check", str(bert)]) == 1  # modeling.py lacks a name: the check fails
    assert check_script(str(bert), follow_imports=False).modules == []


def test_private_state_writes_and_calls_are_reported(bert, tmp_path):
    report = check_script(str(bert))
    private = {p.key: p for p in report.private}
    assert set(private) == {"_lazy_init_maybe_master_weights()", "_amp_stash.lazy_init_called"}
    assert private["_amp_stash.lazy_init_called"].where == (9,)
    assert private["_amp_stash.lazy_init_called"].status == "emulates"
    gnmt = tmp_path / "seq2seq_trainer.py"
    gnmt.write_text(GNMT_TRAINER)
    report = check_script(str(gnmt))
    private = {p.key: p for p in report.private}
    assert set(private) == {"_loss_scale", "_scale_seq_len"}  # _has_overflow is no table key
    assert "scale_window" in private["_scale_seq_len"].mpnb
    assert "growth_interval" in private["_scale_seq_len"].port
    assert private["_scale_seq_len"].code == "loss_scaler._scale_seq_len"
    text = format_report(report)
    assert "Apex internals written or called" in text and "7: loss_scaler._scale_seq_len" in text
    out = subprocess.run(
        [sys.executable, "-m", "mpnb.apex", "--check", "--json", str(gnmt)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert {p["key"] for p in json.loads(out.stdout)["private"]} == set(private)


def test_a_write_to_the_stash_itself_is_lacking(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("optimizer._amp_stash = None\noptimizer._amp_stash.fp16_groups = []\n")
    report = check_script(str(script))
    assert [(p.key, p.status) for p in report.private] == [
        ("_amp_stash", "lacks"),
        ("_amp_stash.*", "lacks"),
    ]
    assert report.lacking() == 2


def test_every_optimizer_and_amp_C_name_has_a_true_port_of_its_own():
    """No name inherits a module-wide port that is false for it (``torch.optim with
    fused=True`` for FusedLAMB: torch has no LAMB)."""
    import mpnb.amp_C
    import mpnb.optimizers

    for module, names in (
        ("apex.optimizers", mpnb.optimizers.__all__),
        ("amp_C", mpnb.amp_C.__all__),
    ):
        row_port = MODULES[module].port
        for n in names:
            full, status, home, port, _ = resolve(f"{module}.{n}")
            assert status != "lacks" and port != row_port, full
    for name in (
        "apex.optimizers.FusedLAMB",
        "apex.optimizers.fused_lamb.FusedLAMB",
        "amp_C.multi_tensor_lamb_stage1_cuda",
        "apex.optimizers.FusedNovoGrad",
    ):
        port = resolve(name)[3]
        assert "fused=True" not in port and port.startswith("torch has no"), (name, port)
    assert resolve("apex.parallel.LARC")[3].startswith("torch has no LARC")
    assert "fused=True" in resolve("apex.optimizers.FusedAdam")[3]


def test_a_file_that_is_not_utf8_gets_one_clear_line(tmp_path, capsys):
    bad = tmp_path / "latin.py"
    bad.write_bytes("# caf\xe9\nfrom apex import amp\n".encode("latin-1"))
    assert main(["--check", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "is not valid UTF-8" in err and "coding: latin-1" in err and "Traceback" not in err
    declared = tmp_path / "declared.py"
    declared.write_bytes(
        "# -*- coding: latin-1 -*-\n# caf\xe9\nfrom apex import amp\n".encode("latin-1")
    )
    assert [r.name for r in check_script(str(declared)).names] == ["apex.amp"]
    r = subprocess.run(
        [sys.executable, "-m", "mpnb.apex", "--check", str(bad)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr


def test_a_local_module_that_is_not_utf8_is_named(tmp_path, capsys):
    (tmp_path / "main.py").write_text("import helper\n")
    (tmp_path / "helper.py").write_bytes(b"x = '\xff'\n")
    assert main(["--check", str(tmp_path / "main.py")]) == 2
    assert "not valid UTF-8" in capsys.readouterr().err


def test_relative_and_package_imports(tmp_path):
    pkg = tmp_path / "seq2seq"
    (pkg / "train").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train" / "__init__.py").write_text("")
    (pkg / "train" / "trainer.py").write_text(GNMT_TRAINER)
    (pkg / "train" / "fp_optimizers.py").write_text("from . import trainer\nimport amp_C\n")
    (tmp_path / "train.py").write_text(
        textwrap.dedent("""
        from seq2seq.train.fp_optimizers import Fp16Optimizer
        """)
    )
    report = check_script(str(tmp_path / "train.py"))
    assert report.modules == [
        "seq2seq/__init__.py",
        "seq2seq/train/__init__.py",
        "seq2seq/train/fp_optimizers.py",
        "seq2seq/train/trainer.py",
    ]
    assert {p.key for p in report.private} == {"_loss_scale", "_scale_seq_len"}
    assert any(r.name == "amp_C" for r in report.names)
