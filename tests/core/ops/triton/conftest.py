"""The Triton kernels against their references: on the CPU through Triton's interpreter, or on
a GPU when there is one.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, numpy), which
triton reads when a function is decorated with ``@triton.jit``: its own ``triton.language``
helpers at ``import triton``, our kernels when their modules are imported. So the root
``tests/conftest.py`` imports triton with the variable set, before any test module is collected
(whatever a test file imports at collection, torch._dynamo or torchao, then finds triton
interpreted), and restores the variable at once: processes started by other tests never
inherit it. The ``triton_kernels`` fixture then imports our kernel modules
afresh with the variable set, for this folder's tests only, and puts back afterwards the
modules and the variable as they were. Interpreted ``triton.language`` helpers stay for the rest
of the process; on a CPU that changes nothing else (no other CPU code runs Triton).

With CUDA nothing is interpreted: the same tests run the compiled kernels on the GPU.

Without an importable triton (non-Linux, or not installed) every test here is skipped with
the reason.
"""

from __future__ import annotations

import importlib
import os
import sys

import pytest
import torch

from tests.conftest import TRITON_MISSING as _MISSING  # imported first, see there

_PACKAGE = "mpnb.core.ops.triton"
_CUDA = torch.cuda.is_available()


def _interpreted() -> bool:
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(standard.zeros, InterpretedFunction)


@pytest.fixture(scope="package", autouse=True)
def triton_kernels():
    """The kernel package, its modules imported for this folder (interpreted on a CPU)."""
    if _MISSING:
        pytest.skip(_MISSING)
    if not _CUDA and not _interpreted():
        pytest.fail(
            "triton was imported before tests/core/ops/triton/conftest.py could set "
            "TRITON_INTERPRET=1 (something imported torch._dynamo or triton at collection), so "
            "its kernels cannot run on the CPU in this process; run this folder in its own "
            "process: pytest tests/core/ops/triton"
        )
    before = os.environ.get("TRITON_INTERPRET")
    kept = {k: m for k, m in sys.modules.items() if k.startswith(_PACKAGE + ".")}
    for k in kept:
        del sys.modules[k]
    if not _CUDA:
        os.environ["TRITON_INTERPRET"] = "1"
    package = importlib.import_module(_PACKAGE)
    try:
        for name in package.LAUNCHERS:
            package.launcher(name)  # decorate every kernel now (interpreted on a CPU)
        yield package
    finally:
        for k in [k for k in sys.modules if k.startswith(_PACKAGE + ".")]:
            del sys.modules[k]
            if k.rpartition(".")[2] in vars(package):
                delattr(package, k.rpartition(".")[2])
        sys.modules.update(kept)
        for k, module in kept.items():
            setattr(package, k.rpartition(".")[2], module)
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@pytest.fixture(autouse=True)
def _quiet_interpreter():
    """The interpreter evaluates masked-off lanes too (0/0 in padding): numpy's warnings about
    them are noise, silenced for this folder's tests only."""
    import numpy

    with numpy.errstate(all="ignore"):
        yield


@pytest.fixture(scope="package")
def device() -> str:
    """Where the kernels run: ``"cuda"`` (compiled) when there is a GPU, else ``"cpu"``."""
    return "cuda" if _CUDA else "cpu"


@pytest.fixture(scope="package")
def ulps() -> float:
    """Units in the last place allowed against the CPU references: a GPU contracts
    multiply-adds into FMAs and its ``exp`` is approximate; the interpreter does neither."""
    return 4.0 if _CUDA else 2.0
