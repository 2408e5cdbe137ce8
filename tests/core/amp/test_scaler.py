"""LossScaler numbers, skipped steps (bitwise), collapse error, one sync per step, fused seam.

Every test runs twice (the ``op_impl`` fixture): with the compiled kernels and with the
references.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mpnb import amp
from mpnb.core.amp import LossScaleCollapseError, LossScaler
from mpnb.core.amp._initialize import EmulatedHalfWarning

pytestmark = pytest.mark.usefixtures("op_impl")


def _clean(s):
    g = [torch.full((5,), 8.0)]
    s.clear_overflow()
    s.unscale(g, g)
    s.update()
    return g


def _overflow(s):
    g = [torch.tensor([1.0, float("inf")])]
    s.clear_overflow()
    s.unscale(g, g)
    s.update()


def test_unscale_divides_and_flags():
    s = LossScaler(init_scale=4.0)
    g = _clean(s)
    assert torch.equal(g[0], torch.full((5,), 2.0)) and s.found_inf.item() == 0
    _overflow(s)
    assert s.loss_scale() == 2.0


def test_growth_after_window_backoff_and_clamps():
    s = LossScaler(init_scale=8.0, scale_window=3, min_loss_scale=2.0, max_loss_scale=32.0)
    for _ in range(2):
        _clean(s)
    assert s.loss_scale() == 8.0
    _clean(s)
    assert s.loss_scale() == 16.0
    for _ in range(6):
        _clean(s)
    assert s.loss_scale() == 32.0  # clamped at max
    for _ in range(5):
        _overflow(s)
    assert s.loss_scale() == 2.0  # clamped at min
    _clean(s)
    _clean(s)
    _overflow(s)  # an overflow restarts the growth count
    _clean(s)
    _clean(s)
    assert s.loss_scale() == 2.0
    _clean(s)
    assert s.loss_scale() == 4.0


def test_apex_defaults_from_state():
    s = LossScaler()
    assert s.loss_scale() == 2.0**16 and s.scale_window == 2000
    s.load_state_dict({"loss_scale": 2.0**16, "unskipped": 1998})
    _clean(s)
    assert s.loss_scale() == 2.0**16 and s.state_dict()["unskipped"] == 1999
    _clean(s)
    assert s.loss_scale() == 2.0**17 and s.state_dict()["unskipped"] == 0
    assert LossScaler(init_scale=2.0**30).loss_scale() == 2.0**24  # max_loss_scale default


def test_static_scale_never_changes():
    s = LossScaler(loss_scale=128.0)
    _overflow(s)
    assert s.loss_scale() == 128.0 and not s.dynamic


def test_state_dict_round_trip():
    a = LossScaler(scale_window=5)
    _overflow(a)
    _clean(a)
    b = LossScaler(scale_window=5)
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    with pytest.raises(ValueError, match="amp.state_dict"):
        b.load_state_dict({"scale": 1})


def _setup(level, half, opt_cls=torch.optim.Adam, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = opt_cls(m.parameters(), lr=0.01)
    if level in ("O1", "O2"):  # the dynamic scaler under test (bf16's default is no scaling)
        kw.setdefault("loss_scale", "dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        m, opt = amp.initialize(m, opt, opt_level=level, half_dtype=half, verbosity=0, **kw)
    return m, opt


def _step(m, opt, scale_by=1.0, loss_id=0):
    opt.zero_grad()
    loss = m(torch.randn(6, 4)).float().pow(2).mean() * scale_by
    with amp.scale_loss(loss, opt, loss_id=loss_id) as sl:
        sl.backward()
    opt.step()


def _snapshot(m, opt):
    params = [p.detach().clone() for p in (*m.parameters(), *m.buffers())]
    masters = [p.detach().clone() for p in amp.master_params(opt)]
    state = {
        k: (v.clone() if torch.is_tensor(v) else v)
        for st in opt.state.values()
        for k, v in st.items()
    }
    return params, masters, [opt.state[p] for p in amp.master_params(opt)], state


def _bitwise_equal(a, b):
    return len(a) == len(b) and all(
        torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a, b, strict=False)
    )


class PlainSGD(torch.optim.Optimizer):
    """An optimizer from outside torch.optim: amp skips it by snapshot and restore."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                st = self.state[p]
                st["n"] = st.get("n", 0) + 1
                p.add_(p.grad, alpha=-g["lr"])


@pytest.mark.parametrize("opt_cls", [torch.optim.Adam, torch.optim.SGD, PlainSGD])
@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("level", ["O1", "O2"])
def test_overflow_skips_step_bitwise_and_halves_scale(level, half, opt_cls):
    m, opt = _setup(level, half, opt_cls)
    _step(m, opt)
    handle = amp.current_handle()
    before = _snapshot(m, opt)
    scale = handle.scalers[0].loss_scale()
    m.eval()  # BN running stats: eval so the forward itself changes nothing
    _step(m, opt, scale_by=float("inf"))
    after = _snapshot(m, opt)
    assert _bitwise_equal(before[0], after[0]) and _bitwise_equal(before[1], after[1])
    assert before[3].keys() == after[3].keys()
    for k in before[3]:
        x, y = before[3][k], after[3][k]
        assert torch.equal(x, y) if torch.is_tensor(x) else x == y
    assert handle.scalers[0].loss_scale() == scale / 2
    m.train()
    _step(m, opt)  # and training goes on
    assert not _bitwise_equal(after[1], _snapshot(m, opt)[1])


def test_repeated_skips_at_floor_raise_clear_error():
    m, opt = _setup("O2", torch.bfloat16, min_loss_scale=4.0)
    amp.current_handle().scalers[0].max_skips_at_min = 3
    before = [p.detach().clone() for p in amp.master_params(opt)]
    with pytest.raises(LossScaleCollapseError, match="inf/NaN.*min_loss_scale"):
        for _ in range(40):
            _step(m, opt, scale_by=float("nan"))
    assert amp.current_handle().scalers[0].loss_scale() == 4.0
    assert _bitwise_equal(before, [p.detach() for p in amp.master_params(opt)])


class _Syncs(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.n += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_a_python_loop_optimizer_reads_the_flag_once_per_step(level):
    """torch.optim's SGD steps in Python: amp reads the step's flag once to skip it, as torch.amp
    does (a fused optimizer reads nothing: tests/behaviour/test_amp_host_reads.py)."""
    m, opt = _setup(level, torch.bfloat16, opt_cls=torch.optim.SGD)  # Adam .item()s on CPU
    state = amp.current_handle().opt_states[0]
    _step(m, opt)
    with _Syncs() as mode:
        for _ in range(3):
            _step(m, opt)
    assert mode.n == 3  # one .item() of the flag per step, in the step pre-hook
    assert state.host_syncs == 4


def test_multiple_losses_keep_separate_scales():
    m, opt = _setup("O2", torch.bfloat16, num_losses=2)
    h = amp.current_handle()
    _step(m, opt, loss_id=0)
    _step(m, opt, scale_by=float("inf"), loss_id=1)
    _step(m, opt, scale_by=float("inf"), loss_id=1)
    assert h.scalers[0].loss_scale() == 2.0**16 and h.scalers[1].loss_scale() == 2.0**14
    assert set(amp.state_dict()) == {"loss_scaler0", "loss_scaler1"}
    with pytest.raises(ValueError, match="loss_id=2.*0..1"):
        _step(m, opt, loss_id=2)


class FakeFusedSGD(torch.optim.SGD):
    """Test double of a fused optimizer using amp's seam: unscales and checks in step()."""

    _mpnb_accepts_scale = True

    def _mpnb_set_scale(self, inv_scale, found_inf, skip=True):
        self._inv, self._found = inv_scale, found_inf

    @torch.no_grad()
    def step(self, closure=None):
        ps = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in ps:
            p.grad.mul_(self._inv)
        self._found.fill_(float(any(not torch.isfinite(p.grad).all() for p in ps)))
        if self._found.item() == 0:
            super().step()


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_fused_optimizer_seam(level):
    m, opt = _setup(level, torch.bfloat16, opt_cls=FakeFusedSGD)
    h = amp.current_handle()
    _step(m, opt)
    before = [p.detach().clone() for p in amp.master_params(opt)]
    m.eval()
    _step(m, opt, scale_by=float("inf"))
    assert _bitwise_equal(before, [p.detach() for p in amp.master_params(opt)])
    assert h.scalers[0].loss_scale() == 2.0**15
    _step(m, opt)
    assert not _bitwise_equal(before, [p.detach() for p in amp.master_params(opt)])
    if level == "O2":
        assert torch.equal(m[0].weight, opt.param_groups[0]["params"][0].to(m[0].weight.dtype))


@pytest.mark.parametrize("level", ["O1", "O2"])
def test_mpnb_fused_adam_through_the_seam(level):
    optimizers = pytest.importorskip("mpnb.optimizers")
    m, opt = _setup(level, torch.bfloat16, opt_cls=lambda p, lr: optimizers.FusedAdam(p, lr=lr))
    h = amp.current_handle()
    _step(m, opt)
    if level == "O2":
        assert opt.param_groups[0]["params"][0] is m[0].weight  # masters inside the optimizer
    before = [t.detach().clone() for t in (*m.parameters(), *m.buffers())]
    m.eval()
    _step(m, opt, scale_by=float("inf"))
    assert _bitwise_equal(before, [t.detach() for t in (*m.parameters(), *m.buffers())])
    assert h.scalers[0].loss_scale() == 2.0**15
    m.train()
    _step(m, opt)
    assert not _bitwise_equal(before, [t.detach() for t in (*m.parameters(), *m.buffers())])


def test_the_scale_never_reaches_zero_or_inf():
    s = LossScaler("dynamic", max_skips_at_min=None)
    g = [torch.tensor([1.0, math.inf])]
    for _ in range(400):  # far more backoffs than fp32 has exponents
        s.clear_overflow()
        s.unscale(g, g)
        s.update()
    assert s.loss_scale() > 0 and math.isfinite(s.inv_scale.item())
