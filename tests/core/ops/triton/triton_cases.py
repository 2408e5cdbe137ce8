"""Inputs and comparisons shared by the Triton interpreter tests (imported by name)."""

from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch

HALF = (torch.float16, torch.bfloat16)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
#: sizes crossing the block (1024) and chunk (8192) boundaries, with an empty tensor
SIZES = (0, 1, 7, 1025, 8193)


def kernel(name: str):
    """The Triton launcher of op ``name`` (the interpreted one, during these tests)."""
    from mpnb.core.ops.triton import launcher

    return launcher(name)


def reference(name: str):
    """The reference of op ``name`` in the schema's positional order, behind its check (the
    reference itself takes its hyper-parameters by keyword)."""
    from mpnb.core.ops import op_info

    return op_info(name).reference_kernel


def gen(seed: int) -> torch.Generator:
    """A seeded CPU generator."""
    return torch.Generator().manual_seed(seed)


def randn(shape, dtype, g: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    """``randn * scale`` drawn in fp32, then cast."""
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def poison(ts, g: torch.Generator, count: int = 3) -> list[tuple[int, int]]:
    """Put inf, -inf and NaN at ``count`` random positions of the non-empty tensors of ``ts``;
    returns the ``(tensor, element)`` positions."""
    live = [i for i, t in enumerate(ts) if t.numel()]
    values = (float("inf"), float("nan"), float("-inf"))
    where = []
    for k in range(count):
        i = live[int(torch.randint(len(live), (1,), generator=g))]
        j = int(torch.randint(ts[i].numel(), (1,), generator=g))
        ts[i].view(-1)[j] = values[k % 3]
        where.append((i, j))
    return where


def clone(x):
    """A deep copy of a tensor or nested lists of tensors."""
    if isinstance(x, torch.Tensor):
        return x.clone()
    return [clone(t) for t in x]


def on(device: str, x):
    """``x`` (a tensor or nested lists of tensors) copied to ``device``."""
    if isinstance(x, torch.Tensor):
        return x.to(device, copy=True)
    return [on(device, t) for t in x]


def close(actual, expected, ulps: float = 2.0) -> None:
    """Equal to ``ulps`` units of the dtype's precision (relative, and absolute at the
    tensor's scale), with inf/NaN at the same positions."""
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            close(a, e, ulps)
        return
    actual = actual.cpu()
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    eps = torch.finfo(expected.dtype).eps
    finite = expected[torch.isfinite(expected)]
    scale = float(finite.abs().max()) if finite.numel() else 1.0
    torch.testing.assert_close(
        actual, expected, rtol=ulps * eps, atol=ulps * eps * max(scale, 1e-30), equal_nan=True
    )


def bitwise(actual, expected) -> None:
    """Identical values (NaN where NaN), dtypes and shapes."""
    if isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected, strict=True):
            bitwise(a, e)
        return
    torch.testing.assert_close(actual.cpu(), expected, rtol=0, atol=0, equal_nan=True)


# On CUDA the measured Triton kernels are already Python registrations (mpnb/core/ops/_library.py).
# PyTorch 2.11 refuses to override a Python registration from Python unless allow_override=True
# (2.13 allows it by default); on the CPU the kernels are C++ ones, which need no keyword.
OVERRIDE = (
    {"allow_override": True}
    if "allow_override" in inspect.signature(torch.library.Library.impl).parameters
    else {}
)


@contextlib.contextmanager
def triton_as_kernels(device: str):
    """Every Triton launcher registered as its op's kernel for ``device`` while the block runs
    (the kernels before, again after it); yields the set of the launchers called."""
    from mpnb.core.ops import ensure_kernels, op_info
    from mpnb.core.ops.triton import LAUNCHERS

    ensure_kernels()  # the C++ kernels first, so that these registrations override them
    if device == "cuda" and not OVERRIDE:
        pytest.skip("this PyTorch cannot override mpnb's Python-registered CUDA kernels")
    called: set[str] = set()
    lib = torch.library.Library("mpnb", "IMPL")

    def spy(name):
        launch = op_info(name).triton_kernel()

        def kernel(*args, **kwargs):
            called.add(name)
            return launch(*args, **kwargs)

        return kernel

    try:
        with warnings.catch_warnings():  # PyTorch warns, once, that a kernel is overridden
            warnings.filterwarnings("ignore", "(?s).*Overriding a previously registered kernel")
            for name in LAUNCHERS:
                lib.impl(name, spy(name), "CUDA" if device == "cuda" else "CPU", **OVERRIDE)
        yield called
    finally:
        lib._destroy()
