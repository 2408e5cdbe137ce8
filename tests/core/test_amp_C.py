"""Apex's amp_C optimizer entry points, called the way Apex's optimizers call them
(``multi_tensor_applier(amp_C.multi_tensor_adam, noop_flag, [g, p, m, v], ...)``), checked
against torch.optim or mpnb's references; a set noop flag writes nothing."""

from __future__ import annotations

import ast
import functools
import inspect
from pathlib import Path

import pytest
import torch

from mpnb import amp_C
from mpnb.core import amp_C_reference, ops
from mpnb.core._amp_C_table import ROWS, op_params
from mpnb.core.ops import op_info
from mpnb.multi_tensor_apply import multi_tensor_applier

# The references in the schema's positional order (the references themselves take their
# hyper-parameters by keyword).
reference_fused_lamb_ = op_info("fused_lamb_").reference_kernel
reference_fused_novograd_ = op_info("fused_novograd_").reference_kernel

SIZES = [3, 64, 1000, 40000]


def _params(dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(n, generator=g).to(dtype)) for n in SIZES]


def _grads(params, step, scale=1.0):
    g = torch.Generator().manual_seed(100 + step)
    return [(torch.randn(p.shape, generator=g) * scale).to(p.dtype) for p in params]


def _noop():
    return torch.zeros(1, dtype=torch.int32)  # Apex's _dummy_overflow_buf


def _close(a, b, rtol=2e-6, atol=1e-7):
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x.detach().float(), y.detach().float(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("mode", [0, 1])
def test_adam_matches_torch(kernels, mode):
    ours, theirs = _params(), _params()
    cls = torch.optim.AdamW if mode == 1 else torch.optim.Adam
    topt = cls(theirs, lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.05, foreach=False)
    m = [torch.zeros_like(p) for p in ours]
    v = [torch.zeros_like(p) for p in ours]
    for step in range(1, 6):
        g = _grads(ours, step)
        for p, x in zip(theirs, g, strict=True):
            p.grad = x.clone()
        topt.step()
        with torch.no_grad():
            multi_tensor_applier(
                amp_C.multi_tensor_adam,
                _noop(),
                [g, ours, m, v],
                1e-2,
                0.9,
                0.99,
                1e-8,
                step,
                mode,
                1,
                0.05,
            )
    _close(ours, theirs)
    _close(m, [topt.state[p]["exp_avg"] for p in theirs])


def test_adam_half_state_without_masters(kernels):
    """Apex's FusedAdam on fp16 params keeps fp16 moments: computed in fp32, stored rounded."""
    p16, g16 = _params(torch.float16), None
    p32 = [p.detach().float() for p in p16]
    m16 = [torch.zeros_like(p) for p in p16]
    v16 = [torch.zeros_like(p) for p in p16]
    m32, v32 = [torch.zeros_like(p) for p in p32], [torch.zeros_like(p) for p in p32]
    g16 = _grads(p16, 1)
    with torch.no_grad():
        multi_tensor_applier(
            amp_C.multi_tensor_adam,
            _noop(),
            [g16, p16, m16, v16],
            1e-3,
            0.9,
            0.999,
            1e-8,
            1,
            1,
            1,
            0.0,
        )
        multi_tensor_applier(
            amp_C.multi_tensor_adam,
            _noop(),
            [g16, p32, m32, v32],
            1e-3,
            0.9,
            0.999,
            1e-8,
            1,
            1,
            1,
            0.0,
        )
    for a, b in zip(p16 + m16 + v16, p32 + m32 + v32, strict=True):
        assert a.dtype == torch.float16
        assert torch.equal(a.detach(), b.detach().half())


@pytest.mark.parametrize("nesterov", [False, True])
def test_sgd_three_lists_matches_torch(kernels, nesterov):
    ours, theirs = _params(), _params()
    topt = torch.optim.SGD(theirs, lr=0.05, momentum=0.9, weight_decay=1e-3, nesterov=nesterov)
    bufs = [torch.zeros_like(p) for p in ours]
    for step in range(1, 5):
        g = _grads(ours, step)
        for p, x in zip(theirs, g, strict=True):
            p.grad = x.clone()
        topt.step()
        with torch.no_grad():
            multi_tensor_applier(
                amp_C.multi_tensor_sgd,
                _noop(),
                [g, ours, bufs],
                1e-3,
                0.9,
                0.0,
                0.05,
                nesterov,
                step == 1,
                False,
                1.0,
            )
    _close(ours, theirs)


def test_sgd_four_lists_fp16_model_and_scale(kernels):
    """[fp16 grads, fp32 masters, fp32 momentum, fp16 model]: unscale, update, write the model."""
    model = _params(torch.float16)
    masters = [p.detach().float() for p in model]
    ref = [torch.nn.Parameter(m.clone()) for m in masters]
    topt = torch.optim.SGD(ref, lr=0.05, momentum=0.9)
    bufs = [torch.zeros_like(m) for m in masters]
    for step in range(1, 4):
        g = _grads(model, step, scale=128.0)
        for p, x in zip(ref, g, strict=True):
            p.grad = x.float() / 128.0
        topt.step()
        with torch.no_grad():
            multi_tensor_applier(
                amp_C.multi_tensor_sgd,
                _noop(),
                [g, masters, bufs, model],
                0.0,
                0.9,
                0.0,
                0.05,
                False,
                step == 1,
                False,
                1 / 128.0,
            )
    _close(masters, ref)
    assert all(torch.equal(p.detach(), m.half()) for p, m in zip(model, masters, strict=True))


@pytest.mark.parametrize("mode", [0, 1])
def test_lamb_matches_reference(kernels, mode):
    ours, ref = _params(), _params()
    st = {k: [torch.zeros_like(p) for p in ours] for k in ("m", "v", "rm", "rv")}
    steps = [torch.tensor(0.0) for _ in ref]
    for step in range(1, 4):
        g = _grads(ours, step)
        norm, _ = multi_tensor_applier(amp_C.multi_tensor_l2norm, _noop(), [g], False)
        with torch.no_grad():
            multi_tensor_applier(
                amp_C.multi_tensor_lamb,
                _noop(),
                [g, ours, st["m"], st["v"]],
                1e-2,
                0.9,
                0.999,
                1e-6,
                step,
                1,
                0.01,
                1,
                mode,
                norm,
                1.0,
                False,
            )
            reference_fused_lamb_(
                ref,
                g,
                st["rm"],
                st["rv"],
                [],
                steps,
                norm,
                1e-2,
                0.9,
                0.999,
                1e-6,
                0.01,
                mode == 1,
                True,
                True,
                1.0,
                False,
            )
    _close(ours, ref, rtol=1e-5, atol=1e-6)
    _close(st["m"] + st["v"], st["rm"] + st["rv"], rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("mode", [0, 1])
def test_novograd_matches_reference(kernels, mode):
    """Apex's FusedNovoGrad seeds exp_avg_sq with the first grad norms, then the kernel blends."""
    ours, ref = _params(), _params()
    m, rm = [torch.zeros_like(p) for p in ours], [torch.zeros_like(p) for p in ref]
    rv, steps = [torch.tensor(0.0) for _ in ref], [torch.tensor(0.0) for _ in ref]
    exp_avg_sq = None
    for step in range(1, 4):
        g = _grads(ours, step)
        norms = torch.stack([x.norm() for x in g])
        if exp_avg_sq is None:
            exp_avg_sq = norms.clone()
        with torch.no_grad():
            multi_tensor_applier(
                amp_C.multi_tensor_novograd,
                _noop(),
                [g, ours, m],
                exp_avg_sq,
                1e-2,
                0.95,
                0.98,
                1e-8,
                step,
                1,
                1e-3,
                1,
                mode,
                2,
            )
            reference_fused_novograd_(
                ref,
                g,
                rm,
                rv,
                [],
                steps,
                norms,
                1e-2,
                0.95,
                0.98,
                1e-8,
                1e-3,
                True,
                True,
                mode == 0,
                2,
                False,
            )
    _close(ours, ref, rtol=1e-5, atol=1e-6)
    _close(list(exp_avg_sq.unbind()), rv, rtol=1e-5, atol=1e-7)


def test_adagrad_matches_torch(kernels):
    ours, theirs = _params(), _params()
    topt = torch.optim.Adagrad(theirs, lr=1e-2, weight_decay=1e-2, eps=1e-10, fused=True)
    sums = [torch.zeros_like(p) for p in ours]
    for step in range(1, 5):
        g = _grads(ours, step)
        for p, x in zip(theirs, g, strict=True):
            p.grad = x.clone()
        topt.step()
        with torch.no_grad():
            multi_tensor_applier(
                amp_C.multi_tensor_adagrad, _noop(), [g, ours, sums], 1e-2, 1e-10, 0, 1e-2
            )
    _close(ours, theirs)
    _close(sums, [topt.state[p]["sum"] for p in theirs])


_CALLS = {
    "adam": lambda g, p, s, f: amp_C.multi_tensor_adam(
        65536, f, [g, p, s[0], s[1]], 1e-2, 0.9, 0.999, 1e-8, 3, 1, 1, 0.01
    ),
    "sgd": lambda g, p, s, f: amp_C.multi_tensor_sgd(
        65536, f, [g, p, s[0]], 0.0, 0.9, 0.0, 0.1, False, False, False, 1.0
    ),
    "lamb": lambda g, p, s, f: amp_C.multi_tensor_lamb(
        65536,
        f,
        [g, p, s[0], s[1]],
        1e-2,
        0.9,
        0.999,
        1e-6,
        3,
        1,
        0.01,
        1,
        1,
        torch.tensor([1.0]),
        1.0,
    ),
    "novograd": lambda g, p, s, f: amp_C.multi_tensor_novograd(
        65536, f, [g, p, s[0]], s[2], 1e-2, 0.9, 0.999, 1e-8, 3, 1, 0.0, 1, 1, 2
    ),
    "adagrad": lambda g, p, s, f: amp_C.multi_tensor_adagrad(
        65536, f, [g, p, s[0]], 1e-2, 1e-10, 0, 0.0
    ),
}


@pytest.mark.parametrize("name", list(_CALLS))
def test_set_noop_flag_writes_nothing(kernels, name):
    p = [t.detach() for t in _params()]
    g = _grads(p, 1)
    s = [[torch.rand(n) for n in SIZES], [torch.rand(n) for n in SIZES], torch.rand(len(SIZES))]
    before = [t.clone() for t in (*p, *s[0], *s[1], s[2])]
    flag = torch.ones(1, dtype=torch.int32)
    _CALLS[name](g, p, s, flag)
    after = (*p, *s[0], *s[1], s[2])
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))
    flag.zero_()
    _CALLS[name](g, p, s, flag)
    assert not torch.equal(before[3], p[3])  # a clear flag: the step happens


# ---- derived from the table: one row per Apex function ----------------------------------


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_each_shim_has_its_rows_signature_and_op(row):
    """The shim (and its reference, where there is one) takes Apex's positional arguments in
    the row's order, and the op the row maps onto is an mpnb op."""
    want = ["chunk_size", "noop_flag", "tensor_lists", *row.param_names]
    fns = [getattr(amp_C, row.name)]
    fns += [f for f in [getattr(amp_C_reference, f"reference_{row.name}", None)] if f]
    for fn in fns:
        params = inspect.signature(fn).parameters.values()
        assert [p.name for p in params] == want
        assert all(p.kind is p.POSITIONAL_OR_KEYWORD for p in params)
        assert fn.__doc__
    assert row.op is None or op_info(row.op).name == row.op


@pytest.mark.parametrize("row", list(ROWS.values()), ids=list(ROWS))
def test_a_wrong_number_of_tensor_lists_names_the_layout(row):
    fn = getattr(amp_C, row.name)
    for n in (len(row.lists) - row.optional - 1, len(row.lists) + 1):
        if n < 0:
            continue
        with pytest.raises(ValueError, match="tensor lists"):
            fn(2048, _noop(), [[]] * n, *[None] * len(row.param_names))


@pytest.mark.parametrize("row", [r for r in ROWS.values() if r.op], ids=lambda r: r.name)
def test_each_rows_renames_name_an_op_argument_and_an_apex_argument(row):
    """A rename (``weight_decay=wd``, ``reg_inside_moment=mode==0``) reads an argument Apex's
    call has into one the op takes: a typo in the table fails here, not in a parity test."""
    op_args = [n for n, _ in op_params(getattr(ops, row.op))]
    for op_arg, apex in row.renames.items():
        assert op_arg in op_args, (row.name, op_arg)
        assert apex.partition("==")[0] in row.param_names, (row.name, apex)
    assert set(row.flags) <= {"host_skip", "capturable"}, row.flags


def test_the_shims_call_the_ops_by_keyword(monkeypatch):
    """Every op a shim calls gets its arguments by name (``op(lr=...)``), never by position:
    inserting a parameter into an op cannot shift Apex's arguments."""
    calls = []

    def spy(name):
        op = getattr(ops, name)

        @functools.wraps(op)
        def keyword_only(*args, **kwargs):
            calls.append((name, len(args)))
            return op(**kwargs)

        return keyword_only

    for name in {r.op for r in ROWS.values() if r.op}:
        monkeypatch.setattr(ops, name, spy(name))
    p = [t.detach() for t in _params()]
    s = [[torch.zeros(n) for n in SIZES], [torch.zeros(n) for n in SIZES], torch.ones(len(SIZES))]
    for call in _CALLS.values():
        call(_grads(p, 1), p, s, _noop())
    amp_C.multi_tensor_scale(2048, _noop(), [p, [torch.empty_like(t) for t in p]], 0.5)
    amp_C.multi_tensor_l2norm_scale(2048, _noop(), [p, [torch.empty_like(t) for t in p]], 2.0)
    amp_C.multi_tensor_unscale_l2norm(2048, _noop(), [p], 0.5, True)
    assert {name for name, _ in calls} >= {r.op for r in ROWS.values() if r.op} - {
        "multi_tensor_axpby",
        "multi_tensor_check_finite",
    }
    assert [c for c in calls if c[1]] == []


def test_no_module_of_the_shim_layer_imports_amp_C():
    """The table and the references sit below the shims: nothing imports ``mpnb.core.amp_C``
    back (no import circle)."""
    layer = list(Path(amp_C_reference.__file__).parent.glob("*amp_C*.py"))
    assert len(layer) >= 3  # amp_C, the table, the references
    for path in layer:
        if path.name == "amp_C.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
                assert not any(n.startswith("mpnb.core.amp_C.") for n in names), path.name
                assert node.module != "mpnb.core.amp_C", path.name
