"""O2 after an interrupted block, O2 with non-contiguous params, fp32 masters across checkpoints,
loss scales across configurations.

The masters saved under O2 come back whichever optimizer kind saved or loads them (FusedAdam
keeps them in its state, ``torch.optim`` through amp), and across opt levels (O2 -> O1 or O0
carries them into the fp32 params, O1 -> O2 makes them from the fp32 checkpoint), or amp warns
that the weights are rounded half values. A loss scaler keeps the kind of scaling the run was
set up with (dynamic, static, bf16's none), and says so once when the checkpoint's differs.
"""

from __future__ import annotations

import io
import warnings

import pytest
import torch

from mpnb import amp
from mpnb.core.amp.handle import RoundedWeightsWarning
from mpnb.optimizers import FusedAdam

ADAMW = {
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "fused_adam": lambda p: FusedAdam(p, lr=1e-2, weight_decay=0.01),
}


def _net():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(5, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(), torch.nn.Linear(8, 3)
    )


def _init(level, make, model=None, **kw):
    m = model if model is not None else _net()
    opt = make(m.parameters())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return amp.initialize(m, opt, opt_level=level, half_dtype=torch.bfloat16, verbosity=0, **kw)


def _train(m, opt, steps=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(6, 5, generator=g)
        with amp.scale_loss(m(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()


def _roundtrip(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf)  # weights_only=True: plain tensors and numbers only


def _masters_of(opt, model):
    """The fp32 value amp or the optimizer keeps for each half param, in model order."""
    stash = opt._amp_stash
    if stash.all_fp32_from_fp16_params and stash.amp_state.strategy.masters is not None:
        return [m.detach().clone() for m in stash.all_fp32_from_fp16_params]
    return [
        opt.state[p]["master_param"].clone() for p in model.parameters() if p.dtype != torch.float32
    ]


# ---- 16.5: O2 after an interrupted block; non-contiguous params ------------------------------


@pytest.mark.parametrize("interrupt", [RuntimeError, KeyboardInterrupt])
def test_o2_after_an_interrupted_block_uses_the_true_gradient(interrupt):
    x = torch.randn(6, 5)
    results = []
    for interrupted in (False, True):
        m, opt = _init("O2", lambda p: torch.optim.SGD(p, lr=0.1))
        if interrupted:
            with pytest.raises(interrupt):
                with amp.scale_loss(m(x).float().pow(2).mean(), opt) as s:
                    s.backward()
                    raise interrupt("stopped after backward")
            opt.zero_grad()
        with amp.scale_loss(m(x).float().pow(2).mean(), opt) as s:
            s.backward()
        opt.step()
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)  # not twice the gradient


def test_o2_trains_a_non_contiguous_parameter():
    results = []
    for transposed in (False, True):
        m = _net()
        if transposed:  # the same values, stored transposed
            w = m[0].weight.detach()
            m[0].weight = torch.nn.Parameter(w.t().contiguous().t())
            assert not m[0].weight.is_contiguous()
        m, opt = _init("O2", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), model=m)
        _train(m, opt)
        results.append([p.detach().clone() for p in m.parameters()])
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)


# ---- 16.6: fp32 masters across checkpoints ----------------------------------------------------


@pytest.mark.parametrize("saver, loader", [("adamw", "fused_adam"), ("fused_adam", "adamw")])
def test_o2_masters_survive_a_switch_of_optimizer_kind(saver, loader):
    m, opt = _init("O2", ADAMW[saver])
    _train(m, opt)
    saved_masters = _masters_of(opt, m)
    ck = _roundtrip({"model": m.state_dict(), "opt": opt.state_dict(), "amp": amp.state_dict()})
    m2, opt2 = _init("O2", ADAMW[loader])
    m2.load_state_dict(ck["model"])
    opt2.load_state_dict(ck["opt"])
    amp.load_state_dict(ck["amp"])
    restored = _masters_of(opt2, m2)
    assert len(restored) == len(saved_masters)
    for a, b in zip(saved_masters, restored, strict=True):
        assert torch.equal(a, b)  # the fp32 values, not the rounded half ones
    assert not any(torch.equal(a, a.bfloat16().float()) for a in saved_masters)
    _train(m2, opt2, steps=1)  # and training goes on


@pytest.mark.parametrize("saver", list(ADAMW))
@pytest.mark.parametrize("model_first", [True, False])
@pytest.mark.parametrize("level", ["O1", "O0"])  # O0: how a torch.optim run without mixed
def test_an_o2_checkpoint_loaded_into_o1_carries_the_masters(saver, model_first, level):
    m, opt = _init("O2", ADAMW[saver])  # precision keeps the masters (amp's hooks load them)
    _train(m, opt)
    saved_masters = _masters_of(opt, m)
    ck = _roundtrip({"model": m.state_dict(), "opt": opt.state_dict()})
    m1, opt1 = _init(level, lambda p: torch.optim.AdamW(p, lr=1e-2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if model_first:
            m1.load_state_dict(ck["model"])
            opt1.load_state_dict(ck["opt"])
        else:
            opt1.load_state_dict(ck["opt"])
            m1.load_state_dict(ck["model"])
    fp32 = [m1[0].weight, m1[0].bias, m1[3].weight, m1[3].bias]
    for a, b in zip(saved_masters, fp32, strict=True):
        assert torch.equal(a, b.detach())
    assert all("master_param" not in s for s in opt1.state_dict()["state"].values())


@pytest.mark.parametrize("loader", list(ADAMW))
def test_an_o1_checkpoint_loaded_into_o2_makes_the_masters_from_its_fp32_weights(loader):
    m, opt = _init("O1", lambda p: torch.optim.AdamW(p, lr=1e-2))
    _train(m, opt)
    fp32 = [p.detach().clone() for p in (m[0].weight, m[0].bias, m[3].weight, m[3].bias)]
    ck = _roundtrip({"model": m.state_dict()})
    m2, opt2 = _init("O2", ADAMW[loader])
    m2.load_state_dict(ck["model"])
    restored = _masters_of(opt2, m2)
    for a, b in zip(fp32, restored, strict=True):
        assert torch.equal(a, b)


def test_half_weights_into_o1_without_masters_warn_once():
    m, opt = _init("O3", lambda p: torch.optim.SGD(p, lr=0.1))
    ck = _roundtrip(m.state_dict())
    m1, _ = _init("O1", lambda p: torch.optim.SGD(p, lr=0.1))
    with pytest.warns(RoundedWeightsWarning, match="rounded half") as rec:
        m1.load_state_dict(ck)
        m1.load_state_dict(ck)
    assert sum("rounded half values" in str(r.message) for r in rec) == 1


def test_a_master_count_mismatch_changes_nothing():
    m, opt = _init("O2", lambda p: torch.optim.Adam(p, lr=1e-2))
    _train(m, opt)
    sd = opt.state_dict()
    m2, opt2 = _init("O2", lambda p: torch.optim.Adam(p, lr=1e-2), keep_batchnorm_fp32=False)
    _train(m2, opt2, steps=1)
    before = {
        k: {n: v.clone() for n, v in s.items()} for k, s in opt2.state_dict()["state"].items()
    }
    with pytest.raises(ValueError, match="fp32 master"):
        opt2.load_state_dict(sd)
    after = opt2.state_dict()["state"]
    for k, s in before.items():
        for n, v in s.items():
            assert torch.equal(v, after[k][n]), (k, n)  # exp_avg was not replaced


# ---- loss scales across configurations --------------------------------------------------------


def _scaled_run(**kw):
    m = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        amp.initialize(m, opt, opt_level="O1", verbosity=0, **kw)
    return amp.state_dict()


FP16_DYNAMIC = dict(half_dtype=torch.float16)
FP16_STATIC = dict(half_dtype=torch.float16, loss_scale=128.0)
BF16_NONE = dict(half_dtype=torch.bfloat16)


@pytest.mark.parametrize(
    "saved, loaded, said",
    [
        (FP16_DYNAMIC, FP16_STATIC, r"is dynamic \(65536\), this run has a static scale of 128"),
        (FP16_DYNAMIC, BF16_NONE, r"is dynamic \(65536\), this run has no loss scaling"),
        (BF16_NONE, FP16_DYNAMIC, r"is static \(1\), this run's is dynamic: it keeps its own"),
        (FP16_STATIC, BF16_NONE, r"is static \(128\), this run has no loss scaling"),
    ],
)
def test_a_loss_scale_of_another_kind_is_not_taken_and_one_warning_says_so(saved, loaded, said):
    ck = _roundtrip(_scaled_run(**saved))
    own = _scaled_run(**loaded)
    with pytest.warns(UserWarning, match="amp.load_state_dict: loss_scaler0: .*" + said) as rec:
        amp.load_state_dict(ck)
    assert sum("loss_scaler0" in str(w.message) for w in rec) == 1
    assert amp.state_dict() == own  # the run's own scale, kind and counters


def test_a_loss_scale_of_the_same_kind_loads_without_a_word():
    ck = _scaled_run(half_dtype=torch.float16, loss_scale=dict(init_scale=1024.0))
    _scaled_run(**FP16_DYNAMIC)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        amp.load_state_dict(ck)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 1024.0
    apex_entry = {"loss_scaler0": {"loss_scale": 512.0, "unskipped": 3}}  # Apex's: no kind
    _scaled_run(**FP16_STATIC)
    amp.load_state_dict(apex_entry)
    assert amp.state_dict()["loss_scaler0"]["loss_scale"] == 512.0
