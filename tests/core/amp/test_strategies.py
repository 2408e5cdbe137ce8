"""The fused-optimizer strategy (:class:`~mpnb.core.amp._strategies.FusedSeam`), amp O2 + mpnb's
fused optimizers end to end: the step takes the one-pass kernel (half grads
in, fp32 masters + state + half params out, no separate unscale), trains, skips a planted
overflow leaving everything bitwise unchanged, and equals the separate-pass sequence (unscale,
check, update the fp32 masters, cast) bit for bit over several steps."""

from __future__ import annotations

import warnings

import pytest
import torch

import mpnb.core.ops
from mpnb import amp
from mpnb.core import ops as O
from mpnb.core.amp import LossScaler
from mpnb.core.amp._initialize import EmulatedHalfWarning
from mpnb.core.ops import multi_tensor_scale
from mpnb.core.optimizers import FusedAdam, FusedSGD
from mpnb.core.optimizers import fused_adam as adam_mod
from mpnb.core.optimizers import fused_sgd as sgd_mod

CASES = {
    "adam": (
        lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
        adam_mod,
        "fused_adam_",
        ("exp_avg", "exp_avg_sq"),
    ),
    "sgd": (
        lambda p: FusedSGD(p, lr=0.05, momentum=0.9, materialize_master_grads=False),
        sgd_mod,
        "fused_sgd_",
        ("momentum_buffer",),
    ),
}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
    )


class _Reference:
    """The separate-pass O2 step on shadow copies: unscale + check into fp32 grads, the update
    on fp32 masters (no scale handed to the op), then the cast back."""

    def __init__(self, params, name):
        self.name, self.params = name, params
        self.masters = [p.detach().float().clone() for p in params]
        self.states = [[torch.zeros_like(m) for m in self.masters] for _ in range(2)]
        self.steps = [torch.tensor(0.0) for _ in params]
        self.first = True

    def step(self, grads, inv_scale):
        found = torch.zeros(1)
        g32 = [torch.empty_like(m) for m in self.masters]
        for dt in {g.dtype for g in grads}:
            idx = [i for i, g in enumerate(grads) if g.dtype == dt]
            multi_tensor_scale(
                found, [grads[i] for i in idx], [g32[i] for i in idx], 1.0, scale_tensor=inv_scale
            )
        if found.item():
            return
        if self.name == "adam":
            O.fused_adam_(
                self.masters,
                g32,
                *self.states,
                [],
                self.steps,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=0.01,
                adam_w_mode=True,
                bias_correction=True,
            )
        else:
            O.fused_sgd_(
                self.masters,
                g32,
                self.states[0],
                [],
                [self.first] * len(g32),
                lr=0.05,
                momentum=0.9,
            )
            self.first = False
        self.params = [m.to(p.dtype) for p, m in zip(self.params, self.masters, strict=True)]


def _counting(monkeypatch, module, attr, calls):
    real = getattr(module, attr)

    def wrapped(*args, **kw):
        calls.append(
            (
                args[0][0].dtype,
                len(args[3] if attr == "fused_sgd_" else args[4]),
                kw.get("inv_scale") is not None,
            )
        )
        return real(*args, **kw)

    monkeypatch.setattr(module, attr, wrapped)


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("name", list(CASES))
def test_o2_fused_one_pass_trains_skips_and_matches_reference(kernels, monkeypatch, name, half):
    make, module, op, keys = CASES[name]
    model = _model()
    opt = make(model.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        model, opt = amp.initialize(
            model, opt, opt_level="O2", half_dtype=half, loss_scale="dynamic", verbosity=0
        )
    params = list(model.parameters())
    assert {p.dtype for p in params} == {half, torch.float32}  # BatchNorm stays fp32
    assert opt.param_groups[0]["params"][0] is params[0]  # masters live inside the optimizer
    ref = _Reference(params, name)
    seen = {}

    def capture(optimizer, args, kwargs):  # runs after amp's pre-hook has handed the scale
        inv, _, _ = optimizer._pending_scale
        seen["grads"] = [p.grad.detach().clone() for p in params]
        seen["inv"] = inv.clone()

    opt.register_step_pre_hook(capture)
    calls, unscales = [], []
    _counting(monkeypatch, module, op, calls)
    monkeypatch.setattr(LossScaler, "unscale", lambda *a, **k: unscales.append(1))
    monkeypatch.setattr(mpnb.core.ops, "multi_tensor_scale", lambda *a, **k: unscales.append(2))

    g = torch.Generator().manual_seed(1)
    x, target = torch.randn(32, 6, generator=g), torch.randn(32, 3, generator=g)
    losses = []
    for i in range(12):
        planted = i == 5
        before = _snapshot(params, opt, keys)
        scale_before = amp.current_handle().scalers[0].loss_scale()
        opt.zero_grad()
        loss = (model(x).float() - target).pow(2).mean()
        losses.append(loss.item())
        with amp.scale_loss(loss * (float("inf") if planted else 1.0), opt) as sl:
            sl.backward()
        opt.step()
        ref.step(seen["grads"], seen["inv"])
        if planted:
            assert _bitwise(before, _snapshot(params, opt, keys))
            assert amp.current_handle().scalers[0].loss_scale() == scale_before / 2
        _assert_matches(ref, params, opt, keys, name)
    assert not unscales  # no separate unscale pass anywhere
    assert calls and all(c[2] for c in calls)  # every update got the scale, in the kernel
    assert {(dt, n > 0) for dt, n, _ in calls} == {(half, True), (torch.float32, False)}
    assert losses[-1] < 0.9 * losses[0]


def _snapshot(params, opt, keys):
    out = [p.detach().clone() for p in params]
    for p in params:
        st = opt.state.get(p, {})
        out += [st[k].clone() for k in ("master_param", "step", *keys) if k in st]
    return out


def _bitwise(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def _assert_matches(ref, params, opt, keys, name):
    for i, p in enumerate(params):
        st = opt.state[p]
        assert torch.equal(p.detach(), ref.params[i])
        if p.dtype != torch.float32:
            assert torch.equal(st["master_param"], ref.masters[i])
        for k, s in zip(keys, ref.states, strict=False):
            assert torch.equal(st[k], s[i])
        if name == "adam":
            assert torch.equal(st["step"], ref.steps[i])
