"""Apex's generic masked softmax and FusedScaleMaskSoftmax's errors, written from Apex's
test_fused_softmax: ``generic_scaled_masked_softmax`` (and its ``_cuda`` extension's
forward/backward) gives a fully masked row zeros and a zero gradient (test_allmasked,
test_allmask_backward), and the module's bad configurations raise what Apex raises
(RuntimeError) while staying ValueErrors.

Kernel vs reference (the ``zero_all_masked`` samples) and opcheck: tests/core/ops/test_op_table.py.
"""

from __future__ import annotations

import importlib

import pytest
import torch

from mpnb.compat import apex_alias
from mpnb.transformer import AttnMaskType
from mpnb.transformer.functional import FusedScaleMaskSoftmax, generic_scaled_masked_softmax


def torch_generic(x, mask, scale):
    """Apex's test reference: the masked softmax times (1 - row fully masked)."""
    probs = torch.softmax((x * scale).masked_fill(mask, -10000.0), -1)
    return probs * (1.0 - mask.all(-1).float())[..., None]


def _case(q, k, allmasked, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(2, 16, q, k, generator=g) * 2).to(dtype)
    if allmasked:
        mask = torch.ones(2, 1, q, k, dtype=torch.bool)
    else:
        mask = torch.randint(0, 2, (2, 1, q, k), generator=g).bool()
        mask[0, 0, 0] = True  # and one fully masked row among the others
    return x, mask


@pytest.mark.parametrize("allmasked", [False, True])
@pytest.mark.parametrize("q,k", [(1, 1), (2, 5), (2, 13), (1, 1234)])
def test_generic_forward_and_backward_match_apexs_reference(op_impl, allmasked, q, k):
    x, mask = _case(q, k, allmasked)
    xr = x.float().requires_grad_(True)
    want = torch_generic(xr, mask, 1.0)
    dy = torch.rand_like(x)
    want.backward(dy.float())
    xg = x.clone().requires_grad_(True)
    got = generic_scaled_masked_softmax(xg, mask, 1.0)
    got.backward(dy)
    torch.testing.assert_close(got.float(), want.detach(), atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(xg.grad.float(), xr.grad, atol=1.5e-1, rtol=5e-3)
    rows = mask.expand_as(x).all(-1)
    assert (got[rows] == 0).all() and (xg.grad[rows] == 0).all()


def test_the_cuda_extension_module_under_the_alias(op_impl):
    """Apex's test calls the extension directly: forward(inputs, mask, scale) and
    backward(grads, softmax_results, scale)."""
    x, mask = _case(2, 11, True)
    dy = torch.rand_like(x)
    with apex_alias():
        k = importlib.import_module("generic_scaled_masked_softmax_cuda")
        y = k.forward(x, mask, 1.0)
        dx = k.backward(dy, y, torch.tensor([1.0])[0])
    assert (y == 0).all() and (dx == 0).all()
    x, mask = _case(2, 11, False)
    y = k.forward(x, mask, 0.5)
    torch.testing.assert_close(y.float(), torch_generic(x.float(), mask, 0.5), atol=1e-3, rtol=1e-3)


def test_the_masked_softmax_keeps_apexs_uniform_rows():
    """FusedScaleMaskSoftmax's own kernel (scaled_masked_softmax) stays Apex's: a fully masked
    row spreads evenly; only the generic one zeroes it."""
    from mpnb.transformer.functional import scaled_masked_softmax

    x, mask = _case(2, 8, True, torch.float32)
    torch.testing.assert_close(scaled_masked_softmax(x, mask, 1.0), torch.full_like(x, 1 / 8))


@pytest.mark.parametrize(
    "args",
    [
        (True, True, AttnMaskType.padding, True, None, True, None),  # both half flags
        (True, False, AttnMaskType.padding, True, None, False, 2.0),  # scale without fp32
        (True, False, "padding", True, None, True, None),  # not an AttnMaskType
    ],
    ids=["both flags", "scale without fp32", "mask type"],
)
def test_bad_configurations_raise_what_apex_raises(args):
    with pytest.raises(RuntimeError):
        FusedScaleMaskSoftmax(*args)
    with pytest.raises(ValueError):
        FusedScaleMaskSoftmax(*args)
