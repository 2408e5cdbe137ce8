"""FusedAdam (``mpnb/core/optimizers/fused_adam.py``).

* torch.optim.AdamW / Adam's trajectory over 100 steps; checkpoints interchange with
  torch.optim.AdamW both ways; AMSGrad is refused.
* The learning rate on the device: ``capturable=True`` (Apex's rule) keeps each group's lr as
  a float32 tensor on its params' device, read by the kernel; torch's LR schedulers fill it
  in place, a checkpoint load copies into it (a captured step keeps reading the same tensor),
  and the trajectory is the one of a host lr of the same values, bit for bit.
* A fairseq-style subclass that calls Apex's ``multi_tensor_adam`` itself trains as AdamW.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mpnb.multi_tensor_apply import multi_tensor_applier
from mpnb.optimizers import (
    FusedAdam,
)
from tests.core.optimizers.test_base import _close, _mlp, _train_mlp
from tests.core.optimizers.test_checks import _randn_params

LR = 2.0**-10  # fp32-exact, and so is every value a halving schedule gives it


def _model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))


def _train(opt_of, steps=6, schedule=True):
    model = _model()
    opt = opt_of(model.parameters())
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5) if schedule else None
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(5, 8, generator=g)).pow(2).mean().backward()
        opt.step()
        if sched is not None:
            sched.step()
    return model, opt


def test_capturable_puts_every_groups_lr_on_the_device():
    model = _model()
    opt = FusedAdam(
        [{"params": model[0].parameters()}, {"params": model[2].parameters(), "lr": 1e-2}],
        lr=LR,
        capturable=True,
    )
    for group, want in zip(opt.param_groups, (LR, 1e-2), strict=True):
        lr = group["lr"]
        assert isinstance(lr, torch.Tensor) and lr.dtype == torch.float32 and lr.dim() == 0
        assert lr.device == group["params"][0].device
        assert float(lr) == float(torch.tensor(want))
    opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(3))], "lr": 0.5})
    assert isinstance(opt.param_groups[-1]["lr"], torch.Tensor)


def test_not_capturable_keeps_a_host_lr():
    opt = FusedAdam(_model().parameters(), lr=LR)
    assert isinstance(opt.param_groups[0]["lr"], float)


def test_a_schedule_reaches_the_device_lr_and_trains_as_a_host_lr():
    on_device, opt = _train(lambda p: FusedAdam(p, lr=LR, capturable=True))
    on_host, _ = _train(lambda p: FusedAdam(p, lr=LR))
    assert float(opt.param_groups[0]["lr"]) == LR / 8  # three halvings in six steps
    for a, b in zip(on_device.parameters(), on_host.parameters(), strict=True):
        assert torch.equal(a, b)


def test_the_schedule_fills_the_same_tensor():
    model = _model()
    opt = FusedAdam(model.parameters(), lr=LR, capturable=True)
    lr = opt.param_groups[0]["lr"]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model(torch.randn(2, 8)).sum().backward()
    opt.step()
    sched.step()
    assert opt.param_groups[0]["lr"] is lr and float(lr) == LR / 2


def test_a_tensor_lr_without_capturable_is_read_on_the_device():
    lr = torch.tensor(LR)
    on_device, _ = _train(lambda p: FusedAdam(p, lr=lr), schedule=False)
    on_host, _ = _train(lambda p: FusedAdam(p, lr=LR), schedule=False)
    for a, b in zip(on_device.parameters(), on_host.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_load_copies_into_the_tensor_a_captured_step_reads():
    _, trained = _train(lambda p: FusedAdam(p, lr=LR, capturable=True), steps=4)
    saved = trained.state_dict()
    model = _model()
    opt = FusedAdam(model.parameters(), lr=0.5, capturable=True)
    lr = opt.param_groups[0]["lr"]
    opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == LR / 4


@pytest.mark.parametrize("capturable", [True, False])
def test_a_host_lr_checkpoint_and_a_device_lr_one_load_into_each_other(capturable):
    _, trained = _train(lambda p: FusedAdam(p, lr=LR, capturable=not capturable), steps=2)
    opt = FusedAdam(_model().parameters(), lr=0.5, capturable=capturable)
    opt.load_state_dict(trained.state_dict())
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) == capturable
    assert float(lr) == LR / 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU")
def test_a_captured_step_follows_the_schedule():
    from mpnb.core.precision_configs import get_config

    def run(capture: bool):
        model = _model().cuda()
        opt = FusedAdam(model.parameters(), lr=LR, capturable=True)
        name = "O0+graph" if capture else "O0"
        step = get_config(name).train_step(model, opt)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
        g = torch.Generator().manual_seed(1)
        for _ in range(8):
            x = torch.randn(5, 8, generator=g).cuda()
            step.zero_grad()
            step.run(x, None, lambda m, x, y: m(x).pow(2).mean())
            sched.step()
        torch.cuda.synchronize()
        return model

    for a, b in zip(run(True).parameters(), run(False).parameters(), strict=True):
        assert torch.equal(a, b)


def test_checkpoints_interchange_with_torch(kernels):
    a, b = _mlp(), _mlp()
    ta = torch.optim.AdamW(a.parameters(), lr=1e-2, weight_decay=0.1)
    _train_mlp(a, ta, steps=5)
    b.load_state_dict(a.state_dict())
    fb = FusedAdam(b.parameters(), lr=1e-2, weight_decay=0.1)
    fb.load_state_dict(copy.deepcopy(ta.state_dict()))
    _train_mlp(a, ta, steps=20, seed=2)
    _train_mlp(b, fb, steps=20, seed=2)
    _close(a, b)
    ta2 = torch.optim.AdamW(_mlp().parameters(), lr=1e-2)
    ta2.load_state_dict(fb.state_dict())  # and back
    assert ta2.state_dict()["state"][0]["step"].item() == 25


class FairseqStyleAdam(FusedAdam):
    """fairseq's FusedAdamV2 in miniature: Apex's attributes, its own step."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if not hasattr(self, "multi_tensor_adam"):
            raise Exception("Apex installation is outdated. Please install an updated version.")

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["step"] = group.get("step", 0) + 1
            beta1, beta2 = group["betas"]
            g32, p32, m32, v32 = [], [], [], []
            for p in group["params"]:
                state = self.state[p]
                if len(state) == 0:
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float)
                g32.append(p.grad)
                p32.append(p.data)
                m32.append(state["exp_avg"])
                v32.append(state["exp_avg_sq"])
            multi_tensor_applier(
                self.multi_tensor_adam,
                self._dummy_overflow_buf,
                [g32, p32, m32, v32],
                group["lr"],
                beta1,
                beta2,
                group["eps"],
                group["step"],
                self.adam_w_mode,
                1 if group["bias_correction"] else 0,
                group["weight_decay"],
            )


def test_a_fairseq_style_subclass_trains_like_adamw():
    a, b = _randn_params(), _randn_params()
    ours = FairseqStyleAdam(a, lr=1e-2, weight_decay=0.1)
    ref = torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        grads = [torch.randn(p.shape, generator=g) for p in a]
        for p, q, gr in zip(a, b, grads, strict=True):
            p.grad, q.grad = gr.clone(), gr.clone()
        ours.step()
        ref.step()
    for p, q in zip(a, b, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)


PAIRS = [  # (ours, torch's) over 100 steps
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
]


@pytest.mark.parametrize("pair", range(len(PAIRS)))
def test_parity_with_torch_100_steps(kernels, pair):
    ours, theirs = PAIRS[pair]
    a, b = _mlp(), _mlp()
    _train_mlp(a, ours(a.parameters()))
    _train_mlp(b, theirs(b.parameters()))
    _close(a, b)


def test_amsgrad_is_refused():
    with pytest.raises(RuntimeError, match="AMSGrad"):
        FusedAdam([torch.nn.Parameter(torch.zeros(2))], amsgrad=True)
