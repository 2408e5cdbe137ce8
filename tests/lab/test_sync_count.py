"""The sync counter the GPU check runs: host reads per step for amp and torch.amp, on the CPU;
the CUDA synchronizations themselves on a GPU."""

import math

import pytest
import torch

from mpnb.lab.sync_count import STEPS, count_syncs, cuda_sync_warnings, main


def test_fused_steps_read_nothing_and_a_python_loop_reads_amps_flag():
    names = [n for n in STEPS if "bf16" in n]
    rows = {r["name"]: r for r in count_syncs("cpu", steps=2, names=names)}
    assert all("error" not in r for r in rows.values()), rows
    for name, r in rows.items():
        if "Python loop" in name:  # torch's own reads of its step counts, plus amp's flag
            assert r["host_reads"] >= 1
        else:
            assert r["host_reads"] == 0, (name, r["where"])
        assert math.isnan(r["cuda_syncs"])  # no CUDA here: not counted, never made up


def test_cpu_collects_no_sync_warnings():
    with cuda_sync_warnings(torch.device("cpu")) as caught:
        torch.ones(2).sum().item()
    assert caught == []


def test_cli_refuses_zero_steps(capsys):
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--steps", "0"])
    assert "--steps 0" in capsys.readouterr().err


@pytest.mark.gpu
def test_fused_steps_do_not_synchronize_on_cuda():
    rows = count_syncs("cuda", steps=3)
    for r in rows:
        assert "error" not in r, r
        if "Python loop" not in r["name"]:
            assert r["cuda_syncs"] == 0 and r["host_reads"] == 0, r
