"""The declared seam between amp and an optimizer (``mpnb/core/amp/seam.py``).

amp checks an optimizer's side of :class:`~mpnb.core.amp.seam.FusedOptimizer` once, when it binds
it: a declared but incomplete optimizer is refused by name before the model changes. A user's
optimizer that implements the Protocol is served exactly as mpnb's own; torch's GradScaler
reaches the same handoff through :class:`~mpnb.core.amp.seam.GradScalerAttribute`.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp._initialize import EmulatedHalfWarning
from mpnb.core.amp.seam import MEMBERS, Binding, FusedOptimizer, ScaleHandoff, bind
from mpnb.optimizers import FusedAdam


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _init(m, opt, level, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(m, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0, **kw)


class UnscalingSGD(torch.optim.Optimizer):
    """A user's fused optimizer: plain SGD that implements the seam's fused unscale and keeps
    no masters of its own."""

    _mpnb_accepts_scale = True

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})
        self.pending: ScaleHandoff | None = None
        self.inv_scales: list[float] = []  # what each handoff asked to undo

    def _mpnb_set_scale(self, inv_scale, found_inf, skip=True):
        self.pending = ScaleHandoff(inv_scale, found_inf, skip)
        self.inv_scales.append(inv_scale.item())

    @torch.no_grad()
    def step(self, closure=None):
        h, self.pending = self.pending, None
        if h is not None:
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            for g in grads:
                g.mul_(h.inv_scale)  # the same fp32 multiply amp's own unscale does
            bad = torch.stack([(~torch.isfinite(g)).any() for g in grads]).any()
            h.found_inf.copy_(torch.maximum(h.found_inf, bad.float().reshape(1)))
            if h.skip and h.found_inf.item():
                return None
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])  # torch.optim.SGD's update, momentum 0
        return None


class NoSetScale(torch.optim.SGD):
    _mpnb_accepts_scale = True  # declared, but the fused unscale is missing


class HalfTheMasters(UnscalingSGD):
    def _mpnb_check_master_weights(self):  # one of the three master-weight members only
        pass


def test_the_protocol_lists_what_bind_checks():
    declared = {n for n in vars(FusedOptimizer) if n.startswith("_mpnb_")}
    declared |= set(FusedOptimizer.__annotations__)
    assert set(MEMBERS) == declared
    assert all(callable(getattr(FusedAdam, m)) for m in MEMBERS[1:])  # mpnb's own implement it


@pytest.mark.parametrize(
    "cls, missing",
    [
        (NoSetScale, ["_mpnb_set_scale"]),
        (HalfTheMasters, ["_mpnb_use_master_weights", "_mpnb_set_master"]),
    ],
)
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_an_incomplete_declared_optimizer_is_refused_at_initialize_by_name(cls, missing, level):
    m = _mlp()
    before = [p.detach().clone() for p in m.parameters()]
    opt = cls(m.parameters(), 0.1)
    with pytest.raises(TypeError) as err:
        _init(m, opt, level)
    msg = str(err.value)
    assert all(name in msg for name in missing), msg
    assert cls.__name__ in msg and "drop _mpnb_accepts_scale" in msg
    # refused before anything changed: the model is still fp32, no amp state on the optimizer
    assert all(p.dtype == torch.float32 for p in m.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
    assert not hasattr(opt, "_amp_stash")


def test_an_undeclared_optimizer_is_served_by_amp_and_never_asked_again():
    opt = torch.optim.SGD(_mlp().parameters(), lr=0.1)
    assert bind(opt, master_weights=True) == Binding(fused_unscale=False, own_masters=False)
    opt = FusedAdam(_mlp().parameters())
    assert bind(opt, master_weights=True) == Binding(fused_unscale=True, own_masters=True)
    assert bind(opt, master_weights=False) == Binding(fused_unscale=True, own_masters=False)


def _train(level, make_opt, plant_inf_at=2, steps=5):
    m = _mlp()
    if level == "O2":  # both runs start from the same representable half weights
        m = m.to(torch.bfloat16).float()
    opt = make_opt(m.parameters())
    m, opt = _init(m, opt, level, loss_scale="dynamic")
    g = torch.Generator().manual_seed(3)
    weights, scales = [], []
    for i in range(steps):
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        opt.zero_grad()
        with amp.scale_loss(((m(x).float() - y) ** 2).mean(), opt) as s:
            s.backward()
            if i == plant_inf_at:  # an overflow the step must skip
                next(m.parameters()).grad[0, 0] = float("inf")
        opt.step()
        weights.append([p.detach().clone() for p in m.parameters()])
        scales.append(amp.current_handle().scalers[0].loss_scale())
    return weights, scales, opt


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_custom_optimizer_implementing_the_protocol_trains_under_amp(level):
    """A user's optimizer that declares the seam gets the scale handed over (O1: the grads
    stay scaled for it; O2: amp's masters, already unscaled, and a scale of 1) and trains
    bit for bit as torch's SGD does with amp unscaling for it, overflow skip included."""
    ours, our_scales, opt = _train(level, lambda p: UnscalingSGD(p, lr=0.1))
    ref, ref_scales, _ = _train(level, lambda p: torch.optim.SGD(p, lr=0.1))
    assert len(opt.inv_scales) == 5  # amp used the declared door on every step
    if level == "O1":  # the grads waited, scaled, for the optimizer to undo the scale in use
        assert opt.inv_scales == [1 / s for s in [2.0**16, *our_scales[:-1]]]
    else:  # amp's fp32 masters were unscaled into: nothing left to undo
        assert opt.inv_scales == [1.0] * 5
    assert our_scales == ref_scales and our_scales[2] == our_scales[1] / 2  # the overflow
    for step, (a, b) in enumerate(zip(ours, ref, strict=True)):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)), step
    assert all(torch.equal(x, y) for x, y in zip(ours[1], ours[2], strict=True))  # skipped


def _scaler_steps(opt, model, scale, plant_inf_at):
    scaler = torch.amp.GradScaler("cpu", init_scale=scale)
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(4):
        x, y = torch.rand(8, 4, generator=g), torch.rand(8, 2, generator=g)
        opt.zero_grad()
        scaler.scale(((model(x) - y) ** 2).mean()).backward()
        if i == plant_inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        scaler.step(opt)
        scaler.update()
        out.append(([p.detach().clone() for p in model.parameters()], scaler.get_scale()))
    return out


def _amp_handoff_steps(opt, model, scale, plant_inf_at):
    """The same steps through the declared door, with GradScaler's own scale arithmetic."""
    g = torch.Generator().manual_seed(1)
    out = []
    for i in range(4):
        x, y = torch.rand(8, 4, generator=g), torch.rand(8, 2, generator=g)
        opt.zero_grad()
        (((model(x) - y) ** 2).mean() * scale).backward()
        if i == plant_inf_at:
            next(model.parameters()).grad[0, 0] = float("inf")
        inv = torch.tensor([scale], dtype=torch.float32).double().reciprocal().float()
        found = torch.zeros(1)
        opt._mpnb_set_scale(inv, found)
        opt.step()
        scale = scale / 2 if found.item() else scale
        out.append(([p.detach().clone() for p in model.parameters()], scale))
    return out


def test_grad_scaler_and_amp_reach_fused_adam_through_one_handoff_bitwise():
    """FusedAdam(capturable=True) under torch.amp.GradScaler takes the step its amp door takes,
    bit for bit: GradScaler's grad_scale/found_inf are an adapter over the same handoff. The
    overflow step writes nothing either way."""
    model = _mlp()
    twin = copy.deepcopy(model)
    opt = FusedAdam(model.parameters(), lr=1e-2, capturable=True)
    twin_opt = FusedAdam(twin.parameters(), lr=1e-2, capturable=True)
    via_scaler = _scaler_steps(opt, model, 2.0**12, plant_inf_at=2)
    via_amp = _amp_handoff_steps(twin_opt, twin, 2.0**12, plant_inf_at=2)
    for (wa, sa), (wb, sb) in zip(via_scaler, via_amp, strict=True):
        assert sa == sb
        assert all(torch.equal(a, b) for a, b in zip(wa, wb, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(via_scaler[1][0], via_scaler[2][0], strict=True))
    assert opt.state[next(model.parameters())]["step"] == 3  # the skipped step is not counted
    # after the step the attributes are gone, as GradScaler deletes them
    assert not hasattr(opt, "grad_scale") and not hasattr(opt, "found_inf")
