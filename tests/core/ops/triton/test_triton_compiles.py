"""Every Triton kernel compiles for an H100 (sm_90) down to a cubin, on this GPU-less machine.

The interpreter tests check what the kernels compute; this checks that the compiler accepts
them (it refuses Python the interpreter runs). ``triton_aot.py`` runs once, in a process of its
own, without ``TRITON_INTERPRET``, with a fresh Triton cache so that everything really compiles;
its ``--memory`` counts show that each list kernel's aligned span (``_vector.py``) compiles to
16-byte loads and stores, and that a kernel serving an op and its pure-bf16 twin compiled under
each of its ``ROUNDING`` values.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
ROOT = HERE.parents[3]


#: list kernel -> whether it writes (its PTX must then hold vector stores too)
LIST_KERNELS = {
    "_scale_kernel": True,
    "_sumsq_kernel": False,
    "_check_finite_kernel": False,
    "_adam_kernel": True,
    "_sgd_kernel": True,
    "_lamb_phase1": True,
    "_lamb_phase2": True,
}


@pytest.fixture(scope="module")
def aot_sm90(tmp_path_factory) -> str:
    """The output of ``triton_aot.py 90 --memory`` (it failed the test if a kernel did not
    compile)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path_factory.mktemp("triton_cache"))
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(HERE / "triton_aot.py"), "90", "--memory"],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    return run.stdout


def test_kernels_compile_for_sm90(aot_sm90):
    compiled = {line.split()[1] for line in aot_sm90.splitlines() if line.startswith("sm_90 ")}
    expected = {
        "_scale_kernel",
        "_sumsq_kernel",
        "segment_sum_kernel",
        "_finish_kernel",
        "_adam_kernel",
        "_advance_kernel",
        "_sgd_kernel",
        "_lamb_phase1",
        "_lamb_phase2",
        "_fwd_fused",
        "_fwd_looped",
        "_bwd_fused",
        "_bwd_looped",
        "_colsum_kernel",
        "_rope_kernel",
        "_check_finite_kernel",
    }
    assert expected <= compiled, sorted(expected - compiled)


@pytest.mark.parametrize("name", list(LIST_KERNELS))
def test_list_kernels_use_vector_accesses_on_sm90(aot_sm90, name):
    counts = [
        ast.literal_eval(line.split(" ", 2)[2])
        for line in aot_sm90.splitlines()
        if line.startswith(f"memory {name} ")
    ]
    assert counts, f"{name} was not compiled"
    for ops in counts:  # every specialization compiled, each with its own counts
        assert ops["ld.v"] > 0, (name, ops)
        if LIST_KERNELS[name]:
            assert ops["st.v"] > 0, (name, ops)


def _flags(aot: str, name: str) -> list[dict]:
    """The constexpr flags of each specialization of kernel ``name`` that ``aot`` compiled."""
    return [
        ast.literal_eval(line[line.index("{") :])
        for line in aot.splitlines()
        if line.startswith("sm_90 ") and line.split()[1] == name
    ]


@pytest.mark.parametrize("name", ["_adam_kernel", "_sgd_kernel", "_lamb_phase2"])
def test_folded_kernels_compile_every_rounding_on_sm90(aot_sm90, name):
    """One kernel serves ``fused_<opt>_`` (no ``ROUNDING``: round to nearest) and
    ``fused_<opt>_bf16_`` (``ROUNDING`` 1, stochastic, and 2, Kahan). LAMB's phase 1 writes no
    weight, so it has no ``ROUNDING``: one compile serves both LAMB ops."""
    roundings = {flags.get("ROUNDING", 0) for flags in _flags(aot_sm90, name)}
    assert roundings == {0, 1, 2}, roundings
