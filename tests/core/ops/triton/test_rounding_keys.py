"""The pure-bf16 steps' random-bit keys on the device (``mpnb/core/ops/triton/_rounding.py``):
bitwise the host's ``tensor_key``, passed as words Triton does not specialise on, and no
column of the chunk table, which the optimizers then reuse while ``rng_step`` advances."""

from __future__ import annotations

import importlib

import pytest
import torch

from .triton_cases import kernel

triton = pytest.importorskip("triton")  # the folder's fixture says why, where it is missing
tl = triton.language

BF16 = torch.bfloat16
#: seeds and steps at the edges of their 64-bit range (the op's ints are int64, taken mod 2^64)
SEEDS_STEPS = [(0, 0), (1, 1), (1234, 7), (-1, 2**63 - 1), (2**63 - 1, -(2**63)), (7, 2**40 + 3)]


@pytest.fixture
def rounding():
    return importlib.import_module("mpnb.core.ops.triton._rounding")


def _keys(out, rng_hi, rng_lo, N: tl.constexpr, ROUNDING: tl.constexpr):
    """Writes ``key_of(t)`` for ``t`` in ``[0, N)`` (decorated by the test: interpreted on a
    CPU, as this folder's kernels are; ``key_of`` the package's, bound by the test)."""
    t = tl.arange(0, N).to(tl.int64)
    tl.store(out + t, key_of(t, rng_hi, rng_lo, ROUNDING).to(tl.int64))  # noqa: F821


@pytest.mark.parametrize("seed, step", SEEDS_STEPS)
def test_device_keys_are_tensor_key_bitwise(rounding, device, monkeypatch, seed, step):
    from mpnb.core.ops._rounding import tensor_key

    monkeypatch.setitem(globals(), "key_of", rounding.key_of)
    keys = triton.jit(do_not_specialize=rounding.RNG_WORDS)(_keys)
    n = 128
    out = torch.zeros(n, dtype=torch.int64, device=device)
    keys[(1,)](out, **rounding.rng_words(seed, step), N=n, ROUNDING=rounding.STOCHASTIC.value)
    assert out.cpu().tolist() == [tensor_key(seed, step, t) for t in range(n)]


def _not_specialised(jit) -> set[str]:
    """The parameters kernel ``jit`` is not specialised on (an interpreted kernel keeps its
    decorator's options in ``kwargs``)."""
    names = getattr(jit, "do_not_specialize", None) or jit.kwargs.get("do_not_specialize")
    return set(names or ())


def test_rng_words_are_one_int32_type_for_every_step(rounding):
    """Every step's words are ``i32`` to Triton (a word of 2^31 or more would be ``i64``, a
    second compile); they are not specialised on (1, divisible by 16) in any optimizer kernel."""
    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl

    seen = set()
    for seed, step in SEEDS_STEPS + [(s, k) for s in range(4) for k in range(64)]:
        for word in rounding.rng_words(seed, step).values():
            seen.add(native_specialize_impl(BaseBackend, word, False, False, True))
    assert seen == {("i32", None)}
    for module, name in [
        ("adam", "_adam_kernel"),
        ("sgd", "_sgd_kernel"),
        ("lamb", "_lamb_phase2"),
    ]:
        jit = getattr(importlib.import_module(f"mpnb.core.ops.triton.{module}"), name)
        assert set(rounding.RNG_WORDS) <= _not_specialised(jit), name


def _lists(n=4, numel=20):
    p = [torch.randn(numel).to(BF16) for _ in range(n)]
    g = [torch.randn(numel) for _ in range(n)]
    m = [torch.zeros(numel) for _ in range(n)]
    v = [torch.zeros(numel) for _ in range(n)]
    s = [torch.zeros(1) for _ in range(n)]
    return p, g, m, v, s


def _adam(lists, rng_step):
    p, g, m, v, s = lists
    hyper = [1e-3, 0.9, 0.999, 1e-8, 0.01, True, True]
    kernel("fused_adam_bf16_")(p, g, m, v, [], s, *hyper, "stochastic", 3, rng_step)


def _sgd(lists, rng_step):
    p, g, m, _, _ = lists
    flags = [False] * len(p)
    hyper = [0.1, 0.9, 0.0, 0.01, False, False]
    kernel("fused_sgd_bf16_")(p, g, m, [], flags, *hyper, "stochastic", 3, rng_step)


def _lamb(lists, rng_step):
    p, g, m, v, s = lists
    hyper = [1e-3, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False]
    norm = torch.ones(1)
    kernel("fused_lamb_bf16_")(p, g, m, v, [], s, norm, *hyper, "stochastic", 3, rng_step)


@pytest.mark.parametrize("step", [_adam, _sgd, _lamb], ids=["adam", "sgd", "lamb"])
def test_steps_at_different_rng_steps_reuse_one_chunk_table(device, monkeypatch, step):
    """A training loop advances ``rng_step`` every step: the table is built on the first step
    only (the keys are computed on the device, so no column of it changes)."""
    from mpnb.core.ops.triton._chunks import ChunkTable
    from mpnb.core.ops.triton._common import counting_launches

    built = []
    make = ChunkTable._make
    monkeypatch.setattr(
        ChunkTable, "_make", classmethod(lambda cls, *a: built.append(1) or make(*a))
    )
    lists = _lists()
    with counting_launches():
        for rng_step in (5, 6, 7):
            step(lists, rng_step)
    assert built == [1]
