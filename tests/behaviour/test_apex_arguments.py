"""Apex's arguments and conventions that client code relies on, each as Apex's tests use it.

* masters follow the model until the first step (tests/distributed/amp_master_params, here in
  one process: a copy into the model after ``amp.initialize``);
* ``cast_model_type=False`` leaves the model's dtypes alone (run_amp's add_param_group,
  fused_sgd and multiple_models tests build models of fp32 and fp16 params that way);
* an optimizer wrapped in ``LARC`` goes through ``amp.initialize`` (run_amp/test_larc);
* the multi-tensor ops take channels-last tensors (run_amp/test_multi_tensor_axpby, nhwc);
* an O2/O3 model's ``state_dict()`` holds fp32 tensors, loadable back (run_amp/test_checkpointing).
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.ops import multi_tensor_axpby, multi_tensor_l2norm, multi_tensor_scale
from mpnb.optimizers import FusedAdam
from mpnb.parallel import LARC


def _init(model, opt, level, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        kw.setdefault("half_dtype", torch.float16)
        return amp.initialize(model, opt, opt_level=level, verbosity=0, **kw)


def _step(model, opt, x):
    opt.zero_grad()
    with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
        scaled.backward()
    opt.step()


def _net(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


# ---- masters follow the model until the first step ----


@pytest.mark.parametrize("make", [lambda p: torch.optim.SGD(p, lr=0.1), lambda p: FusedAdam(p)])
def test_masters_take_weights_copied_into_the_model_before_the_first_step(make):
    model = _net(0)
    opt = make(model.parameters())
    model, opt = _init(model, opt, "O2")
    other = _net(1)
    with torch.no_grad():  # what DDP's broadcast of rank 0's weights does
        for p, q in zip(model.parameters(), other.parameters(), strict=True):
            p.copy_(q)
    _step(model, opt, torch.randn(4, 6))
    masters = [opt.state.get(p, {}).get("master_param", p) for p in amp.master_params(opt)]
    for m, p, q in zip(masters, model.parameters(), other.parameters(), strict=True):
        assert m.dtype == torch.float32
        assert torch.equal(m.half(), p)  # the model holds its rounded master
        # one step of lr <= 0.1 from the copied weights, not from the weights before the copy
        assert (m - q.half().float()).abs().max() < 0.15


def test_masters_keep_their_fp32_digits_when_the_model_did_not_change():
    model = _net(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # no update: masters must stay put
    model, opt = _init(model, opt, "O2")
    _step(model, opt, torch.randn(4, 6))
    before = [m.detach().clone() for m in amp.master_params(opt)]
    _step(model, opt, torch.randn(4, 6))
    for a, b in zip(before, amp.master_params(opt), strict=True):
        assert torch.equal(a, b)


# ---- cast_model_type=False ----


class _Mixed(torch.nn.Module):
    def __init__(self, k):
        super().__init__()
        self.w32 = torch.nn.Parameter(torch.tensor([k, k + 1.0]))
        self.w16 = torch.nn.Parameter(torch.tensor([k + 2.0, k + 3.0]).half())

    def forward(self, x):
        return (x * self.w32).sum() + (x.half() * self.w16).float().sum()


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_cast_model_type_false_leaves_the_dtypes_and_trains(level):
    a, b = _Mixed(1.0), _Mixed(2.0)
    opt = torch.optim.SGD([{"params": a.parameters(), "lr": 0.25}], momentum=0.125)
    (a, b), opt = _init([a, b], opt, level, cast_model_type=False, loss_scale=4.0)
    assert [p.dtype for p in (a.w32, a.w16, b.w32, b.w16)] == [torch.float32, torch.float16] * 2
    x = torch.ones(2)
    _step(a, opt, x)
    opt.add_param_group({"params": b.parameters(), "lr": 0.5})
    _step(lambda x: a(x) + b(x), opt, x)
    assert a.w32.dtype == torch.float32 and b.w16.dtype == torch.float16
    starts = [(a.w32, [1.0, 2.0]), (a.w16, [3.0, 4.0]), (b.w32, [2.0, 3.0]), (b.w16, [4.0, 5.0])]
    for p, start in starts:  # a positive loss of positive weights: every weight went down
        assert (p.detach().float() < torch.tensor(start)).all()
    if level == "O2":  # masters for the fp16 params only
        dtypes = sorted(str(p.dtype) for p in amp.master_params(opt))
        assert dtypes == ["torch.float32"] * 4


def test_cast_model_type_false_takes_the_models_half_dtype_and_its_dynamic_scale():
    a = _Mixed(1.0)
    opt = torch.optim.SGD(a.parameters(), lr=0.25)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, opt = amp.initialize(a, opt, opt_level="O2", cast_model_type=False, verbosity=0)
    handle = amp.current_handle()
    assert handle.properties.half_dtype == torch.float16 and handle.scalers[0].dynamic
    before = [p.detach().clone() for p in a.parameters()]
    opt.zero_grad()
    with amp.scale_loss(a(torch.tensor([float("inf"), 1.0])), opt) as scaled:
        scaled.backward()
    opt.step()  # an overflow under a dynamic scale: skipped, as in Apex
    assert all(torch.equal(b, p) for b, p in zip(before, a.parameters(), strict=True))


def test_cast_model_type_false_is_checked_against_o1_rules():
    with pytest.raises(ValueError, match="cast_model_type"):
        _init(_net(), None, "O1", cast_model_type=torch.float16)
    model = _init(_net(), None, "O1", cast_model_type=False)
    assert next(model.parameters()).dtype == torch.float32


# ---- LARC ----


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_an_optimizer_wrapped_in_larc_goes_through_initialize(level):
    model = _net()
    opt = LARC(torch.optim.SGD([{"params": model.parameters(), "lr": 0.25}], momentum=0.125))
    model, opt = _init(model, opt, level)
    assert isinstance(opt, LARC)
    before = [p.detach().float().clone() for p in model.parameters()]
    for _ in range(2):
        _step(model, opt, torch.randn(4, 6))
    after = [p.detach().float() for p in model.parameters()]
    assert any(not torch.equal(b, a) for b, a in zip(before, after, strict=True))
    if level == "O2":
        assert {m.dtype for m in amp.master_params(opt)} == {torch.float32}
        assert {p.dtype for p in model.parameters()} == {torch.float16}


# ---- channels-last tensors in the multi-tensor ops ----


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_multi_tensor_ops_take_channels_last_tensors(dtype):
    def cl(t):
        return t.to(dtype).contiguous(memory_format=torch.channels_last)

    base = [torch.randn(2, 3, 5, 7), torch.randn(1, 4, 3, 3)]
    x = [cl(t) for t in base]
    y = [cl(t * 2) for t in base]
    out = [cl(torch.zeros_like(t)) for t in base]
    assert not x[0].is_contiguous()
    flag = torch.zeros(1, dtype=torch.int32)
    multi_tensor_axpby(flag, x, y, out, 2.0, -1.0)
    for o in out:
        torch.testing.assert_close(o.float(), torch.zeros_like(o, dtype=torch.float32))
    dst = [cl(torch.zeros_like(t)) for t in base]
    multi_tensor_scale(flag, x, dst, 0.5)
    for d, t in zip(dst, x, strict=True):
        torch.testing.assert_close(d, t * 0.5)
    norm, per = multi_tensor_l2norm(flag, x, True)
    torch.testing.assert_close(per, torch.stack([t.float().norm() for t in x]), rtol=1e-3, atol=0)
    assert flag.item() == 0


def test_multi_tensor_partners_in_two_memory_formats_are_still_refused():
    a = torch.randn(2, 3, 4, 5)
    b = a.contiguous(memory_format=torch.channels_last)
    with pytest.raises(ValueError, match="not contiguous"):
        multi_tensor_scale(torch.zeros(1, dtype=torch.int32), [a], [b], 1.0)


# ---- the O2/O3 checkpoint format ----


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)


def _bn_net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


@pytest.mark.parametrize("half", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("level", ["O2", "O3"])
def test_a_half_model_saves_fp32_tensors_and_loads_them_back(level, half):
    model = _bn_net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = _init(model, opt, level, half_dtype=half, loss_scale=1.0)
    _step(model, opt, torch.randn(4, 6))
    sd = model.state_dict()
    assert {v.dtype for v in sd.values() if v.is_floating_point()} == {torch.float32}
    assert any(p.dtype == half for p in model.parameters())  # the model itself stays half
    ck = _roundtrip({"model": sd})
    plain = _bn_net()  # an fp32 model without amp takes it as is
    plain.load_state_dict(ck["model"])
    for p, q in zip(plain.parameters(), model.parameters(), strict=True):
        assert torch.equal(p, q.detach().float())
    again = _bn_net()
    again_opt = torch.optim.SGD(again.parameters(), lr=0.1)
    again, again_opt = _init(again, again_opt, level, half_dtype=half, loss_scale=1.0)
    again.load_state_dict(ck["model"])
    for p, q in zip(again.parameters(), model.parameters(), strict=True):
        assert p.dtype == q.dtype and torch.equal(p, q)
    x = torch.randn(4, 6)
    model.eval(), again.eval()
    assert torch.equal(model(x), again(x))


def test_keep_vars_state_dict_keeps_the_live_half_params():
    model = _init(_bn_net(), None, "O2")
    sd = model.state_dict(keep_vars=True)
    assert sd["0.weight"] is model[0].weight


# ---- O2: zeroing only the model's grads (run_amp/test_add_param_group, how_to_zero="none") ----


@pytest.mark.parametrize("how", ["none", "model", "optimizer"])
def test_o2_steps_equal_fp32_steps_whichever_grads_are_zeroed(how):
    x = torch.ones(2)

    def make():
        m = _Mixed(1.0).float()
        return m, torch.optim.SGD(m.parameters(), lr=0.25, momentum=0.125)

    ref, ref_opt = make()
    amp_model, opt = make()
    amp_model, opt = _init(amp_model, opt, "O2", loss_scale=4.0)
    for model, o, scaled in ((ref, ref_opt, False), (amp_model, opt, True)):
        for _ in range(3):
            if how == "none":
                for p in model.parameters():
                    p.grad = None
            else:
                (model if how == "model" else o).zero_grad()
            loss = model(x)
            if scaled:
                with amp.scale_loss(loss, o) as s:
                    s.backward()
            else:
                loss.backward()
            o.step()
    for a, b in zip(ref.parameters(), amp_model.parameters(), strict=True):
        torch.testing.assert_close(a.to(b.dtype), b)
