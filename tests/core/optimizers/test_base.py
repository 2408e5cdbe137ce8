"""What every fused optimizer shares (``mpnb/core/optimizers/_base.py``), on each class.

* **Pure bf16.** FusedAdam / FusedSGD / FusedLAMB with ``stochastic_rounding`` or
  ``kahan_summation``: the option trains bf16 params and is recorded, seeded runs repeat bit
  for bit and seeds differ, the default generator is untouched without stochastic rounding,
  refusals name the fix, Kahan and SR follow the fp32 run where plain bf16 stalls, and a
  resume (in a fresh process, or through ``state_dict``) keeps the seed, the step and the
  compensation.
* **State, groups, buckets.** A resume from ``state_dict`` is bitwise for every class; per-group
  lrs, empty groups and params without grads; the step plan keeps no grad alive; an LR
  scheduler drives the kernel.
* **The loss-scale seam.** An overflow skips the step and flags it, a scaled step equals the
  plain one, torch's GradScaler drives the fused step.
* **Apex's attributes** (``_dummy_overflow_buf``, each class's ``multi_tensor_*``) for code
  that subclasses them, and the classes on a GPU (PyTorch's fused CUDA ops behind them; the
  ops' CUDA path itself: ``tests/core/ops/test_optim.py``).

The model helpers here (``_mlp``, ``_train_mlp``, ``_close``) serve the classes' unit files.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap
import weakref

import pytest
import torch

from mpnb import amp, amp_C
from mpnb.multi_tensor_apply import multi_tensor_applier
from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from tests.core.optimizers.test_checks import _kw, _randn_params

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
    with pytest.raises(TypeError, match="need no rounding"):
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


def _mlp(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    return m.to(dtype)


def _train_mlp(model, opt, steps=100, seed=1, scale=None):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 13, generator=g).to(next(model.parameters()).dtype)
        opt.zero_grad()
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()


def _close(a, b, rtol=1e-6):
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        rel = ((p.float() - q.float()).norm() / q.float().norm()).item()
        assert rel <= rtol, rel


@pytest.mark.parametrize(
    "make",
    [
        lambda p: FusedAdam(p, lr=1e-2, master_weights=True),
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, master_weights=True),
        lambda p: FusedAdagrad(p, lr=1e-2),
        lambda p: FusedLAMB(p, lr=1e-2),
        lambda p: FusedNovoGrad(p, lr=1e-2, weight_decay=1e-3),
        lambda p: FusedMixedPrecisionLamb(p, lr=1e-2),
    ],
)
def test_state_dict_resume_is_bitwise(kernels, make):
    a = _mlp(dtype=torch.bfloat16)
    oa = make(a.parameters())
    _train_mlp(a, oa, steps=3)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    _train_mlp(a, oa, steps=4, seed=5)
    b = _mlp(seed=9, dtype=torch.bfloat16)
    b.load_state_dict(saved_model)
    ob = make(b.parameters())
    ob.load_state_dict(saved_opt)
    _train_mlp(b, ob, steps=4, seed=5)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
            assert sa[k].dtype == sb[k].dtype


def test_groups_empty_groups_and_params_without_grads(kernels):
    m = _mlp()
    w0, b0 = m[0].weight, m[0].bias
    opt = FusedAdam([{"params": [w0], "lr": 0.0}], lr=1e-2)
    opt.add_param_group({"params": [m[2].weight, m[2].bias], "lr": 1e-1, "weight_decay": 0.5})
    opt.add_param_group({"params": []})
    before = {k: v.clone() for k, v in m.state_dict().items()}
    m(torch.randn(4, 13)).sum().backward()
    m[2].bias.grad = None  # no grad: skipped
    opt.step()
    assert torch.equal(w0, before["0.weight"])  # lr 0 (per-group lr)
    assert torch.equal(b0, before["0.bias"])  # not in the optimizer
    assert torch.equal(m[2].bias, before["2.bias"]) and m[2].bias not in opt.state
    assert not torch.equal(m[2].weight, before["2.weight"])
    assert opt.state[m[2].weight]["step"].item() == 1


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad])
def test_step_keeps_no_grad_alive(kernels, cls):
    # The reused step plan must not hold the step's grads: after zero_grad(set_to_none=True)
    # they are freed, as with torch.optim (else a second copy of every grad lives on).

    m = _mlp()
    opt = cls(m.parameters(), lr=1e-3)
    for _ in range(2):  # the second step reuses the cached plan
        opt.zero_grad(set_to_none=True)
        m(torch.randn(4, 13)).pow(2).mean().backward()
        opt.step()
    grads = [weakref.ref(p.grad) for p in m.parameters()]
    opt.zero_grad(set_to_none=True)
    assert all(g() is None for g in grads)


def test_lr_scheduler_drives_the_kernel(kernels):
    m = _mlp()
    opt = FusedAdam(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)
    sched.step()
    before = copy.deepcopy(m.state_dict())
    m(torch.randn(4, 13)).sum().backward()
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad])
def test_scale_seam_overflow_skips_and_flags(kernels, cls):
    m = _mlp(dtype=torch.bfloat16)
    kw = {"lr": 0.1, "momentum": 0.9} if cls is FusedSGD else {"lr": 0.1}
    opt = cls(m.parameters(), master_weights=True, **kw)
    assert opt._mpnb_accepts_scale
    _train_mlp(m, opt, steps=2)
    snap = copy.deepcopy((m.state_dict(), opt.state_dict()))
    (m(torch.randn(4, 13, dtype=torch.bfloat16)).float().sum() * 256).backward()
    m[2].bias.grad[0] = float("nan")
    found = torch.zeros(1)
    opt._mpnb_set_scale(torch.tensor([1 / 256]), found)
    opt.step()
    assert found.item() == 1
    assert all(torch.equal(v, snap[0][k]) for k, v in m.state_dict().items())
    for pid, s in opt.state_dict()["state"].items():
        for k, v in s.items():
            assert torch.equal(v, snap[1]["state"][pid][k]), k


def test_scale_seam_unscales_like_plain_grads(kernels):
    a, b = _mlp(dtype=torch.bfloat16), _mlp(dtype=torch.bfloat16)
    oa, ob = (FusedAdam(x.parameters(), lr=1e-2, master_weights=True) for x in (a, b))
    x = torch.randn(4, 13, dtype=torch.bfloat16)
    a(x).float().sum().backward()
    (b(x).float().sum() * 1024).backward()
    oa.step()
    found = torch.zeros(1)
    ob._mpnb_set_scale(torch.tensor([1 / 1024]), found)
    ob.step()
    assert found.item() == 0
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)  # scaling by a power of two is exact


def test_torch_grad_scaler_drives_fused_step(kernels):
    m = _mlp()
    opt = FusedAdam(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(m(torch.randn(4, 13)).sum()).backward()
    m[0].weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(m.state_dict())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


@pytest.mark.parametrize(
    "cls, names",
    [
        (FusedAdam, ["multi_tensor_adam"]),
        (FusedLAMB, ["multi_tensor_lamb", "multi_tensor_l2norm"]),
        (FusedSGD, ["multi_tensor_sgd"]),
        (FusedNovoGrad, ["multi_tensor_novograd", "multi_tensor_l2norm"]),
        (FusedAdagrad, ["multi_tensor_adagrad"]),
    ],
)
def test_apex_attributes_are_there(cls, names):
    opt = cls(_randn_params(), **_kw(cls))
    for name in names:
        assert getattr(opt, name) is getattr(amp_C, name)
    assert opt._dummy_overflow_buf.numel() == 1 and opt._dummy_overflow_buf.item() == 0
    norm, _ = multi_tensor_applier(
        getattr(opt, "multi_tensor_l2norm", amp_C.multi_tensor_l2norm),
        opt._dummy_overflow_buf,
        [[torch.full((4,), 3.0)]],
        False,
    )
    assert norm.item() == 6.0


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cls", ["FusedAdam", "FusedSGD", "FusedAdagrad", "FusedLAMB", "FusedNovoGrad"]
)
def test_cuda_optimizers_step_and_skip(cls):
    from mpnb import optimizers

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 8).cuda().to(torch.bfloat16)
    # lr 0.1 for every class: at a default lr of 1e-3 a normalized step (NovoGrad: g / |g|)
    # moves each weight less than half a bf16 ulp, and the bf16 model would not change.
    opt = getattr(optimizers, cls)(model.parameters(), master_weights=True, lr=0.1)
    model(torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)).float().sum().backward()
    before = [p.detach().clone() for p in model.parameters()]
    model.weight.grad[0, 0] = float("inf")
    found = torch.zeros(1, device="cuda")
    opt._mpnb_set_scale(torch.ones(1, device="cuda"), found)
    opt.step()
    assert found.item() == 1
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    model.weight.grad[0, 0] = 0.0
    opt.step()
    assert not torch.equal(before[0], model.weight)


def test_group_args_passes_the_ops_scalars_the_group_names_and_defaults_the_missing():
    from mpnb.optimizers import FusedAdam, FusedSGD

    p = torch.nn.Parameter(torch.zeros(4))
    adam = FusedAdam([p], lr=0.1, eps=1e-6, weight_decay=0.5)
    group = adam.param_groups[0]
    assert adam.group_args(group, "fused_adam_") == {
        "eps": 1e-6,
        "weight_decay": 0.5,
        "bias_correction": True,
    }  # no lr (lr_args), no betas (the op's beta1/beta2), no params
    del group["bias_correction"]  # a group loaded from torch.optim.Adam's checkpoint
    assert adam.group_args(group, "fused_adam_")["bias_correction"] is True
    group["seed"] = group["found_inf"] = 7  # never taken from a group
    assert {"seed", "found_inf"}.isdisjoint(adam.group_args(group, "fused_adam_"))
    p.grad = torch.ones(4)
    adam.step()  # the step runs with the defaulted key
    sgd = FusedSGD([p], lr=0.1, momentum=0.9, nesterov=True)
    assert sgd.group_args(sgd.param_groups[0], "fused_sgd_") == {
        "momentum": 0.9,
        "dampening": 0.0,
        "weight_decay": 0.0,
        "nesterov": True,
    }
