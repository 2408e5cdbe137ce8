"""The plain references of :mod:`mpnb.core.amp_C_reference`, called with Apex's signatures on
a few small rows whose results are computed by hand.

At the first Adam step (moments zero, ``step`` 1, bias correction) ``m / (1 - b1) = g`` and
``v / (1 - b2) = g^2``, so the update is ``g / (|g| + eps)``: the sign of ``g`` with
``eps = 0``. The rows below use that to keep the arithmetic checkable on paper.
"""

from __future__ import annotations

import math

import pytest
import torch

from mpnb.core import amp_C_reference as R

B1, B2 = 0.9, 0.999


def _flag(value=0):
    return torch.full((1,), value, dtype=torch.int32)


def _t(*xs, dtype=torch.float32):
    return torch.tensor(xs, dtype=dtype)


def _close(got, want, rtol=1e-6, atol=1e-7):
    torch.testing.assert_close(got.float(), torch.as_tensor(want).float(), rtol=rtol, atol=atol)


def test_l2norm_mp_gives_the_norms_and_zeros_under_a_set_flag():
    total, per = R.reference_multi_tensor_l2norm_mp(2048, _flag(), [[_t(3, 4), _t(0, 0, 12)]], True)
    _close(total, [13.0])
    _close(per, [5.0, 12.0])
    total, per = R.reference_multi_tensor_l2norm_mp(2048, _flag(), [[_t(3, 4)]], False)
    assert per.numel() == 0 and total.item() == 5.0
    total, per = R.reference_multi_tensor_l2norm_mp(2048, _flag(1), [[_t(3, 4)]], True)
    assert total.item() == 0.0 and per.tolist() == [0.0]


def test_l2norm_scale_scales_and_measures_the_source():
    src, dst, flag = [_t(3, 4)], [torch.empty(2)], _flag()
    total, per = R.reference_multi_tensor_l2norm_scale(2048, flag, [src, dst], 0.5, True)
    _close(dst[0], [1.5, 2.0])
    _close(total, [5.0])
    _close(per, [5.0])
    assert flag.item() == 0
    R.reference_multi_tensor_l2norm_scale(2048, flag, [[_t(1, math.inf)], dst], 0.5, False)
    assert flag.item() == 1


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_lamb_stage1_first_step_with_clipping(dtype):
    """g = 2 clipped by |G| / max = 4 to 0.5: m = 0.05, v = 0.00025, the update is
    sign(g) + decay * p = 1 + 0.1 * 1 (the second tensor has no decay: -1)."""
    g, p = [_t(2.0, dtype=dtype), _t(-2.0, dtype=dtype)], [_t(1.0, dtype=dtype)] * 2
    m, v = [torch.zeros(1, dtype=dtype) for _ in p], [torch.zeros(1, dtype=dtype) for _ in p]
    upd = [torch.empty(1, dtype=dtype) for _ in p]
    decay = _t(0.1, 0.0)
    R.reference_multi_tensor_lamb_stage1_cuda(
        2048, _flag(), [g, p, m, v, upd], decay, 0, B1, B2, 0.0, _t(4.0), 1.0
    )
    tol = {"rtol": 1e-2, "atol": 1e-4} if dtype != torch.float32 else {}
    _close(m[0], [0.05], **tol)
    _close(v[1], [0.00025], **tol)
    _close(upd[0], [1.1], **tol)
    _close(upd[1], [-1.0], **tol)
    assert all(x.dtype == dtype for x in (*m, *v, *upd))


def test_lamb_stage2_applies_the_trust_ratio():
    """|p| = sqrt(2), |u| = sqrt(0.5): the ratio is lr * 2 = 0.2 with decay or NVLAMB, else lr;
    a zero norm gives lr."""
    pn, un = _t(math.sqrt(2.0), math.sqrt(2.0)), _t(math.sqrt(0.5), 0.0)
    for wd, nvlamb, want in ((0.01, False, 0.9), (0.0, False, 0.95), (0.0, True, 0.9)):
        p, u = [torch.ones(2), torch.ones(2)], [torch.full((2,), 0.5), torch.full((2,), 0.5)]
        R.reference_multi_tensor_lamb_stage2_cuda(2048, _flag(), [p, u], pn, un, 0.1, wd, nvlamb)
        _close(p[0], [want, want])
        _close(p[1], [0.95, 0.95])  # |u| = 0: the ratio is lr


def _adam_lists(dtype=torch.float32):
    return [[_t(4.0)], [_t(1.0, dtype=dtype)], [torch.zeros(1)], [torch.zeros(1)]]


@pytest.mark.parametrize("mode, p_want, m_want", [(1, 0.89, 0.2), (0, 0.9, 0.21)])
def test_adam_capturable_first_step(mode, p_want, m_want):
    """g = 4 unscaled by 0.5 to 2 (written back into the grad). AdamW: p = 1 - 0.1 * (1 + 0.1);
    Adam with L2: the grad 2 + 0.1 * 1 and p = 1 - 0.1 * 1."""
    lists = _adam_lists()
    args = (_t(0.1), B1, B2, 0.0, _t(1), mode, 1, 0.1, _t(0.5))
    R.reference_multi_tensor_adam_capturable(2048, _flag(), lists, *args)
    g, p, m, v = (x[0] for x in lists)
    _close(g, [2.0])
    _close(p, [p_want])
    _close(m, [m_want])
    _close(v, [(1 - B2) * (m_want / (1 - B1)) ** 2])


def test_adam_capturable_master_updates_the_masters_and_copies_them_to_the_params():
    lists = _adam_lists(torch.float16) + [[_t(1.0)]]
    args = (_t(0.1), B1, B2, 0.0, _t(1), 1, 1, 0.1, _t(0.5))
    R.reference_multi_tensor_adam_capturable_master(2048, _flag(), lists, *args)
    _close(lists[4][0], [0.89])
    assert lists[1][0].dtype == torch.float16 and lists[1][0].item() == _t(0.89).half().item()


def test_adam_capturable_writes_nothing_under_a_set_flag():
    lists = _adam_lists()
    args = (_t(0.1), B1, B2, 0.0, _t(1), 1, 1, 0.1, _t(0.5))
    R.reference_multi_tensor_adam_capturable(2048, _flag(1), lists, *args)
    assert [x[0].item() for x in lists] == [4.0, 1.0, 0.0, 0.0]


def _lamb_mp(lists, flag=None, found_inf=0.0, nvlamb=False, grad_averaging=1, lr=0.1):
    """p = [3, 4] (|p| = 5), grads [1.2, 1.6] scaled by 2, no clipping (|G| 2 of a max 10)."""
    args = (_t(lr), B1, B2, 0.0, _t(1), 1, 0.0, grad_averaging, 1, _t(2.0), _t(10.0), nvlamb)
    R.reference_multi_tensor_lamb_mp(2048, flag or _flag(), lists, *args, _t(found_inf), _t(0.5))


def test_lamb_mp_first_step_with_and_without_nvlamb():
    """The update is sign(g) = [1, 1] (|u| = sqrt 2): without decay the ratio is lr, with
    NVLAMB lr * 5 / sqrt(2)."""
    lists = [[_t(1.2, 1.6)], [_t(3.0, 4.0)], [torch.zeros(2)], [torch.zeros(2)]]
    _lamb_mp(lists)
    _close(lists[1][0], [2.9, 3.9])
    _close(lists[2][0], [0.06, 0.08])  # (1 - b1) * the unscaled grad [0.6, 0.8]
    lists = [[_t(1.2, 1.6)], [_t(3.0, 4.0)], [torch.zeros(2)], [torch.zeros(2)]]
    _lamb_mp(lists, nvlamb=True)
    r = 0.1 * 5 / math.sqrt(2.0)
    _close(lists[1][0], [3 - r, 4 - r])


def test_lamb_mp_without_grad_averaging_and_with_a_model_copy():
    """Without grad averaging m = g, so the update is (m / 0.1) / |g| = 10 sign(g); the fp16
    model params receive the fp32 masters' new values."""
    model = [_t(3.0, 4.0, dtype=torch.float16)]
    lists = [[_t(1.2, 1.6)], [_t(3.0, 4.0)], [torch.zeros(2)], [torch.zeros(2)], model]
    _lamb_mp(lists, grad_averaging=0, lr=0.01)
    _close(lists[1][0], [2.9, 3.9])
    assert torch.equal(model[0], _t(2.9, 3.9).half())


@pytest.mark.parametrize("flag, found_inf", [(1, 0.0), (0, 1.0)])
def test_lamb_mp_writes_nothing_under_a_set_flag_or_found_inf(flag, found_inf):
    lists = [[_t(1.2, 1.6)], [_t(3.0, 4.0)], [torch.zeros(2)], [torch.zeros(2)]]
    _lamb_mp(lists, flag=_flag(flag), found_inf=found_inf)
    assert lists[1][0].tolist() == [3.0, 4.0] and lists[2][0].tolist() == [0.0, 0.0]
