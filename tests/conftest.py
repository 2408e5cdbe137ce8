"""Shared test configuration: GPU cases skip cleanly without CUDA; kernel fixtures fail loudly.

``op_impl`` runs a test twice: on the C++ kernels and on the pure-PyTorch references (the
references are switched in through the dispatcher by ``mpnb.core.ops.use_reference``, inside
the test's process). With ``MPNB_DISABLE_EXT=1`` the kernels are never built and both
parameters run the references.
"""

from __future__ import annotations

import os
import signal

import pytest
import torch


def _import_triton() -> str | None:
    """Import triton (interpreted when there is no GPU); the reason it cannot be, or None."""
    before = os.environ.get("TRITON_INTERPRET")
    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import numpy  # noqa: F401
        import triton
        import triton.language  # noqa: F401
    except ImportError as e:
        return (
            f"triton or numpy cannot be imported ({e}); triton ships wheels for Linux only: "
            "pip install triton numpy (both are in the dev extra)"
        )
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before
    return None


# Imported before any test module is collected, so that whatever a test file imports at
# collection (torch._dynamo, torchao, triton itself) finds triton interpreted on a CPU; the
# Triton kernels' tests (their fixtures: tests/core/ops/triton/conftest.py) may then
# sit anywhere in the tree.
TRITON_MISSING = _import_triton()


def pytest_configure(config):
    # A shell starts a background job with SIGINT ignored, and an ignored signal stays ignored
    # across fork and exec: run that way, the tests of Ctrl-C (sent to this process, to launch's
    # caller or to an `mpnb compare` child) would see nothing happen. Python's own handler is
    # reset to the default action by exec, so children get Ctrl-C as from a terminal.
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def kernels_expected() -> bool:
    """True unless MPNB_DISABLE_EXT=1; when True the kernels MUST load (a failed build fails)."""
    return os.environ.get("MPNB_DISABLE_EXT", "0") in ("", "0")


@pytest.fixture(scope="session")
def kernels() -> bool:
    """Build/load the CPU kernels once; fail (never skip) if they were expected and did not load."""
    from mpnb.core.ops import cpu_extension, ensure_kernels

    ready = ensure_kernels()
    if kernels_expected():
        status = cpu_extension().status()
        assert ready, f"the CPU kernels failed to build/load: {status.reason if status else '?'}"
    return ready


@pytest.fixture(params=["kernel", "reference"])
def op_impl(request, kernels):
    """Run the test on the C++ kernels, then on the references (switched in the dispatcher)."""
    if request.param == "kernel":
        yield "kernel"
        return
    from mpnb.core.ops import use_reference

    with use_reference():
        yield "reference"


@pytest.fixture
def devices():
    """CPU always; CUDA when present."""
    return ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
