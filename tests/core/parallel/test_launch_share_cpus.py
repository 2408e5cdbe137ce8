"""Several ranks on one small machine share its CPUs instead of each starting a thread per core
(Apex's two-rank tests on two busy cores: the ranks' parallel regions waited on each other's
threads): ``mpnb.parallel.launch`` ranks and scripts run by ``python -m mpnb.apex`` beside other
ranks take ``cpus_available() // ranks`` threads, counted from the affinity mask, not the
machine; a user's ``OMP_NUM_THREADS`` wins."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
needs_two = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to share")


def _run(code: str, tmp_path, env=None, args=()) -> subprocess.CompletedProcess:
    script = tmp_path / "probe.py"
    script.write_text(textwrap.dedent(code))
    full = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    full.update(env or {})
    return subprocess.run(
        [sys.executable, *args, str(script)],
        capture_output=True,
        text=True,
        env=full,
        timeout=300,
    )


@needs_two
def test_share_cpus_divides_the_cpus_this_process_may_use(tmp_path):
    r = _run(
        f"""
        import os, torch
        from mpnb.core.parallel.launch import cpus_available, share_cpus
        os.sched_setaffinity(0, {set(CPUS[:2])!r})
        print(cpus_available(), share_cpus(2), share_cpus(1))
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2", "1", "1"]  # halved, and never raised again


@needs_two
def test_users_omp_num_threads_wins(tmp_path):
    code = "from mpnb.core.parallel.launch import share_cpus; print(share_cpus(2))"
    r = _run(code, tmp_path, env={"OMP_NUM_THREADS": "2"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["2"]


@needs_two
@pytest.mark.dist
def test_launch_counts_the_affinity_not_the_machine(tmp_path):
    """A job pinned to one CPU (taskset, a scheduler's binding) gets one thread per rank, not
    one per core of the machine."""
    r = _run(
        f"""
        import os, torch
        from mpnb.parallel import launch

        def threads():
            return torch.get_num_threads()

        if __name__ == "__main__":
            os.sched_setaffinity(0, {{{CPUS[0]}}})
            print(launch(threads, nprocs=1, backend="gloo", timeout=120))
        """,
        tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[1]"


@needs_two
def test_python_m_mpnb_apex_rank_beside_another_takes_its_share(tmp_path):
    """Apex's launch scripts set WORLD_SIZE/RANK and a loopback master for each local rank."""
    code = "import torch; print('threads', torch.get_num_threads())"
    env = {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1"}
    pin = f"import os; os.sched_setaffinity(0, {set(CPUS[:2])!r});"
    r = _run(
        code,
        tmp_path,
        env=env,
        args=(
            "-c",
            pin + "import runpy, sys; sys.argv = ["
            "'mpnb.apex', *sys.argv[1:]]; runpy.run_module('mpnb.apex', run_name='__main__')",
        ),
    )
    assert r.returncode == 0, r.stderr
    assert "threads 1" in r.stdout
    assert "2 ranks share this machine's 2 CPUs" in r.stderr
    r = _run(code, tmp_path, env={**env, "OMP_NUM_THREADS": "2"}, args=("-m", "mpnb.apex"))
    assert "threads 2" in r.stdout and "ranks share" not in r.stderr
