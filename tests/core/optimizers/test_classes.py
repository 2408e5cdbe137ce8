"""Fused optimizer classes: parity with torch.optim over 100 steps, checkpoints, groups, the
loss-scale seam, LARC."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mpnb.core.ops import multi_tensor_l2norm
from mpnb.optimizers import (
    FusedAdagrad,
    FusedAdam,
    FusedLAMB,
    FusedMixedPrecisionLamb,
    FusedNovoGrad,
    FusedSGD,
)
from mpnb.parallel import LARC


def _model(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 5))
    return m.to(dtype)


def _train(model, opt, steps=100, seed=1, scale=None):
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


PAIRS = [
    (
        lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, fused=True),
    ),
    (
        lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.1, adam_w_mode=False),
        lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1, foreach=False),
    ),
    (
        lambda p: FusedAdam(p, lr=1e-2, bias_correction=True, betas=(0.8, 0.99)),
        lambda p: torch.optim.AdamW(p, lr=1e-2, betas=(0.8, 0.99), weight_decay=0.0),
    ),
    (
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1, weight_decay=1e-3),
    ),
    (
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, nesterov=True),
        lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, fused=True),
    ),
    (lambda p: FusedSGD(p, lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    (
        lambda p: FusedAdagrad(p, lr=1e-2, weight_decay=1e-2),
        lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=1e-2, eps=1e-10),
    ),
]


@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_parity_with_torch_100_steps(kernels, pair):
    ours, theirs = PAIRS[pair]
    a, b = _model(), _model()
    _train(a, ours(a.parameters()))
    _train(b, theirs(b.parameters()))
    _close(a, b)


def test_checkpoints_interchange_with_torch(kernels):
    a, b = _model(), _model()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    _train(a, ta, steps=5)
    b.load_state_dict(a.state_dict())
    fb = FusedAdam(b.parameters(), lr=1e-2, weight_decay=0.1)
    fb.load_state_dict(copy.deepcopy(ta.state_dict()))
    _train(a, ta, steps=20, seed=2)
    _train(b, fb, steps=20, seed=2)
    _close(a, b)
    ta2 = torch.optim.AdamW(_model().parameters(), lr=1e-2)
    ta2.load_state_dict(fb.state_dict())  # and back
    assert ta2.state_dict()["state"][0]["step"].item() == 25


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
    a = _model(dtype=torch.bfloat16)
    oa = make(a.parameters())
    _train(a, oa, steps=3)
    saved_model, saved_opt = copy.deepcopy(a.state_dict()), copy.deepcopy(oa.state_dict())
    _train(a, oa, steps=4, seed=5)
    b = _model(seed=9, dtype=torch.bfloat16)
    b.load_state_dict(saved_model)
    ob = make(b.parameters())
    ob.load_state_dict(saved_opt)
    _train(b, ob, steps=4, seed=5)
    for p, q in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(p, q)
    for sa, sb in zip(oa.state.values(), ob.state.values(), strict=True):
        for k in sa:
            assert torch.equal(sa[k], sb[k]), k
            assert sa[k].dtype == sb[k].dtype


def test_groups_empty_groups_and_params_without_grads(kernels):
    m = _model()
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
    import weakref

    m = _model()
    opt = cls(m.parameters(), lr=1e-3)
    for _ in range(2):  # the second step reuses the cached plan
        opt.zero_grad(set_to_none=True)
        m(torch.randn(4, 13)).pow(2).mean().backward()
        opt.step()
    grads = [weakref.ref(p.grad) for p in m.parameters()]
    opt.zero_grad(set_to_none=True)
    assert all(g() is None for g in grads)


def test_lr_scheduler_drives_the_kernel(kernels):
    m = _model()
    opt = FusedAdam(m.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.0)
    sched.step()
    before = copy.deepcopy(m.state_dict())
    m(torch.randn(4, 13)).sum().backward()
    opt.step()
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def test_amsgrad_and_bad_args_raise():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam(p, amsgrad=True)
    with pytest.raises(ValueError, match="Nesterov"):
        FusedSGD(p, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="norm_type"):
        FusedNovoGrad(p, norm_type=1)


@pytest.mark.parametrize("cls", [FusedAdam, FusedSGD, FusedAdagrad, FusedLAMB, FusedNovoGrad])
def test_scale_seam_overflow_skips_and_flags(kernels, cls):
    m = _model(dtype=torch.bfloat16)
    kw = {"lr": 0.1, "momentum": 0.9} if cls is FusedSGD else {"lr": 0.1}
    opt = cls(m.parameters(), master_weights=True, **kw)
    assert opt._mpnb_accepts_scale
    _train(m, opt, steps=2)
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
    a, b = _model(dtype=torch.bfloat16), _model(dtype=torch.bfloat16)
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
    m = _model()
    opt = FusedAdam(m.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    scaler.scale(m(torch.randn(4, 13)).sum()).backward()
    m[0].weight.grad[0, 0] = float("inf")
    before = copy.deepcopy(m.state_dict())
    scaler.step(opt)
    scaler.update()
    assert scaler.get_scale() == 2.0**9
    assert all(torch.equal(v, before[k]) for k, v in m.state_dict().items())


def _lamb_reference_step(params, state, lr, b1, b2, eps, wd, max_norm):
    """LAMB from the paper, plain PyTorch, fp64 norms."""
    gnorm = torch.stack([p.grad.double().norm() for p in params]).norm()
    clip = max(gnorm.item() / max_norm, 1.0)
    for p in params:
        s = state.setdefault(p, {"m": torch.zeros_like(p), "v": torch.zeros_like(p), "t": 0})
        s["t"] += 1
        g = p.grad / clip
        s["m"] = b1 * s["m"] + (1 - b1) * g
        s["v"] = b2 * s["v"] + (1 - b2) * g * g
        u = (s["m"] / (1 - b1 ** s["t"])) / ((s["v"] / (1 - b2 ** s["t"])).sqrt() + eps)
        u = u + wd * p
        pn, un = p.double().norm(), u.double().norm()
        r = (pn / un).item() if pn > 0 and un > 0 else 1.0
        p.sub_(lr * r * u)


def test_lamb_matches_paper_reference_100_steps(kernels):
    a, b = _model(), _model()
    _train(a, FusedLAMB(a.parameters(), lr=1e-2, weight_decay=0.01, max_grad_norm=0.5))
    state = {}

    class Ref:
        def zero_grad(self):
            b.zero_grad()

        @torch.no_grad()
        def step(self):
            _lamb_reference_step(list(b.parameters()), state, 1e-2, 0.9, 0.999, 1e-6, 0.01, 0.5)

    _train(b, Ref())
    _close(a, b, rtol=1e-5)


def test_larc_matches_apex_loop(kernels):
    a, b = _model(), _model()
    oa = LARC(torch.optim.SGD(a.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3))
    ob = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3)

    class ApexLARC:  # Apex's LARC.step, verbatim in structure
        def zero_grad(self):
            ob.zero_grad()

        @torch.no_grad()
        def step(self):
            group = ob.param_groups[0]
            wd, group["weight_decay"] = group["weight_decay"], 0
            for p in group["params"]:
                pn, gn = torch.norm(p), torch.norm(p.grad)
                if pn != 0 and gn != 0:
                    lr = 0.02 * pn / (gn + pn * wd + 1e-8)
                    lr = min(lr / group["lr"], 1)
                    p.grad += wd * p
                    p.grad *= lr
            ob.step()
            group["weight_decay"] = wd

    _train(a, oa, steps=30)
    _train(b, ApexLARC(), steps=30)
    _close(a, b, rtol=1e-5)
    assert oa.param_groups[0]["weight_decay"] == 1e-3


def test_novograd_seam_norms_before_any_write(kernels, monkeypatch):
    """The per-tensor norms of every bucket come first and flag overflow: one read of the grads
    (no separate finite pass), the scale applied, and an inf in the last bucket skips all."""
    from mpnb.core.ops import op_info

    reference_fused_novograd_ = op_info("fused_novograd_").reference_kernel  # positional
    from mpnb.core.optimizers import _base

    def no_second_pass(*args):
        raise AssertionError("NovoGrad's norm pass already checks the grads")

    monkeypatch.setattr(_base, "multi_tensor_check_finite", no_second_pass)

    torch.manual_seed(0)
    p16 = [torch.nn.Parameter(torch.randn(n).bfloat16()) for n in (5, 300)]
    p32 = [torch.nn.Parameter(torch.randn(7))]
    opt = FusedNovoGrad(p16 + p32, lr=1e-2, weight_decay=1e-3, master_weights=True)
    ref_w = [p.detach().float().clone() for p in p16 + p32]
    ref_m = [torch.zeros_like(w) for w in ref_w]
    ref_v, ref_s = [torch.tensor(0.0) for _ in ref_w], [torch.tensor(0.0) for _ in ref_w]
    inv = torch.tensor([1 / 256.0])
    for step in range(4):
        for p in p16 + p32:
            p.grad = (torch.randn(p.shape) * 256).to(p.dtype)
        if step == 2:
            p32[0].grad[3] = float("inf")
        grads = [p.grad.float() * inv for p in p16 + p32]
        found = torch.zeros(1)
        opt._mpnb_set_scale(inv, found)
        opt.step()
        assert found.item() == (1.0 if step == 2 else 0.0)
        if step != 2:
            norms = torch.stack([g.double().norm().float() for g in grads])
            reference_fused_novograd_(
                ref_w,
                grads,
                ref_m,
                ref_v,
                [],
                ref_s,
                norms,
                1e-2,
                0.9,
                0.999,
                1e-8,
                1e-3,
                True,
                True,
                False,
                2,
                False,
            )
        ours = [opt.state[p]["master_param"] for p in p16] + [p32[0].detach()]
        for a, b in zip(ours, ref_w, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("magnitude", [1e-30, 1e-3, 1.0, 1e5, 1e18])
def test_lamb_global_norm_of_one_bucket_is_the_fp64_sum_of_its_square(kernels, magnitude):
    # One dtype bucket skips the fp64 sum of squares: an fp32 norm's square is exact in fp64,
    # so its root gives the same bits back. Checked against the sum over several buckets.
    g = torch.Generator().manual_seed(int(math.log10(magnitude)) + 40)
    ps = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in (37, 1000, 5)]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=g) * magnitude
    opt = FusedLAMB(ps, lr=1e-3)
    opt.step()
    norms = [torch.linalg.vector_norm(p.grad.double()).reshape(()) for p in ps]
    one = multi_tensor_l2norm(torch.zeros(1), [p.grad for p in ps], False, None)[0]
    assert torch.equal(opt._global_norm, one.reshape(1))
    fp64 = one.reshape(()).double().square().sqrt().float().reshape(1)
    assert torch.equal(opt._global_norm, fp64)
    assert torch.allclose(
        opt._global_norm.double(), torch.stack(norms).norm().reshape(1), rtol=1e-6
    )

    # Two buckets (fp32 and bf16 params): the fp64 sum of their squares.
    ps2 = [torch.nn.Parameter(torch.randn(64, generator=g)) for _ in range(2)]
    ps2[1] = torch.nn.Parameter(ps2[1].detach().bfloat16())
    for p in ps2:
        p.grad = (torch.randn(64, generator=g) * magnitude).to(p.dtype)
    opt2 = FusedLAMB(ps2, lr=1e-3)
    opt2.step()
    per = [multi_tensor_l2norm(torch.zeros(1), [p.grad], False, None)[0] for p in ps2]
    total = sum(n.reshape(()).double().square() for n in per).sqrt().float().reshape(1)
    assert torch.equal(opt2._global_norm, total)
