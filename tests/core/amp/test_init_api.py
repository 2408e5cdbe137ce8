"""Apex's older amp API: ``handle = amp.init()`` casts per function until ``_deactivate()``.

Mirrors the behaviour Apex's ``run_amp`` tests pin for this API (test_basic_casts,
test_promotion, test_rnn, test_cache) and its handle, on the CPU: which functions run in
half, which in fp32, which promote, which refuse fp16, that grads come back in each input's
dtype, and that deactivating leaves torch as it was.
"""

from __future__ import annotations

import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode, _get_current_function_mode_stack

from mpnb import amp
from mpnb.core.amp.casts import default_registry

H, B, C = 16, 4, 3
HALF, FLOAT = torch.float16, torch.float32


@pytest.fixture
def handle():
    h = amp.init(enabled=True)
    try:
        yield h
    finally:
        h._deactivate()


def _out_and_grad(fn, dtype, shape, backward=True):
    x = torch.randn(shape, dtype=dtype).requires_grad_()
    y = fn(x)
    if backward:
        y.float().sum().backward()
    return y.dtype, (x.grad.dtype if backward else None)


@pytest.mark.parametrize("dtype", [HALF, FLOAT])
def test_matmul_family_runs_in_half_and_grads_keep_the_input_dtype(handle, dtype):
    lin, conv = nn.Linear(H, H), nn.Conv2d(C, C, 3)
    w = torch.randn(H, H)
    cases = [
        (lin, (B, H)),
        (lambda x: F.linear(x, lin.weight, lin.bias), (B, H)),
        (conv, (B, C, 8, 8)),
        (lambda x: x @ w, (H, H)),
        (lambda x: w @ x, (H, H)),
        (lambda x: x.matmul(w), (H, H)),
        (lambda x: torch.mm(x, w), (H, H)),
    ]
    for fn, shape in cases:
        assert _out_and_grad(fn, dtype, shape) == (HALF, dtype)


@pytest.mark.parametrize("dtype", [HALF, FLOAT])
def test_range_sensitive_functions_run_in_fp32(handle, dtype):
    target = torch.randn(B, H)
    cases = [
        nn.Softmax(dim=1),
        lambda x: F.softmax(x, dim=1),
        lambda x: nn.MSELoss()(x, target),
        lambda x: x.sum(),
        lambda x: x.pow(2.0),
        lambda x: x**2.0,
        lambda x: 2.0**x,
        lambda x: x.exp(),
    ]
    for fn in cases:
        assert _out_and_grad(fn, dtype, (B, H)) == (FLOAT, dtype)
    gn = nn.GroupNorm(num_groups=1, num_channels=C)
    assert _out_and_grad(gn, dtype, (B, C, 4, 4)) == (FLOAT, dtype)


@pytest.mark.parametrize("dtype", [HALF, FLOAT])
def test_other_functions_keep_the_input_dtype(handle, dtype):
    bn = nn.BatchNorm2d(C)
    assert _out_and_grad(nn.ReLU(), dtype, (B, H)) == (dtype, dtype)
    assert _out_and_grad(bn, dtype, (B, C, 4, 4)) == (dtype, dtype)
    bn.eval()
    assert _out_and_grad(bn, dtype, (B, C, 4, 4), backward=False)[0] == dtype


def test_binary_cross_entropy_refuses_half_unless_allowed(handle):
    x, target = torch.rand(B, H, dtype=HALF), torch.rand(B, H)
    with pytest.raises(NotImplementedError, match="BCEWithLogitsLoss"):
        nn.BCELoss()(x, target)
    with pytest.raises(NotImplementedError, match="allow_banned"):
        F.binary_cross_entropy(x, target)
    handle._deactivate()
    with amp.init(allow_banned=True):
        assert F.binary_cross_entropy(x, target).dtype == FLOAT


@pytest.mark.parametrize("xtype", [HALF, FLOAT])
@pytest.mark.parametrize("ytype", [HALF, FLOAT])
def test_binary_functions_promote_to_the_widest(handle, xtype, ytype):
    widest = FLOAT if FLOAT in (xtype, ytype) else HALF
    for fn in (torch.mul, torch.atan2, lambda a, b: a.mul(b), lambda a, b: a * b):
        x = torch.randn(B, dtype=xtype).requires_grad_()
        y = torch.randn(B, dtype=ytype)
        out = fn(x, y)
        assert out.dtype == widest
        out.float().sum().backward()
        assert x.grad.dtype == xtype
    x = torch.randn(B, dtype=xtype).requires_grad_()
    inplace = x.clone().add_(torch.randn(B, dtype=ytype))  # in place: the left side's dtype
    assert inplace.dtype == xtype


def test_sequences_promote_and_inplace_fp32_functions_refuse_half(handle):
    halves = [torch.randn(B, dtype=HALF) for _ in range(3)]
    assert torch.cat([*halves, torch.randn(B)]).dtype == FLOAT
    assert torch.cat([*halves, torch.randn(B, dtype=HALF)]).dtype == HALF
    assert torch.stack([*halves, torch.randn(B)]).dtype == FLOAT
    ok = torch.randn(B)
    ok.exp_()
    assert ok.dtype == FLOAT
    with pytest.raises(NotImplementedError, match="in-place exp_"):
        torch.randn(B, dtype=HALF).exp_()


@pytest.mark.parametrize("dtype", [FLOAT, HALF])
@pytest.mark.parametrize("kind", [nn.RNNCell, nn.GRUCell, nn.LSTMCell])
def test_recurrent_cells_run_in_half(handle, kind, dtype):
    cell = kind(H, H)
    xs = [torch.randn(B, H, dtype=dtype).requires_grad_() for _ in range(3)]
    state = torch.zeros(B, H, dtype=dtype)
    state = (state, state.clone()) if kind is nn.LSTMCell else state
    outs = []
    for x in xs:
        state = cell(x, state)
        outs.append(state[0] if isinstance(state, tuple) else state)
    assert {o.dtype for o in outs} == {HALF}
    outs[-1].float().sum().backward()
    assert all(x.grad.dtype == dtype for x in xs)


@pytest.mark.parametrize("dtype", [FLOAT, HALF])
@pytest.mark.parametrize("kind", [nn.RNN, nn.GRU, nn.LSTM])
def test_recurrent_layers_run_in_half(handle, kind, dtype):
    for layers, bidir in [(1, False), (2, True)]:
        rnn = kind(H, H, num_layers=layers, bidirectional=bidir)
        x = torch.randn(5, B, H, dtype=dtype).requires_grad_()
        h0 = torch.zeros(layers * (2 if bidir else 1), B, H, dtype=dtype)
        out, _ = rnn(x, (h0, h0.clone()) if kind is nn.LSTM else h0)
        assert out.dtype == HALF
        out[-1].float().sum().backward()
        assert x.grad.dtype == dtype


def test_packed_sequences_run_in_half(handle):
    rnn = nn.RNN(H, H, num_layers=2)
    x = torch.randn(6, B, H).requires_grad_()
    packed = nn.utils.rnn.pack_padded_sequence(x, torch.tensor([6, 5, 4, 3]))
    out, _ = rnn(packed, torch.zeros(2, B, H))
    assert out.data.dtype == HALF
    out.data.float().sum().backward()
    assert x.grad.dtype == FLOAT


def test_one_cast_per_weight_per_forward_and_never_a_stale_one(handle):
    lin = nn.Linear(H, H)
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)
    x = torch.randn(B, H)
    y = lin(x)
    first = handle.cache[id(lin.weight)][2]
    y = y + lin(x)  # the second call reuses the first call's fp16 weight
    assert handle.cache[id(lin.weight)][2] is first and len(handle.cache) == 2
    y.float().sum().backward()
    assert len(handle.cache) == 0  # backward went through the copies: their graph is spent
    opt.step()
    with torch.no_grad():  # evaluation caches a copy without a graph...
        lin(x)
    cached = handle.cache[id(lin.weight)][2]
    assert cached is not first and not cached.requires_grad
    assert torch.equal(cached, lin.weight.detach().half())
    lin(x).float().sum().backward()  # ...which training does not reuse
    assert lin.weight.grad is not None
    with torch.no_grad():
        lin.weight.add_(1.0)  # an in-place change: a cached copy is stale
        expected = F.linear(x.half(), lin.weight.half(), lin.bias.half())
        assert torch.equal(lin(x), expected)


def test_grads_through_the_cache_match_fp32(handle):
    w = nn.Parameter(torch.arange(16.0).view(4, 4) / 8)
    x = torch.ones(2, 4)
    for _ in range(2):  # training, then training again after an evaluation forward
        w.grad = None
        (x.mm(w)).mm(w).sum().backward()
        ref_w = w.detach().clone().requires_grad_()
        with handle._disable_casts():
            (x.mm(ref_w)).mm(ref_w).sum().backward()
        torch.testing.assert_close(w.grad, ref_w.grad)
        with torch.no_grad():
            x.mm(w).mm(w)


def test_deactivate_restores_torch_and_disable_casts_pauses(handle):
    lin = nn.Linear(H, H)
    with amp.disable_casts():
        assert lin(torch.randn(B, H)).dtype == FLOAT
    with handle._disable_casts():
        assert lin(torch.randn(B, H)).dtype == FLOAT
    assert lin(torch.randn(B, H)).dtype == HALF
    assert handle.is_active()
    handle._deactivate()
    assert not handle.is_active()
    assert lin(torch.randn(B, H)).dtype == FLOAT
    assert torch.randn(B, dtype=HALF).sum().dtype == HALF
    assert not any(type(m).__name__ == "_CastMode" for m in _get_current_function_mode_stack())
    handle._deactivate()  # twice is harmless


def test_context_manager_form_restores_on_error():
    with pytest.raises(ZeroDivisionError), amp.init():
        assert nn.Linear(H, H)(torch.randn(B, H)).dtype == HALF
        1 / 0  # noqa: B018
    assert nn.Linear(H, H)(torch.randn(B, H)).dtype == FLOAT


def test_deactivate_names_a_mode_left_open_above_it():
    h = amp.init()
    other = TorchFunctionMode()
    other.__enter__()
    try:
        with pytest.raises(RuntimeError, match="with-block first"):
            h._deactivate()
    finally:
        other.__exit__(None, None, None)
    h._deactivate()
    assert nn.Linear(H, H)(torch.randn(B, H)).dtype == FLOAT


def test_casts_belong_to_the_thread_that_called_init(handle):
    seen = []
    t = threading.Thread(target=lambda: seen.append(nn.Linear(H, H)(torch.randn(B, H)).dtype))
    t.start()
    t.join()
    assert seen == [FLOAT]
    errors = []

    def other_thread():
        try:
            handle._deactivate()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=other_thread)
    t.start()
    t.join()
    assert errors and "thread that called amp.init" in errors[0]


def test_disabled_init_changes_nothing():
    h = amp.init(enabled=False)
    assert not h.is_active()
    assert nn.Linear(H, H)(torch.randn(B, H)).dtype == FLOAT
    h._deactivate()


def test_registered_torch_functions_get_their_rule():
    saved = dict(default_registry.entries)
    amp.register_float_function(torch, "relu")
    try:
        with amp.init():
            assert torch.relu(torch.randn(B, dtype=HALF)).dtype == FLOAT
    finally:
        default_registry.entries = saved


def test_verbose_prints_each_cast(capsys):
    with amp.init(verbose=True, enable_caching=False):
        nn.Linear(H, H)(torch.randn(B, H))
    out = capsys.readouterr().out
    assert "Float->Half (linear)" in out


# ---- amp.initialize's O1 handle: Apex's test_cache (train, evaluate, train; then deactivate) ----


class _Weighted(nn.Module):
    def __init__(self, dtype, ops, shape):
        super().__init__()
        self.weight = nn.Parameter(torch.arange(float(shape[0] * shape[1])).view(shape).to(dtype))
        self.ops = ops

    def forward(self, x):
        return self.ops(x, self.weight)


def _matmuls(x, w):
    return x.mm(w).mm(w).sum()


def _pows(x, w):
    return (x + torch.pow(w, 2) + torch.pow(w, 2)).sum()


def _products(x, w):
    return ((x * w) * w).sum()


@pytest.mark.parametrize("dtype", [FLOAT, HALF])
@pytest.mark.parametrize(
    "ops,shape", [(_matmuls, (8, 8)), (_pows, (2, 8)), (_products, (2, 8))], ids=str
)
def test_o1_grads_right_across_train_eval_train_then_deactivate(ops, shape, dtype):
    model = _Weighted(dtype, ops, shape)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(  # a half model, as Apex's test allows it: dtypes kept
            model,
            opt,
            opt_level="O1",
            half_dtype=HALF,
            loss_scale=4.0,
            verbosity=0,
            cast_model_type=False,
        )
    x = torch.ones(2, 8)

    def train_step():
        model.weight.grad = None
        with amp.scale_loss(model(x).sum(), opt) as scaled:
            scaled.backward()
        assert model.weight.grad.dtype == dtype
        w = model.weight.detach().float().requires_grad_()
        ops(x, w).backward()
        torch.testing.assert_close(model.weight.grad.float(), w.grad)
        with torch.no_grad():
            model.weight -= 1.0

    train_step()
    with torch.no_grad():
        model(x)
    train_step()
    handle = amp.current_handle()
    seen = []
    probe = model.register_forward_pre_hook(
        lambda m, a: seen.append(torch.is_autocast_enabled("cpu"))
    )
    model(x)
    assert handle.cast_hooks and seen == [True]  # O1: the forward runs in an autocast region
    handle._deactivate()
    model(x.to(dtype))
    probe.remove()
    assert not handle.cast_hooks and seen == [True, False]  # not any more
