"""``mpnb::fused_lamb_`` (``mpnb/core/ops/lamb.py``): LAMB's trust ratios are per tensor, so
a step is the paper's formula (grads clipped by the global norm, the Adam direction scaled by
the trust ratio where there is decay or ``use_nvlamb``); its bits do not depend on how tensors
are grouped or on the threads; a global grad norm that is not one value is refused, naming
``multi_tensor_l2norm``. (What every optimizer op shares:
``test_optim.py``; kernel vs reference on every dtype: ``test_library.py``.)"""

from __future__ import annotations

import copy

import pytest
import torch

import mpnb.core.ops as ops
from mpnb.core.ops._optim import lists_for
from tests.core.ops.test_optim import _call, _flat


def _pick(lists, idx):
    params, grads, masters, states, steps = lists
    pick = lambda xs: [xs[i] for i in idx] if xs else []  # noqa: E731
    return pick(params), pick(grads), pick(masters), [pick(s) for s in states], pick(steps)


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_lamb_bits_independent_of_grouping_and_threads(kernels, use_nvlamb):
    """LAMB's trust ratios are per tensor: one call over a list (tensors grouped for the cache,
    one larger than a group) equals one call per tensor, on 1 and 2 threads, bit for bit."""
    sizes = (3, 1_100_000, 384, 70_001, 600_000, 600_000, 2)  # group limit: 655_360
    base = lists_for(torch.bfloat16, torch.bfloat16, True, 2, sizes, seed=5, grad_scale=64.0)
    extra = dict(inv_scale=torch.tensor([1 / 64]))
    if use_nvlamb:
        extra |= dict(weight_decay=0.0, use_nvlamb=True)

    def run(per_tensor, threads):
        lists = copy.deepcopy(base)
        old = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            parts = [[i] for i in range(len(sizes))] if per_tensor else [list(range(len(sizes)))]
            for idx in parts:
                fn, args, kw = _call("lamb", _pick(lists, idx), **extra)
                fn(*args, **kw)
        finally:
            torch.set_num_threads(old)
        return _flat(lists)

    ref = run(True, 1)
    for per_tensor, threads in ((False, 1), (False, 2), (True, 2)):
        out = run(per_tensor, threads)
        assert all(torch.equal(a, b) for a, b in zip(out, ref, strict=True))


@pytest.mark.parametrize(
    ("weight_decay", "use_nvlamb"), [(0.01, False), (0.0, False), (0.0, True)], ids=str
)
def test_a_step_is_lambs_formula(op_impl, weight_decay, use_nvlamb):
    """fp32, from zero moments, with grads clipped by the global norm: the Adam direction u
    (plus the decoupled decay), scaled per tensor by ||w|| / ||u|| where there is decay or
    ``use_nvlamb``, by 1 otherwise."""
    g = torch.Generator().manual_seed(8)
    ws = [torch.randn(n, generator=g) for n in (33, 500)]
    gs = [torch.randn(n, generator=g) * 3 for n in (33, 500)]
    total = torch.stack([x.norm() for x in gs]).norm().reshape(1)
    lr, b1, b2, eps, max_norm = 1e-2, 0.9, 0.999, 1e-6, 1.0
    params = [w.clone() for w in ws]
    ops.fused_lamb_(
        params,
        gs,
        [torch.zeros_like(w) for w in ws],
        [torch.zeros_like(w) for w in ws],
        [],
        [torch.tensor(0.0) for _ in ws],
        total,
        lr=lr,
        beta1=b1,
        beta2=b2,
        eps=eps,
        weight_decay=weight_decay,
        max_grad_norm=max_norm,
        use_nvlamb=use_nvlamb,
    )
    clip = max(total.item() / max_norm, 1.0)
    for w0, g0, got in zip(ws, gs, params, strict=True):
        w0, g0 = w0.double(), g0.double() / clip
        m, v = (1 - b1) * g0, (1 - b2) * g0 * g0
        u = (m / (1 - b1)) / ((v / (1 - b2)).sqrt() + eps) + weight_decay * w0
        r = (w0.norm() / u.norm()).item() if weight_decay or use_nvlamb else 1.0
        torch.testing.assert_close(got.double(), w0 - lr * r * u, rtol=1e-5, atol=1e-6)


BAD = {
    "lamb norm": (
        ValueError,
        "multi_tensor_l2norm",
        lambda: ops.fused_lamb_(
            [torch.randn(4)],
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [],
            [torch.tensor(0.0)],
            torch.ones(2),
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-6,
            weight_decay=0.0,
        ),
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_arguments_raise_errors_that_name_the_fix(op_impl, case):
    """The kernel and the reference raise the same exception type, naming the fix."""
    exc, fix, call = BAD[case]
    with pytest.raises(exc, match=fix):
        call()
