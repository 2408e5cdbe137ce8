"""amp's per-optimizer state machine, its strategies, ``_amp_stash`` and the handle-less API."""

from __future__ import annotations

import ast
import gc
import pathlib
import warnings
from functools import partial

import pytest
import torch

import mpnb.core.amp as amp_pkg
from mpnb import amp
from mpnb.core.amp import EmulatedHalfWarning, OptState
from mpnb.optimizers import FusedAdam, FusedSGD


def _init(level="O1", opt_cls=torch.optim.SGD, **kw):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 2))
    opt = opt_cls(m.parameters(), lr=0.01)
    if level in ("O1", "O2"):  # the dynamic scaler under test (bf16's default is no scaling)
        kw.setdefault("loss_scale", "dynamic")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", EmulatedHalfWarning)
        return amp.initialize(m, opt, opt_level=level, verbosity=0, **kw)


def _loss(m, scale=1.0):
    return m(torch.randn(6, 4)).pow(2).mean() * scale


def _weights(m, opt):
    return [t.detach().clone() for t in (*m.parameters(), *amp.master_params(opt))]


def test_transitions_follow_the_steps():
    m, opt = _init("O2")
    st = opt._amp_stash.amp_state
    assert st.state is OptState.READY
    with amp.scale_loss(_loss(m), opt, delay_unscale=True) as s:
        assert st.state is OptState.SCALING
        s.backward()
    assert st.state is OptState.DELAYED
    with amp.scale_loss(_loss(m), opt) as s:
        s.backward()
    assert st.state is OptState.UNSCALED
    opt.step()
    assert st.state is OptState.STEPPED
    opt.zero_grad()
    with amp.scale_loss(_loss(m), opt) as s:
        s.backward()
    assert st.state is OptState.UNSCALED


def test_step_inside_an_open_block_is_refused():
    m, opt = _init("O1")
    before = _weights(m, opt)
    with pytest.raises(RuntimeError, match="inside an open"):
        with amp.scale_loss(_loss(m), opt) as s:
            s.backward()
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, _weights(m, opt), strict=True))


@pytest.mark.parametrize("level, opt_cls", [("O1", torch.optim.SGD), ("O2", FusedAdam)])
def test_step_twice_after_one_backward_is_refused(level, opt_cls):
    m, opt = _init(level, opt_cls)
    with amp.scale_loss(_loss(m), opt) as s:
        s.backward()
    opt.step()
    once = _weights(m, opt)
    with pytest.raises(RuntimeError, match="twice after one backward"):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(once, _weights(m, opt), strict=True))


def test_nested_blocks_on_one_optimizer_are_refused():
    m, opt = _init("O1")
    with amp.scale_loss(_loss(m), opt) as s:
        with pytest.raises(RuntimeError, match="cannot nest"):
            with amp.scale_loss(_loss(m), opt):
                pass
        s.backward()
    opt.step()  # the outer block still works


def test_step_after_delay_unscale_only_is_refused():
    m, opt = _init("O1")
    with amp.scale_loss(_loss(m), opt, delay_unscale=True) as s:
        s.backward()
    with pytest.raises(RuntimeError, match="delay_unscale=False"):
        opt.step()


def test_a_plain_step_without_scale_loss_still_runs():
    m, opt = _init("O1")
    _loss(m).backward()
    before = _weights(m, opt)
    opt.step()
    opt.step()  # READY: amp does not take part, so no misuse either
    assert not torch.equal(before[0], m[0].weight)


@pytest.mark.parametrize(
    "level, opt_cls, strategy, reads",
    [
        ("O0", torch.optim.SGD, "in-place", 0),  # a static scale: nothing to skip
        ("O1", torch.optim.Adam, "in-place", 1),  # a Python loop: the flag read to skip
        ("O3", torch.optim.SGD, "in-place", 0),
        ("O2", torch.optim.SGD, "master-weights", 1),
        ("O2", partial(torch.optim.AdamW, fused=True), "master-weights", 0),  # found_inf
        ("O2", FusedAdam, "fused-seam", 0),  # skips on the device
        ("O1", FusedSGD, "fused-seam", 0),
    ],
)
def test_the_strategy_is_chosen_once_and_reads_the_host_only_to_skip_a_loop(
    level, opt_cls, strategy, reads
):
    m, opt = _init(level, opt_cls)
    st = opt._amp_stash.amp_state
    assert st.strategy.name == strategy
    for _ in range(3):
        opt.zero_grad()
        with amp.scale_loss(_loss(m), opt) as s:
            s.backward()
        opt.step()
    assert st.host_syncs == 3 * reads


def test_amp_stash_is_a_read_only_view_of_the_real_state():
    m, opt = _init("O2")
    stash = opt._amp_stash
    masters = list(amp.master_params(opt))

    def ids(ts):
        return [id(t) for t in ts]

    assert ids(stash.all_fp32_from_fp16_params) == ids(masters[:2] + masters[4:])
    assert ids(stash.all_fp16_params) == ids([m[0].weight, m[0].bias, m[2].weight, m[2].bias])
    assert ids(stash.all_fp32_from_fp32_params) == ids([m[1].weight, m[1].bias])  # batch norm
    assert len(stash.fp16_groups) == 1 and stash.lazy_init_called
    assert not stash.params_have_scaled_gradients
    with amp.scale_loss(_loss(m), opt, delay_unscale=True) as s:
        s.backward()
        assert stash.params_have_scaled_gradients
    with pytest.raises(AttributeError, match="read-only view"):
        stash.lazy_init_called = False


def test_handle_less_api_finds_state_through_the_stash_and_a_weak_latest():
    m1, o1 = _init("O1")
    h1 = amp.current_handle()
    m2, o2 = _init("O2")
    h2 = amp.current_handle()
    assert h1 is not h2 and o1._amp_stash.handle is h1 and o2._amp_stash.handle is h2
    with amp.scale_loss(_loss(m1), o1) as s:  # an earlier handle's optimizer still works
        s.backward()
    o1.step()
    assert h1.scalers[0].state_dict()["unskipped"] == 1 and amp.state_dict() == h2.state_dict()
    with pytest.raises(ValueError, match="one amp.initialize"):
        with amp.scale_loss(_loss(m1), [o1, o2]):
            pass
    del m2, o2, h2
    gc.collect()
    with pytest.raises(ValueError, match="amp.initialize"):  # only a weak reference is kept
        amp.current_handle()


def test_amp_uses_public_ops_only():
    """No side doors: amp's modules import nothing private from the ops package."""
    root = pathlib.Path(amp_pkg.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("mpnb.core.ops"):
                assert node.module == "mpnb.core.ops", (path.name, node.module)
                assert all(not a.name.startswith("_") for a in node.names), path.name


def test_several_loss_ids_per_step_with_fused_adam_match_torch_adamw():
    """Apex's FusedAdam takes several loss_ids per step (num_losses > 1); so does ours."""
    results = []
    for make in (
        lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.0),
        lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.0),
    ):
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
        m, opt = amp.initialize(
            m,
            make(m.parameters()),
            opt_level="O1",
            num_losses=2,
            loss_scale="dynamic",
            verbosity=0,
        )
        h = amp.current_handle()
        g = torch.Generator().manual_seed(3)
        for i in range(4):
            opt.zero_grad()
            x = torch.randn(6, 4, generator=g)
            for loss_id in (0, 1):
                loss = m(x).float().pow(2).mean() * (1.0 + loss_id)
                if i == 2 and loss_id == 1:
                    loss = loss * float("inf")
                with amp.scale_loss(loss, opt, loss_id=loss_id) as s:
                    s.backward()
            opt.step()
        results.append(([p.detach().clone() for p in m.parameters()], h.state_dict()))
    (fused, fused_state), (ref, ref_state) = results
    assert fused_state == ref_state
    assert fused_state["loss_scaler1"]["loss_scale"] == 2.0**15  # one overflow on loss 1 only
    for a, b in zip(fused, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_a_deferred_fused_step_is_unscaled_when_another_block_of_its_scaler_comes():
    torch.manual_seed(0)
    ma, mb = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    oa, ob = FusedAdam(ma.parameters(), lr=0.1), torch.optim.SGD(mb.parameters(), lr=0.1)
    (ma, mb), (oa, ob) = amp.initialize(
        [ma, mb], [oa, ob], opt_level="O0", loss_scale="dynamic", verbosity=0
    )
    scaler = amp.current_handle().scalers[0]
    ref = torch.nn.Linear(4, 4)
    ref.load_state_dict(ma.state_dict())
    x = torch.randn(3, 4)
    with amp.scale_loss(ma(x).sum(), oa) as s:  # deferred: oa's grads wait, scaled
        s.backward()
    with amp.scale_loss(mb(x).sum() * float("inf"), ob) as s:  # same scaler: backs off
        s.backward()
    assert scaler.loss_scale() == 2.0**15 and scaler.updates == 2
    ref(x).sum().backward()
    torch.testing.assert_close(ma.weight.grad, ref.weight.grad)  # unscaled by the old scale
    oa.step()
    ob.step()
    assert not torch.equal(ma.weight, ref.weight)  # oa's own grads were finite: it stepped
