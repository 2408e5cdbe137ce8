"""FusedAdagrad (``mpnb/core/optimizers/fused_adagrad.py``): torch.optim.Adagrad's trajectory over
100 steps, its state names and format (a torch checkpoint loads in and goes on as torch's
run), the decoupled decay of ``adagrad_w_mode``, and fp32 masters for bf16 params."""

from __future__ import annotations

import copy

import torch

from mpnb.optimizers import FusedAdagrad
from tests.core.optimizers.test_base import _close, _mlp, _train_mlp


def test_parity_with_torch_100_steps(kernels):
    a, b = _mlp(), _mlp()
    _train_mlp(a, FusedAdagrad(a.parameters(), lr=1e-2, weight_decay=1e-2))
    _train_mlp(b, torch.optim.Adagrad(b.parameters(), lr=1e-2, weight_decay=1e-2, eps=1e-10))
    _close(a, b)


def test_a_torch_checkpoint_loads_in_and_goes_on_as_torchs_run(kernels):
    a, b = _mlp(), _mlp()
    ta = torch.optim.Adagrad(a.parameters(), lr=1e-2, eps=1e-10)
    _train_mlp(a, ta, steps=5)
    b.load_state_dict(a.state_dict())
    fb = FusedAdagrad(b.parameters(), lr=1e-2)
    fb.load_state_dict(copy.deepcopy(ta.state_dict()))
    state = fb.state[next(b.parameters())]
    assert set(state) == {"step", "sum"} and state["sum"].dtype == torch.float32
    assert state["step"].item() == 5
    _train_mlp(a, ta, steps=20, seed=2)
    _train_mlp(b, fb, steps=20, seed=2)
    _close(a, b)
    assert fb.state[next(b.parameters())]["step"].item() == 25


def test_adagrad_w_mode_decouples_the_decay(kernels):
    """From a zero sum, one step: h = g^2 and theta -= lr * (g / (|g| + eps) + wd * theta);
    without ``adagrad_w_mode`` the decay joins the gradient (and the sum) instead."""
    g = torch.Generator().manual_seed(0)
    w0, grad = torch.randn(300, generator=g), torch.randn(300, generator=g)
    lr, wd, eps = 0.1, 0.05, 1e-10
    out = {}
    for w_mode in (True, False):
        p = torch.nn.Parameter(w0.clone())
        p.grad = grad.clone()
        opt = FusedAdagrad([p], lr=lr, weight_decay=wd, adagrad_w_mode=w_mode)
        opt.step()
        out[w_mode] = (p.detach(), opt.state[p]["sum"])
    w, h = out[True]
    torch.testing.assert_close(h, grad * grad)
    want = w0 - lr * (grad / (grad.abs() + eps) + wd * w0)
    torch.testing.assert_close(w, want, rtol=1e-6, atol=1e-6)
    coupled = grad + wd * w0
    w, h = out[False]
    torch.testing.assert_close(h, coupled * coupled)
    torch.testing.assert_close(w, w0 - lr * coupled / (coupled.abs() + eps), rtol=1e-6, atol=1e-6)


def test_master_weights_keep_bf16_params_the_rounded_fp32_masters(kernels):
    a, b = _mlp(dtype=torch.bfloat16), _mlp()
    opt = FusedAdagrad(a.parameters(), lr=1e-2, master_weights=True)
    _train_mlp(a, opt, steps=10)
    for p in a.parameters():
        master = opt.state[p]["master_param"]
        assert master.dtype == torch.float32 and torch.equal(p, master.bfloat16())
    _train_mlp(b, torch.optim.Adagrad(b.parameters(), lr=1e-2, eps=1e-10), steps=10)
    masters = [opt.state[p]["master_param"] for p in a.parameters()]
    for m, q in zip(masters, b.parameters(), strict=True):  # bf16 grads, fp32 steps
        assert ((m - q).norm() / q.norm()).item() < 0.05
