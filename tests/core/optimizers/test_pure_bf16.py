"""FusedAdam / FusedSGD / FusedLAMB with ``stochastic_rounding`` or ``kahan_summation``."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from mpnb import amp
from mpnb.optimizers import FusedAdam, FusedLAMB, FusedSGD

CLASSES = {
    "adam": (FusedAdam, dict(lr=1e-2, weight_decay=0.01)),
    "sgd": (FusedSGD, dict(lr=0.1, momentum=0.9)),
    "lamb": (FusedLAMB, dict(lr=1e-2)),
}
OPTIONS = ("stochastic_rounding", "kahan_summation")


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.Tanh(), torch.nn.Linear(33, 2)).to(
        dtype
    )


def _train(model, opt, steps, start=0):
    for i in range(start, start + steps):
        g = torch.Generator().manual_seed(i)
        x = torch.randn(16, 9, generator=g).to(model[0].weight.dtype)
        opt.zero_grad()
        model(x).float().square().mean().backward()
        opt.step()


def _bits(model):
    return [p.detach().view(torch.int16).clone() for p in model.parameters()]


@pytest.mark.parametrize("name", CLASSES)
@pytest.mark.parametrize("option", OPTIONS)
def test_option_trains_bf16_params_and_is_recorded(op_impl, name, option):
    cls, kw = CLASSES[name]
    model = _model()
    before = _bits(model)
    opt = cls(
        model.parameters(), **kw, **{option: True}, generator=torch.Generator().manual_seed(0)
    )
    assert opt.defaults[option] is True and opt.param_groups[0][option] is True
    _train(model, opt, 3)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, _bits(model), strict=True))
    state = opt.state[model[0].weight]
    if option == "kahan_summation":
        assert state["compensation"].dtype == torch.bfloat16
        assert state["compensation"].float().abs().sum() > 0
    else:
        assert "compensation" not in state
        assert opt.state_dict()["rounding"]["step"] == 3


@pytest.mark.parametrize("name", CLASSES)
def test_seeded_runs_repeat_bitwise_and_seeds_differ(kernels, name):
    cls, kw = CLASSES[name]

    def run(seed):
        model = _model()
        gen = torch.Generator().manual_seed(seed)
        _train(model, cls(model.parameters(), **kw, stochastic_rounding=True, generator=gen), 3)
        return _bits(model)

    a, b, c = run(1), run(1), run(2)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert any(not torch.equal(x, y) for x, y in zip(a, c, strict=True))


def test_default_generator_is_untouched_without_stochastic_rounding():
    params = list(_model().parameters())
    torch.manual_seed(3)
    FusedAdam(params, kahan_summation=True)
    x = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(x, torch.rand(1))


def test_refusals_name_the_fix():
    params = list(_model().parameters())
    with pytest.raises(ValueError, match="pick one"):
        FusedAdam(params, stochastic_rounding=True, kahan_summation=True)
    with pytest.raises(ValueError, match="master weights"):
        FusedSGD(params, lr=0.1, kahan_summation=True, master_weights=True)
    model = _model(torch.float32)
    opt = FusedAdam(model.parameters(), stochastic_rounding=True)
    with pytest.raises(TypeError, match="fp32 params need no rounding"):
        _train(model, opt, 1)
    model = _model(torch.float32)
    opt = FusedLAMB(model.parameters(), kahan_summation=True)
    with pytest.raises(RuntimeError, match="O3"):
        amp.initialize(model, opt, opt_level="O2", half_dtype=torch.bfloat16, verbosity=0)
    assert model[0].weight.dtype == torch.float32  # refused before the model changed


def test_kahan_and_sr_follow_the_fp32_run_where_plain_bf16_stalls(kernels):
    """SGD with momentum from the same bf16 weights and the same grads: bf16 runs against fp32."""
    g = torch.Generator().manual_seed(0)
    w0 = torch.randn(4096, generator=g).bfloat16()
    grads = [torch.randn(4096, generator=g) for _ in range(5)]

    def run(dtype, **opts):
        p = torch.nn.Parameter(w0.to(dtype, copy=True))
        opt = FusedSGD([p], lr=2e-4, momentum=0.9, **opts)
        for i in range(100):
            p.grad = grads[i % 5].to(dtype)
            opt.step()
        return p.detach().float()

    ref = run(torch.float32)
    err = {
        k: (run(torch.bfloat16, **o) - ref).abs().mean().item()
        for k, o in (
            ("plain", {}),
            ("kahan", dict(kahan_summation=True)),
            ("sr", dict(stochastic_rounding=True)),
        )
    }
    ulp = (ref.abs() * 2.0**-8).mean().item()  # bf16's mean half-ulp: a final rounding
    assert err["kahan"] < 1.5 * ulp < err["plain"], err
    assert err["sr"] < 0.5 * err["plain"], err


SCRIPT = textwrap.dedent("""
    import sys, torch
    from mpnb.optimizers import FusedAdam, FusedLAMB, FusedSGD
    mode, path = sys.argv[1:3]
    runs = [("adam", FusedAdam, dict(lr=1e-2), "stochastic_rounding"),
            ("adam", FusedAdam, dict(lr=1e-2), "kahan_summation"),
            ("sgd", FusedSGD, dict(lr=0.1, momentum=0.9), "stochastic_rounding"),
            ("lamb", FusedLAMB, dict(lr=1e-2), "kahan_summation")]
    out = {}
    for name, cls, kw, option in runs:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.Tanh(),
                                    torch.nn.Linear(33, 2)).bfloat16()
        gen = torch.Generator().manual_seed(5)
        opt = cls(model.parameters(), **kw, **{option: True}, generator=gen)
        def train(steps):
            for i in steps:
                x = torch.randn(16, 9, generator=torch.Generator().manual_seed(i)).bfloat16()
                opt.zero_grad()
                model(x).float().square().mean().backward()
                opt.step()
        key = name + "-" + option
        if mode == "resume":
            ck = torch.load(path + "." + key, weights_only=False)
            model.load_state_dict(ck["model"])
            torch.manual_seed(123)  # another global RNG state: the saved seed must win
            opt = cls(model.parameters(), **kw, **{option: True})
            opt.load_state_dict(ck["opt"])
            train(range(3, 6))
        else:
            train(range(3))
            if mode == "first":
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()},
                           path + "." + key)
                continue
            train(range(3, 6))
        out[key] = [p.detach().view(torch.int16).clone() for p in model.parameters()]
    if mode != "first":
        torch.save(out, path + "." + mode)
""")


def _run(tmp_path, *args):
    script = tmp_path / "pure_bf16.py"
    script.write_text(SCRIPT)
    r = subprocess.run(
        [sys.executable, str(script), *args], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]


@pytest.mark.slow
def test_resume_in_a_fresh_process_is_bitwise(tmp_path, kernels):
    path = str(tmp_path / "run")
    for mode in ("full", "first", "resume"):
        _run(tmp_path, mode, path)
    full = torch.load(path + ".full", weights_only=False)
    resumed = torch.load(path + ".resume", weights_only=False)
    assert set(full) == set(resumed) and len(full) == 4
    for key in full:
        assert all(torch.equal(a, b) for a, b in zip(full[key], resumed[key], strict=True)), key


def test_state_dict_round_trip_keeps_seed_step_and_bf16_compensation():
    model = _model()
    opt = FusedAdam(model.parameters(), stochastic_rounding=True)
    _train(model, opt, 2)
    sd = opt.state_dict()
    other = FusedAdam(model.parameters(), stochastic_rounding=True)
    other.load_state_dict(sd)
    assert (
        other.state_dict()["rounding"] == sd["rounding"] == {"seed": opt._rounding.seed, "step": 2}
    )
    with pytest.raises(ValueError, match="nothing was loaded"):
        other.load_state_dict({**sd, "rounding": {"seed": "x"}})
    kahan = FusedSGD(model.parameters(), lr=0.1, kahan_summation=True)
    _train(model, kahan, 1)
    assert "rounding" not in kahan.state_dict()
    again = FusedSGD(model.parameters(), lr=0.1, kahan_summation=True)
    again.load_state_dict(kahan.state_dict())
    assert again.state[model[0].weight]["compensation"].dtype == torch.bfloat16
