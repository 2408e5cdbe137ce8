"""mpnb's fused optimizers stepping through the Triton launchers, against the same optimizers
through the dispatcher (the C++ kernels, or the references).

The op tests give each launcher the arguments a test writes; an optimizer writes its own (no
``first_run`` flags without momentum, cached momentum buffers from the second step, bf16
params without masters, the rounding options). On a GPU the measured table can route any of
these calls to Triton by default, so every launcher must take exactly what the optimizers
pass: here the launchers serve the ops for the test (``triton_as_kernels``: interpreted on a
CPU, compiled on a GPU) and three steps are compared with the same optimizer's on the CPU
through the dispatcher. The launchers pass the kernels' scalars by name, from the op's
arguments (``OpKernel``): the last tests check those names.
"""

from __future__ import annotations

import pytest
import torch

from .triton_cases import close, gen, randn, triton_as_kernels

F32, BF16 = torch.float32, torch.bfloat16
SIZES = (7, 1025, 300)

CASES = [
    ("FusedAdam", F32, dict(lr=1e-2, weight_decay=0.01)),
    ("FusedAdam", BF16, dict(lr=1e-2)),  # bf16 params, no masters: the plain op
    ("FusedAdam", BF16, dict(lr=1e-2, stochastic_rounding=True)),
    ("FusedAdam", BF16, dict(lr=1e-2, kahan_summation=True)),
    ("FusedSGD", F32, dict(lr=0.1)),  # no momentum: no buffers, no first_run flags
    ("FusedSGD", F32, dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.01)),
    ("FusedSGD", BF16, dict(lr=0.1, momentum=0.9)),
    ("FusedSGD", BF16, dict(lr=0.1, stochastic_rounding=True)),
    ("FusedSGD", BF16, dict(lr=0.1, momentum=0.9, kahan_summation=True)),
    ("FusedLAMB", F32, dict(lr=1e-2, weight_decay=0.01)),
    ("FusedLAMB", BF16, dict(lr=1e-2, stochastic_rounding=True)),
]


def _steps(cls_name: str, dtype, options: dict, device: str):
    """The params after three steps of ``cls_name`` on fixed grads."""
    import mpnb.optimizers

    g = gen(0)
    params = [torch.nn.Parameter(randn(n, dtype, g).to(device)) for n in SIZES]
    seeded = torch.Generator().manual_seed(3)  # the same random bits on both paths
    opt = getattr(mpnb.optimizers, cls_name)(params, **options, generator=seeded)
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = randn(p.shape, dtype, gen(10 * step + i)).to(device)
        opt.step()
    return [p.detach().cpu() for p in params]


@pytest.mark.parametrize(("cls_name", "dtype", "options"), CASES, ids=str)
def test_optimizer_steps_through_triton(cls_name, dtype, options, device, ulps):
    want = _steps(cls_name, dtype, options, "cpu")
    with triton_as_kernels(device):
        got = _steps(cls_name, dtype, options, device)
    # a bf16 param is an fp32 value rounded: an fp32 ulp apart can round one bf16 ulp apart
    close(got, want, 4 * ulps if dtype == F32 else 1.0)


def _sgd_args(name: str, **kw):
    """The named tuple of a ``name`` call (its lists empty, its options ``kw`` or off)."""
    from mpnb.core.ops import op_info

    Args = op_info(name).Args
    lists = {f: [] for f in Args._fields[:5]}
    off = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False)
    return Args(**lists, **(off | dict(wd_after_momentum=False) | kw))


def test_kernel_takes_the_op_arguments_by_name():
    from mpnb.core.ops.triton._chunks import ChunkTable
    from mpnb.core.ops.triton._common import f32, split64
    from mpnb.core.ops.triton._optim import OpKernel

    def k(
        table,
        n_tensors,
        ROW,
        CHUNK,
        BLOCK,
        lr_hi,
        lr_lo,
        neg_lr,
        one_m_dampening,
        momentum,
        HAS_MOMENTUM,
        NESTEROV,
        HAS_FOUND_INF,
        found_inf,
        inv_scale,
        HAS_MASTERS=False,
        STEPWISE=False,
    ):
        pass

    inv = torch.ones(1)
    args = _sgd_args("fused_sgd_", lr=0.1, momentum=0.9, dampening=0.3, inv_scale=inv)
    args = args._replace(nesterov=True, stepwise=True)
    tab = ChunkTable.build([[torch.zeros(3)]])
    kw = OpKernel(k).kwargs(args, tab)
    assert (kw["lr_hi"], kw["lr_lo"]) == split64(0.1) and kw["lr_lo"] != 0.0
    assert kw["neg_lr"] == f32(-0.1) and kw["one_m_dampening"] == f32(1 - 0.3)
    assert kw["momentum"] == f32(0.9) and kw["HAS_MOMENTUM"] is True and kw["NESTEROV"] is True
    assert kw["HAS_MASTERS"] is False and kw["HAS_FOUND_INF"] is False
    assert kw["found_inf"] is tab.table and kw["inv_scale"] is inv  # the table stands in for None
    assert kw["STEPWISE"] is True  # an argument of the op reaches the kernel that declares it
    bf16 = _sgd_args("fused_sgd_bf16_", lr=0.1, rounding="kahan", seed=1, rng_step=2)
    assert "STEPWISE" not in OpKernel(k).kwargs(bf16, tab)  # no such argument: the default


def test_kernel_parameters_nothing_supplies_are_refused():
    from mpnb.core.ops.triton._optim import OpKernel

    def typo(table, n_tensors, ROW, CHUNK, BLOCK, neg_lr, momentun):
        pass

    def no_table(neg_lr):
        pass

    def takes_rounding(table, n_tensors, ROW, CHUNK, BLOCK, rounding):
        pass

    args = _sgd_args("fused_sgd_", lr=0.1)
    with pytest.raises(TypeError, match="'momentun'"):
        OpKernel(typo).kwargs(args)
    with pytest.raises(TypeError, match=r"\['extra'\]"):
        OpKernel(typo).kwargs(args, momentun=1.0, extra=2)
    with pytest.raises(TypeError, match=r"\['neg_lr'\]"):  # one source per parameter
        OpKernel(typo).kwargs(args, momentun=1.0, neg_lr=0.5)
    with pytest.raises(TypeError, match=r"\['table', 'n_tensors'"):  # a chunk-table kernel
        OpKernel(no_table).kwargs(args)
    with pytest.raises(TypeError, match="'rounding'"):  # a str reaches a kernel as a value
        OpKernel(takes_rounding).kwargs(
            _sgd_args("fused_sgd_bf16_", lr=0.1, rounding="kahan", seed=1, rng_step=2)
        )
