"""amp in training loops: accumulation, several losses/models, masters, schedulers, skips."""

import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp._initialize import EmulatedHalfWarning

HALVES = [torch.bfloat16, torch.float16]


def _mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


def _init(m, opt, level, half=torch.bfloat16, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)


@pytest.mark.parametrize("half", HALVES)
@pytest.mark.parametrize("level", ["O0", "O1", "O2"])
def test_delay_unscale_accumulation_equals_one_big_batch(level, half):
    x, y = torch.randn(8, 4), torch.randn(8, 2)
    grads = []
    for split in (False, True):
        m = _mlp()
        if level == "O2":  # same half weights for both runs: start from representable values
            m = m.to(half).float()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        # fp16 grads of this loss overflow at 2**16: a static 64 keeps them finite
        scale = 64.0 if half == torch.float16 and level != "O0" else None
        m, opt = _init(m, opt, level, half, loss_scale=scale)
        opt.zero_grad()
        if split:
            for i, (xs, ys) in enumerate(zip(x.chunk(2), y.chunk(2), strict=False)):
                loss = (m(xs) - ys).pow(2).sum()
                with amp.scale_loss(loss, opt, delay_unscale=i == 0) as sl:
                    sl.backward()
        else:
            loss = (m(x) - y).pow(2).sum()
            with amp.scale_loss(loss, opt) as sl:
                sl.backward()
        grads.append([p.grad.clone() for p in amp.master_params(opt)])
    tol = 1e-6 if level == "O0" else 2e-2  # summation order differs, nothing else
    for a, b in zip(*grads, strict=False):
        assert a.dtype == torch.float32
        torch.testing.assert_close(a, b, rtol=tol, atol=tol)


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_accumulation_without_delay_adds_unscaled_grads(level):
    m = _mlp().to(torch.bfloat16).float()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = _init(m, opt, level)
    x = torch.randn(4, 4)
    opt.zero_grad()
    for _ in range(2):
        with amp.scale_loss(m(x).float().sum(), opt) as sl:
            sl.backward()
    two = [p.grad.clone() for p in amp.master_params(opt)]
    opt.zero_grad()
    with amp.scale_loss(m(x).float().sum(), opt) as sl:
        sl.backward()
    for a, b in zip(two, amp.master_params(opt), strict=False):
        torch.testing.assert_close(a, 2 * b.grad)


def test_step_with_pending_delayed_grads_is_refused():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = _init(m, opt, "O2")
    before = [p.detach().clone() for p in amp.master_params(opt)]
    with amp.scale_loss(m(torch.randn(2, 4)).sum(), opt, delay_unscale=True) as sl:
        sl.backward()
    with pytest.raises(RuntimeError, match="delay_unscale=False"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, amp.master_params(opt), strict=False))


def test_master_params_grads_are_unscaled_and_clipping_works():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    ref = _mlp()
    m, opt = _init(m, opt, "O1")
    x = torch.randn(4, 4)
    with amp.scale_loss(m(x).float().sum(), opt) as sl:
        sl.backward()
    ref(x).sum().backward()
    for p, r in zip(amp.master_params(opt), ref.parameters(), strict=False):
        torch.testing.assert_close(p.grad, r.grad, rtol=2e-2, atol=2e-2)  # not x 65536
    norm = torch.nn.utils.clip_grad_norm_(amp.master_params(opt), 1e-3)
    assert norm < 1e3
    total = torch.sqrt(sum(p.grad.pow(2).sum() for p in amp.master_params(opt)))
    assert total <= 1.01e-3


def test_several_models_and_optimizers():
    m1, m2 = _mlp(1), _mlp(2)
    o1 = torch.optim.SGD(m1.parameters(), lr=0.1)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.01)
    [m1, m2], [o1, o2] = _init([m1, m2], [o1, o2], "O2", num_losses=2)
    w1, w2 = m1[0].weight.clone(), m2[0].weight.clone()
    x = torch.randn(3, 4)
    l1, l2 = m1(x).sum(), m2(x).pow(2).sum()
    with amp.scale_loss(l1, o1, loss_id=0) as sl:
        sl.backward()
    with amp.scale_loss(l2, o2, loss_id=1) as sl:
        sl.backward()
    o1.step()
    o2.step()
    assert not torch.equal(w1, m1[0].weight) and not torch.equal(w2, m2[0].weight)
    assert m1[0].weight.dtype == torch.bfloat16


def test_lr_scheduler_with_o2_changes_the_masters_lr():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    m, opt = _init(m, opt, "O2")
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x = torch.randn(2, 4)
    deltas = []
    for _ in range(3):
        opt.zero_grad()
        before = opt.param_groups[0]["params"][0].detach().clone()
        with amp.scale_loss(m(x).sum(), opt) as sl:
            sl.backward()
        g = opt.param_groups[0]["params"][0].grad.clone()
        opt.step()
        sched.step()
        deltas.append(((before - opt.param_groups[0]["params"][0]) / g).nanmean().item())
    assert deltas == pytest.approx([1.0, 0.5, 0.25], rel=1e-3)
    assert m[0].weight.dtype == torch.bfloat16
    torch.testing.assert_close(
        m[0].weight.float(), opt.param_groups[0]["params"][0], rtol=1e-2, atol=1e-2
    )


def test_disabled_amp_is_a_no_op():
    m = _mlp()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = _init(m, opt, "O2", enabled=False)
    loss = m(torch.randn(2, 4)).sum()
    with amp.scale_loss(loss, opt) as sl:
        assert sl is loss
    assert m[0].weight.dtype == torch.float32


_CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, _CUDA])])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fp16_training_skips_overflowing_steps_then_steps(level, device):
    m = _mlp().to(device)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    m, opt = _init(m, opt, level, torch.float16)
    # fp16 at the initial dynamic scale of 2**16 can overflow (Apex's behaviour): each such
    # step is skipped and halves the scale, until one step is taken.
    scales, before = [], [p.detach().clone() for p in m.parameters()]
    for _ in range(20):
        scales.append(amp.state_dict()["loss_scaler0"]["loss_scale"])
        opt.zero_grad()
        with amp.scale_loss(m(torch.randn(2, 4, device=device)).float().sum(), opt) as sl:
            sl.backward()
        opt.step()
        if amp.state_dict()["loss_scaler0"]["unskipped"] == 1:
            break
    assert amp.state_dict()["loss_scaler0"]["unskipped"] == 1
    assert scales == [2.0**16 / 2**i for i in range(len(scales))]
    assert not all(torch.equal(a, b) for a, b in zip(before, m.parameters(), strict=True))
