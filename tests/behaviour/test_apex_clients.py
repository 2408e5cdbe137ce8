"""The Apex internals real client code writes to and probes for, written from those clients:
GNMT sets its loss scaler's growth window (``loss_scaler._scale_seq_len``), NVIDIA's BERT
resumes through ``optimizer._lazy_init_maybe_master_weights()`` and
``optimizer._amp_stash.lazy_init_called = True``, fairseq probes ``import fused_adam_cuda``
(only ``--deprecated_fused_adam`` Apex builds have it) before taking Apex's FusedAdam, and the
CPU rehearsal meets ``torch.cuda.device(...)`` contexts."""

from __future__ import annotations

import copy
import importlib
import io
import subprocess
import sys
import textwrap

import pytest
import torch

from mpnb import amp
from mpnb.compat import CpuRehearsal, apex_alias


def _o2(seed=0, opt_cls=torch.optim.Adam):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    opt = opt_cls(model.parameters(), lr=1e-2)
    return amp.initialize(model, opt, opt_level="O2", loss_scale="dynamic", verbosity=0)


def _train(model, opt, steps, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(4, 6, generator=g).to(next(model.parameters()).dtype)
        loss = model(x).float().pow(2).mean()
        opt.zero_grad()
        with amp.scale_loss(loss, opt) as scaled:
            scaled.backward()
        opt.step()


def test_gnmt_sets_the_loss_scale_window_through_amp_state():
    """GNMT: ``loss_scaler = amp._amp_state.loss_scalers[0]``, then ``_loss_scale`` and
    ``_scale_seq_len`` set; the scaler grows after that many clean steps."""
    model, opt = _o2()
    with apex_alias():
        from apex import amp as apex_amp

        loss_scaler = apex_amp._amp_state.loss_scalers[0]
        loss_scaler._loss_scale = 8192
        loss_scaler._scale_seq_len = 3
    scaler = amp.current_handle().scalers[0]
    assert scaler.scale_window == 3 == loss_scaler._scale_seq_len
    assert scaler.loss_scale() == 8192
    _train(model, opt, 3)
    assert scaler.loss_scale() == 16384  # grew after 3 clean steps, not Apex's 2000
    with pytest.raises(ValueError, match="growth_interval"):
        loss_scaler._scale_seq_len = 0  # validated by the scaler's own rule
    with pytest.raises(AttributeError, match="read-only.*assignable"):
        loss_scaler.dynamic = False


def test_bert_resume_recipe_restores_the_fp32_masters():
    """NVIDIA's BERT resumes O2 training: load the optimizer, call
    ``_lazy_init_maybe_master_weights()``, set ``_amp_stash.lazy_init_called = True``, load
    again, copy the saved fp32 masters into ``amp.master_params(optimizer)``, load amp."""
    model, opt = _o2()
    _train(model, opt, 3)
    ckpt = copy.deepcopy(
        {  # state_dict()s hold the live tensors: copy, as torch.save does
            "model": model.state_dict(),
            "optimizer": opt.state_dict(),
            "master params": [p.detach().clone() for p in amp.master_params(opt)],
            "amp": amp.state_dict(),
        }
    )
    _train(model, opt, 2, seed=7)  # the run goes on: what a fresh process continues from
    want = [p.detach().clone() for p in amp.master_params(opt)]

    model2, opt2 = _o2(seed=5)  # other initial weights: everything must come from ckpt
    model2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optimizer"])
    opt2._lazy_init_maybe_master_weights()
    opt2._amp_stash.lazy_init_called = True
    opt2.load_state_dict(ckpt["optimizer"])
    for param, saved in zip(amp.master_params(opt2), ckpt["master params"], strict=True):
        param.data.copy_(saved.data)
    amp.load_state_dict(ckpt["amp"])
    _train(model2, opt2, 2, seed=7)
    got = list(amp.master_params(opt2))
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    with pytest.raises(AttributeError, match="lazy_init_called = True"):
        opt2._amp_stash.lazy_init_called = False


def test_a_standard_build_has_no_fused_adam_cuda_so_fairseq_takes_fused_adam():
    """fairseq's probe: ``importlib.import_module("fused_adam_cuda")`` first (its old
    FusedAdamV1), on ImportError Apex's FusedAdam through ``multi_tensor_applier``."""

    def fairseq_choice():
        try:
            importlib.import_module("fused_adam_cuda")
            return "FusedAdamV1"
        except ImportError:
            from apex.multi_tensor_apply import multi_tensor_applier
            from apex.optimizers import FusedAdam  # noqa: F401

            return "FusedAdamV2" if multi_tensor_applier.available else None

    with apex_alias():
        assert fairseq_choice() == "FusedAdamV2"
        with pytest.raises(ModuleNotFoundError, match="--deprecated_fused_adam") as err:
            import fused_adam_cuda  # noqa: F401
        assert err.value.name == "fused_adam_cuda"
    with apex_alias({"--deprecated_fused_adam"}):  # an Apex built with that option
        assert fairseq_choice() == "FusedAdamV1"
    with pytest.raises(ValueError, match="build option"):
        apex_alias({"--fast_layer_norm"})


def test_cli_serves_fused_adam_cuda_only_with_the_build_flag(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text("import fused_adam_cuda\nprint('has', fused_adam_cuda.adam)\n")
    run = [sys.executable, "-m", "mpnb.apex"]
    r = subprocess.run([*run, str(script)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "No module named 'fused_adam_cuda'" in r.stderr
    r = subprocess.run(
        [*run, "--deprecated_fused_adam", str(script)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0 and "has" in r.stdout, r.stderr


def test_cpu_rehearsal_neutralises_cuda_device_contexts():
    """Apex-era code switches devices with ``with torch.cuda.device(i):`` (fairseq's
    FusedAdamV1 step, Apex's multi-device tests); on the CPU there is one device."""
    out = io.StringIO()
    with CpuRehearsal(out) as r:
        with torch.cuda.device(0):
            x = torch.ones(3, device="cuda")
        with torch.cuda.device("cuda:1"), torch.cuda.device_of(x):
            y = torch.zeros(2, device=torch.cuda.current_device())
        assert torch.cuda.current_device() == 0 and 1 % torch.cuda.device_count() == 0
        torch.cuda.cudart().cudaProfilerStart()
        torch.cuda.cudart().cudaProfilerStop()
        free, total = torch.cuda.mem_get_info()  # the host's memory
        assert 0 < free <= total and torch.cuda.memory.mem_get_info()[1] == total
    assert x.device.type == "cpu" and y.device.type == "cpu"
    assert any("torch.cuda.device" in line for line in r.reported)
    # everything put back
    assert torch.cuda.device.__module__.startswith("torch")
    assert torch.cuda.current_device.__module__.startswith("torch")


def test_apex_script_with_device_context_runs_under_cpu(tmp_path):
    script = tmp_path / "dev.py"
    script.write_text(
        textwrap.dedent("""
        import torch
        from apex.optimizers import FusedAdam
        p = torch.nn.Parameter(torch.ones(4).cuda())
        opt = FusedAdam([p], lr=0.1)
        with torch.cuda.device(p.device):
            p.grad = torch.ones_like(p)
            opt.step()
        print("stepped", float(p.sum()))
        """)
    )
    r = subprocess.run(
        [sys.executable, "-m", "mpnb.apex", "--cpu", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr[-2000:]
    assert "stepped" in r.stdout
