"""The seven ``amp_C`` functions mpnb lacked (DLE BERT's LAMB stages, Apex's capturable Adam and
mixed-precision LAMB, the norm variants), called as Apex's optimizers and NVIDIA's BERT call
them, against their plain references (:mod:`mpnb.core.amp_C_reference`) on every dtype."""

from __future__ import annotations

import copy

import pytest
import torch

from mpnb import amp_C
from mpnb.core import amp_C_reference as R
from mpnb.multi_tensor_apply import multi_tensor_applier
from mpnb.optimizers import FusedLAMB

APEX_AMP_C = {  # every function of Apex's amp_C module (csrc/amp_C_frontend.cpp)
    "multi_tensor_scale",
    "multi_tensor_sgd",
    "multi_tensor_axpby",
    "multi_tensor_l2norm",
    "multi_tensor_l2norm_mp",
    "multi_tensor_l2norm_scale",
    "multi_tensor_unscale_l2norm",
    "multi_tensor_lamb_stage1_cuda",
    "multi_tensor_lamb_stage2_cuda",
    "multi_tensor_adam",
    "multi_tensor_adam_capturable",
    "multi_tensor_adam_capturable_master",
    "multi_tensor_adagrad",
    "multi_tensor_novograd",
    "multi_tensor_lamb",
    "multi_tensor_lamb_mp",
    "update_scale_hysteresis",
}
SIZES = (1, 33, 4099, 70001)
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# one rounding of the params' dtype apart at most (fp32: a few ulp, plus near-zero values)
TOL = {torch.float32: (1e-5, 1e-6), torch.float16: (1e-3, 1e-5), torch.bfloat16: (8e-3, 1e-4)}


def _noop():
    return torch.zeros(1, dtype=torch.int32)


def _lists(dtype, n_lists, seed=0, state_dtype=None):
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n_lists):
        dt = dtype if k < 2 or state_dtype is None else state_dtype
        scale = 0.1 if k >= 2 else 1.0
        xs = [torch.randn(n, generator=g) * scale for n in SIZES]
        out.append([(x.abs() if k == 3 else x).to(dt) for x in xs])
    return out


def _close(got, want, dtype):
    rtol, atol = TOL[dtype]
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=rtol, atol=atol)


def _both(fn_name, lists, *args):
    """Run amp_C's function and its reference on copies; return both copies of the lists."""
    mine, ref = copy.deepcopy(lists), copy.deepcopy(lists)
    with torch.no_grad():
        multi_tensor_applier(getattr(amp_C, fn_name), _noop(), mine, *args)
        getattr(R, f"reference_{fn_name}")(2048, _noop(), ref, *args)
    return mine, ref


def test_all_seventeen_functions_of_apexs_amp_C_exist():
    assert APEX_AMP_C <= set(amp_C.__all__)
    assert all(callable(getattr(amp_C, n)) for n in APEX_AMP_C)


def test_bert_resolves_the_lamb_stages_at_import():
    """NVIDIA's BERT binds the LAMB kernels as module globals when its optimizer module is
    imported (under the alias: ``import amp_C``)."""
    from mpnb.compat import apex_alias

    with apex_alias():
        import amp_C as apex_amp_C

        compute, apply = (
            apex_amp_C.multi_tensor_lamb_stage1_cuda,
            apex_amp_C.multi_tensor_lamb_stage2_cuda,
        )
    assert compute is amp_C.multi_tensor_lamb_stage1_cuda and callable(apply)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_tensor", [False, True])
def test_l2norm_mp_and_l2norm_scale_match_reference(dtype, per_tensor):
    (x,) = _lists(dtype, 1)
    got = amp_C.multi_tensor_l2norm_mp(2048, _noop(), [x], per_tensor)
    want = R.reference_multi_tensor_l2norm_mp(2048, _noop(), [x], per_tensor)
    _close(got, want, torch.float32)
    skipped = amp_C.multi_tensor_l2norm_mp(2048, torch.ones(1, dtype=torch.int32), [x], True)
    assert skipped[0].item() == 0 and skipped[1].abs().sum() == 0
    dst = [torch.empty_like(t, dtype=torch.float32) for t in x]
    mine, ref = _both("multi_tensor_l2norm_scale", [x, dst], 0.25, per_tensor)
    _close(mine[1], ref[1], torch.float32)
    flag = _noop()
    norms = amp_C.multi_tensor_l2norm_scale(2048, flag, [x, dst], 0.25, per_tensor)
    _close(
        norms,
        R.reference_multi_tensor_l2norm_scale(2048, _noop(), [x, dst], 0.25, per_tensor),
        torch.float32,
    )
    assert flag.item() == 0
    x[1][3] = float("inf")
    amp_C.multi_tensor_l2norm_scale(2048, flag, [x, dst], 0.25, per_tensor)
    assert flag.item() == 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_lamb_stages_run_their_references(dtype):
    """No mpnb op computes the LAMB stages: each shim runs its reference's body through Apex's
    signature (their values are tested in test_amp_C_reference.py and, both stages together,
    against FusedLAMB below)."""
    for stage in ("multi_tensor_lamb_stage1_cuda", "multi_tensor_lamb_stage2_cuda"):
        assert getattr(amp_C, stage).body is getattr(R, f"reference_{stage}").body
    g, p, m, v = _lists(dtype, 4, seed=1)
    upd = [torch.empty_like(t) for t in p]
    decay = torch.tensor([0.01, 0.0, 0.01, 0.01])
    gnorm = torch.tensor([3.0])
    mine, ref = _both(
        "multi_tensor_lamb_stage1_cuda", [g, p, m, v, upd], decay, 4, 0.9, 0.999, 1e-6, gnorm, 1.0
    )
    _close(mine[2] + mine[3] + mine[4], ref[2] + ref[3] + ref[4], dtype)
    pn = torch.stack([t.float().norm() for t in p])
    un = torch.stack([t.float().norm() for t in ref[4]])
    for nvlamb in (False, True):
        got, want = _both("multi_tensor_lamb_stage2_cuda", [p, ref[4]], pn, un, 1e-2, 0.01, nvlamb)
        _close(got[0], want[0], dtype)


def test_two_lamb_stages_are_one_lamb_step():
    """BERT's two-stage LAMB (stage 1, the norms, stage 2) is mpnb's FusedLAMB step, in fp32."""
    g, p, m, v = _lists(torch.float32, 4, seed=2)
    m, v = [torch.zeros_like(t) for t in p], [torch.zeros_like(t) for t in p]
    params = [torch.nn.Parameter(t.clone()) for t in p]
    for q, x in zip(params, g, strict=True):
        q.grad = x.clone()
    opt = FusedLAMB(params, lr=1e-2, weight_decay=0.01, max_grad_norm=1.0)
    opt.step()
    gnorm = amp_C.multi_tensor_l2norm(2048, _noop(), [g])[0]
    upd = [torch.empty_like(t) for t in p]
    decay = torch.full((len(p),), 0.01)
    amp_C.multi_tensor_lamb_stage1_cuda(
        2048, _noop(), [g, p, m, v, upd], decay, 0, 0.9, 0.999, 1e-6, gnorm, 1.0
    )
    pn = amp_C.multi_tensor_l2norm(2048, _noop(), [p], True)[1]
    un = amp_C.multi_tensor_l2norm(2048, _noop(), [upd], True)[1]
    amp_C.multi_tensor_lamb_stage2_cuda(2048, _noop(), [p, upd], pn, un, 1e-2, 0.01)
    _close(p, [q.detach() for q in params], torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
@pytest.mark.parametrize("master", [False, True])
def test_adam_capturable_matches_reference(dtype, mode, master):
    if master and dtype == torch.float32:
        pytest.skip("masters are for half params")
    lists = _lists(dtype, 4, seed=3, state_dtype=torch.float32)
    if master:
        lists.append([t.float() for t in lists[1]])
    name = "multi_tensor_adam_capturable" + ("_master" if master else "")
    args = (
        torch.tensor([1e-2]),
        0.9,
        0.999,
        1e-8,
        torch.tensor([3], dtype=torch.int32),
        mode,
        1,
        0.05,
        torch.tensor([0.5]),
    )
    mine, ref = _both(name, lists, *args)
    for k in range(len(lists)):  # without masters the moments are rounded to dtype too
        _close(mine[k], ref[k], dtype if k in (0, 1) or not master else torch.float32)
    untouched = copy.deepcopy(lists)
    getattr(amp_C, name)(2048, torch.ones(1, dtype=torch.int32), untouched, *args)
    for a, b in zip(untouched, lists, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mode", [0, 1])
def test_lamb_mp_matches_reference(dtype, mode):
    """FusedMixedPrecisionLamb's call: fp32 params (4 lists) or half params with fp32 masters
    (5 lists); norms of the scaled grads and a scaled max_grad_norm."""
    scale = 1024.0
    g, p, m, v = _lists(dtype, 4, seed=4, state_dtype=torch.float32)
    g = [(t.float() * scale).to(dtype) for t in g]
    lists = [g, p, m, v] if dtype == torch.float32 else [g, [t.float() for t in p], m, v, p]
    gnorm = torch.stack([t.float().norm() for t in g]).norm().reshape(1)
    args = (
        torch.tensor([1e-2]),
        0.9,
        0.999,
        1e-6,
        torch.tensor([2], dtype=torch.int32),
        1,
        0.01,
        1,
        mode,
        gnorm,
        torch.tensor([scale]),
        False,
        torch.zeros(1),
        torch.tensor([1 / scale]),
    )
    mine, ref = _both("multi_tensor_lamb_mp", lists, *args)
    for k in range(1, len(lists)):
        _close(mine[k], ref[k], dtype if k == 4 else torch.float32)
    found = list(args)
    found[-2] = torch.ones(1)
    untouched = copy.deepcopy(lists)
    amp_C.multi_tensor_lamb_mp(2048, _noop(), untouched, *found)
    assert all(
        torch.equal(x, y)
        for a, b in zip(untouched, lists, strict=True)
        for x, y in zip(a, b, strict=True)
    )
