"""Bitwise resume: train k steps, save model+optimizer+amp state, resume in a FRESH process."""

import subprocess
import sys
import textwrap

import pytest
import torch

SCRIPT = textwrap.dedent("""
    import sys, warnings
    import torch
    from mpnb import amp
    mode, level, half, path, k = sys.argv[1:5] + [int(sys.argv[5])]
    warnings.simplefilter("ignore")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16),
                                torch.nn.ReLU(), torch.nn.Linear(16, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    # dynamic scaling asked for explicitly: bf16's default is no loss scaling
    model, opt = amp.initialize(model, opt, opt_level=level, half_dtype=getattr(torch, half),
                                loss_scale="dynamic", verbosity=0)
    amp.current_handle().scalers[0].scale_window = 3  # let the scale grow within the run
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.7)

    def train(steps):
        for i in steps:
            g = torch.Generator().manual_seed(i)
            x, y = torch.randn(8, 6, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x).float(), y)
            if i == 2:
                loss = loss * float("inf")  # one skipped step inside the run
            with amp.scale_loss(loss, opt) as sl:
                sl.backward()
            opt.step()
            sched.step()

    if mode == "full":
        train(range(2 * k))
    elif mode == "first":
        train(range(k))
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                    "amp": amp.state_dict(), "sched": sched.state_dict()}, path + ".ckpt")
        sys.exit(0)
    else:
        ck = torch.load(path + ".ckpt", weights_only=False)
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        amp.load_state_dict(ck["amp"])
        sched.load_state_dict(ck["sched"])
        train(range(k, 2 * k))
    torch.save({"params": [t.clone() for t in model.state_dict().values()],
                "masters": [p.detach().clone() for p in amp.master_params(opt)],
                "opt": opt.state_dict()["state"], "amp": amp.state_dict()}, path + "." + mode)
""")


def _run(tmp_path, *args):
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("level, half", [("O2", "bfloat16"), ("O1", "bfloat16"), ("O2", "float16")])
def test_resume_in_fresh_process_is_bitwise(tmp_path, level, half):
    path, k = str(tmp_path / "run"), "4"
    _run(tmp_path, "full", level, half, path, k)
    _run(tmp_path, "first", level, half, path, k)
    _run(tmp_path, "resume", level, half, path, k)
    full = torch.load(path + ".full", weights_only=False)
    resumed = torch.load(path + ".resume", weights_only=False)
    assert full["amp"] == resumed["amp"]
    # step 2 skipped (2**15), 3 clean steps grew it back (2**16), then 2 more clean steps
    assert full["amp"]["loss_scaler0"]["loss_scale"] == 2.0**16
    assert full["amp"]["loss_scaler0"]["unskipped"] == 2
    for key in ("params", "masters"):
        assert len(full[key]) == len(resumed[key])
        for a, b in zip(full[key], resumed[key], strict=False):
            assert a.dtype == b.dtype and torch.equal(a, b), key
    if level == "O2":
        assert all(m.dtype == torch.float32 for m in full["masters"])
    for st_a, st_b in zip(full["opt"].values(), resumed["opt"].values(), strict=False):
        for name in st_a:
            assert torch.equal(torch.as_tensor(st_a[name]), torch.as_tensor(st_b[name])), name
