"""How the LAMB launchers (``mpnb/core/ops/triton/lamb.py``) call their kernels: both ops
through the same two kernels, launched by keyword from the op's arguments
(:class:`~mpnb.core.ops.triton._optim.OpKernel`); and a repeated pure-bf16 step does on the
host what a repeated ``fused_lamb_`` step does."""

from __future__ import annotations

import collections
import importlib
import inspect

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from .triton_cases import kernel

BF16 = torch.bfloat16
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01)
FLAGS = dict(adam_w_mode=False, bias_correction=True, grad_averaging=True, max_grad_norm=1.0)
#: what the launcher gives each phase beside the op's arguments and the chunk table
CARRIERS = dict(p0=0, m0=0, w0=0, s0=0)
PHASE1 = dict(partials=0, g0=0, beta3=0.1, **CARRIERS)
PHASE2 = dict(sq=0, **CARRIERS)


@pytest.fixture
def lamb():
    return importlib.import_module("mpnb.core.ops.triton.lamb")


def _lists(device, n=3, numel=20):
    p = [torch.randn(numel, device=device).to(BF16) for _ in range(n)]
    g = [torch.randn(numel, device=device) for _ in range(n)]
    m = [torch.zeros(numel, device=device) for _ in range(n)]
    v = [torch.zeros(numel, device=device) for _ in range(n)]
    s = [torch.zeros(1, device=device) for _ in range(n)]
    c = [torch.zeros_like(t) for t in p]  # Kahan's compensations
    return p, g, m, v, s, c, torch.tensor([3.0], device=device)


def _call(name, device, lists, rounding="stochastic", rng_step=5):
    p, g, m, v, s, c, norm = lists
    hyper = [*HYPER.values(), *FLAGS.values(), False]  # use_nvlamb
    if name == "fused_lamb_":  # no rng_step
        kernel(name)(p, g, m, v, [], s, norm, *hyper, None, None)
    else:
        comps = c if rounding == "kahan" else []
        kernel(name)(p, g, m, v, comps, s, norm, *hyper, rounding, 7, rng_step, None, None)


class _Recorder:
    def __init__(self):
        self.calls = []

    def __call__(self, kernel, grid, *args, **kwargs):
        self.calls.append((getattr(kernel, "fn", kernel).__name__, args, kwargs))

    def kw(self, kernel, grid, args, kwargs):  # launch_kw's form (OpKernel's launches)
        self(kernel, grid, *args, **kwargs)


@pytest.mark.parametrize("name", ["fused_lamb_", "fused_lamb_bf16_"])
def test_lamb_launches_each_kernel_by_name(lamb, device, monkeypatch, name):
    """Both ops launch the same two kernels through OpKernel, every argument by keyword, and
    each scalar parameter named after an op argument holds it as a GPU kernel receives it."""
    from mpnb.core.ops.triton import _optim
    from mpnb.core.ops.triton._common import f32, split64
    from mpnb.core.ops.triton._rounding import rng_words

    rec = _Recorder()
    monkeypatch.setattr(_optim, "launch", rec)
    monkeypatch.setattr(_optim, "launch_kw", rec.kw)
    lists = _lists(device)
    _call(name, device, lists, rounding="stochastic")
    assert [c[0] for c in rec.calls] == ["_lamb_phase1", "_lamb_phase2", "_advance_kernel"]
    for _, args, kwargs in rec.calls[:2]:
        assert args == () and kwargs["num_warps"] == 8
        for arg in ("lr", "beta1", "beta2", "eps", "weight_decay", "max_grad_norm"):
            if arg in kwargs:
                assert kwargs[arg] == f32(HYPER.get(arg, FLAGS.get(arg)))
        for arg in ("beta1", "beta2"):
            assert (kwargs[f"{arg}_hi"], kwargs[f"{arg}_lo"]) == split64(HYPER[arg])
        assert kwargs["ADAM_W_MODE"] is False and kwargs["BIAS_CORRECTION"] is True
        assert kwargs["HAS_WEIGHT_DECAY"] is True and kwargs["HAS_FOUND_INF"] is False
        assert kwargs.get("HAS_MASTERS", False) is False
    phase1, phase2 = rec.calls[0][2], rec.calls[1][2]
    assert "ROUNDING" not in phase1  # phase 1 writes no weight: one kernel for both ops
    if name == "fused_lamb_":
        assert {"ROUNDING", "rng_hi", "rng_lo"}.isdisjoint(phase2)  # the kernel's defaults
    else:  # the random-bit base of (seed 7, rng_step 5), the keys computed on the device
        assert phase2["ROUNDING"] == 1
        assert {k: phase2[k] for k in ("rng_hi", "rng_lo")} == rng_words(7, 5)
    assert phase2["USE_NVLAMB"] is False and phase1["HAS_INV_SCALE"] is False
    assert (phase1["max_grad_norm_hi"], phase1["max_grad_norm_lo"]) == split64(1.0)
    assert phase1["one_m_beta2"] == f32(1.0 - HYPER["beta2"])
    assert phase1["global_grad_norm"] is lists[-1]  # a tensor argument reaches it as itself


def _args(name, **changes):
    from mpnb.core.ops import op_info

    p, g, m, v, s, c, _ = _lists("cpu", n=1, numel=4)
    values = dict(params=p, grads=g, exp_avgs=m, exp_avg_sqs=v, steps=s)
    values |= dict(global_grad_norm=torch.ones(1), **HYPER, **FLAGS)
    if name == "fused_lamb_":
        values["masters"] = [t.float() for t in p]
    else:
        values |= dict(compensations=c, use_nvlamb=True, rounding="kahan", seed=1, rng_step=2)
    return op_info(name).Args(**(values | changes))


@pytest.mark.parametrize("name", ["fused_lamb_", "fused_lamb_bf16_"])
def test_every_lamb_kernel_parameter_comes_from_the_op_or_the_launcher(lamb, name):
    """OpKernel's rules serve every parameter of both phases for both ops: the op's
    arguments by name (capitals for a bool, ``HAS_X``, ``X_hi``/``X_lo``, ``one_m_X``), the
    launcher's keywords for the rest, the kernels' defaults for what the op lacks."""
    from mpnb.core.ops.triton._common import f32, split64

    inv, found = torch.full((1,), 0.5), torch.zeros(1, dtype=torch.bool)
    args = _args(name, inv_scale=inv, found_inf=found, weight_decay=0.0, adam_w_mode=True)
    kw1 = lamb._PHASE1.kwargs(args, **PHASE1)
    kw2 = lamb._PHASE2.kwargs(args, **PHASE2)
    assert kw1["inv_scale"] is inv and kw1["HAS_INV_SCALE"] is True
    assert kw1["found_inf"].dtype == torch.uint8 and kw2["HAS_FOUND_INF"] is True
    assert kw1["HAS_WEIGHT_DECAY"] is False and kw2["ADAM_W_MODE"] is True
    assert (kw1["max_grad_norm"], kw2["lr"]) == (f32(1.0), f32(HYPER["lr"]))
    assert (kw2["beta2_hi"], kw2["beta2_lo"]) == split64(HYPER["beta2"])
    assert kw2["USE_NVLAMB"] is (name == "fused_lamb_bf16_")
    # fused_lamb_ names its masters; fused_lamb_bf16_ has none and leaves the default
    assert kw1.get("HAS_MASTERS") is (True if name == "fused_lamb_" else None)
    # the pure-bf16 op's ROUNDING and random-bit words come from its launcher
    expected = set(inspect.signature(lamb._lamb_phase2.fn).parameters)
    expected -= {"ROUNDING", "rng_hi", "rng_lo"}
    expected -= {"HAS_MASTERS"} if name == "fused_lamb_bf16_" else set()
    assert set(kw2) == expected  # nothing left over, nothing missing


def test_lamb_launch_keywords_have_one_source(lamb):
    """A launcher keyword that the op's arguments supply, one that the kernel lacks, or a
    missing one is refused when the launch is planned, naming the parameter."""
    args = _args("fused_lamb_")
    with pytest.raises(TypeError, match=r"\['lr'\]"):
        lamb._PHASE2.kwargs(args, lr=1.0, **PHASE2)
    with pytest.raises(TypeError, match=r"\['bogus'\]"):
        lamb._PHASE2.kwargs(args, bogus=1, **PHASE2)
    with pytest.raises(TypeError, match="'sq'"):
        lamb._PHASE2.kwargs(args, **{k: v for k, v in PHASE2.items() if k != "sq"})


def _grown(kernel, **params):
    """A stand-in for ``kernel`` whose signature has ``params`` (with their defaults) too."""
    sig = inspect.signature(kernel.fn)
    extra = [
        inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=d)
        for n, d in params.items()
    ]

    def grown(*args, **kwargs):
        """The stand-in (never run: its launch keywords are inspected)."""

    grown.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])
    return grown


def test_an_argument_added_to_the_op_reaches_the_lamb_kernel_that_names_it(lamb, monkeypatch):
    """What adding ``maximize`` (or a float) to the op and to the kernel would take at the
    launch site: nothing (the kernel names it, the op's ``args`` holds it); the twin op without
    it leaves the kernel's default."""
    from mpnb.core.ops.triton import _optim
    from mpnb.core.ops.triton._common import f32, split64
    from mpnb.core.ops.triton._optim import OpKernel

    kinds = _optim._kinds  # the op's schema, grown by the two arguments
    grown_kinds = dict(maximize="BoolType", clip_to="FloatType")
    monkeypatch.setattr(
        _optim, "_kinds", lambda op: kinds(op) | (grown_kinds if op == "fused_lamb_" else {})
    )
    grown = OpKernel(_grown(lamb._lamb_phase2, MAXIMIZE=False, clip_to=0.0, clip_to_hi=0.0))
    op_args = _args("fused_lamb_")
    Args = collections.namedtuple("Args", [*op_args._fields, "maximize", "clip_to"])
    Args.op_name = "fused_lamb_"
    args = Args(*op_args, maximize=True, clip_to=0.1)
    before = lamb._PHASE2.kwargs(op_args, **PHASE2)
    after = grown.kwargs(args, **PHASE2)
    added = dict(MAXIMIZE=True, clip_to=f32(0.1), clip_to_hi=split64(0.1)[0])
    assert after == before | added
    twin = _args("fused_lamb_bf16_")  # the pure-bf16 op, without the two arguments
    assert grown.kwargs(twin, **PHASE2) == lamb._PHASE2.kwargs(twin, **PHASE2)


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _host_ops(name, device, **call):
    """The torch ops of a repeated call (same lists, so its chunk table is cached) at the next
    ``rng_step``, no kernel run.

    Both calls run under a dispatch mode: the one that records the ops sends the lists' checks
    to Python (:func:`~mpnb.core.ops.triton._checks.list_facts`), whose table key is the
    tensors' sizes and addresses; a first call outside any mode keys its table by the C++
    pass's ids (once the C++ library is loaded), which the recorded call would miss.
    """
    from mpnb.core.ops.triton._common import counting_launches

    lists = _lists(device)
    with counting_launches():
        with _Ops():
            _call(name, device, lists, rng_step=5, **call)
        with _Ops() as seen:
            _call(name, device, lists, rng_step=6, **call)
    return sorted(seen.ops)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_repeated_bf16_step_does_the_host_work_of_fused_lamb_(device, kernels, rounding):
    """The random-bit keys are computed on the device (as fused_adam_bf16_'s), so the next
    step, at the next ``rng_step``, allocates and copies nothing that ``fused_lamb_`` does
    not: the partials and the per-tensor sums alone (with the C++ library loaded, as after
    any op call through the dispatcher)."""
    base = _host_ops("fused_lamb_", device)
    assert base == ["aten.empty.memory_format"] * 2
    assert _host_ops("fused_lamb_bf16_", device, rounding=rounding) == base


@pytest.mark.parametrize("name", ["fused_lamb_", "fused_lamb_bf16_"])
def test_a_repeated_step_builds_no_table(device, kernels, monkeypatch, name):
    """Outside any dispatch mode (the lists' ids from the C++ pass, when loaded) a repeated
    step takes its chunk table from the cache: no table is built."""
    from mpnb.core.ops.triton._chunks import ChunkTable
    from mpnb.core.ops.triton._common import counting_launches

    built = []
    make = ChunkTable._make
    monkeypatch.setattr(
        ChunkTable, "_make", classmethod(lambda cls, *a: built.append(1) or make(*a))
    )
    lists = _lists(device)
    with counting_launches():
        _call(name, device, lists, rounding="kahan")
        assert built == [1]
        _call(name, device, lists, rounding="kahan")
    assert built == [1]
