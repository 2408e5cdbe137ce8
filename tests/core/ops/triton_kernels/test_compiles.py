"""Every Triton kernel compiles for an H100 (sm_90) down to a cubin, on this GPU-less machine.

The interpreter tests check what the kernels compute; this checks that the compiler accepts
them (it refuses Python the interpreter runs). ``triton_aot.py`` runs in a process of its own,
without ``TRITON_INTERPRET``, with a fresh Triton cache so that everything really compiles.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
ROOT = HERE.parents[3]


def test_kernels_compile_for_sm90(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run(
        [sys.executable, str(HERE / "triton_aot.py"), "90"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-6000:]
    compiled = {line.split()[1] for line in run.stdout.splitlines() if line.startswith("sm_90 ")}
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
        "_adam_bf16_kernel",
        "_sgd_bf16_kernel",
        "_lamb_bf16_phase2",
        "_check_finite_kernel",
    }
    assert expected <= compiled, sorted(expected - compiled)
