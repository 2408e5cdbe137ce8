"""``mpnb.lab.machine``: the hardware facts a comparison stamps on its rows."""

from __future__ import annotations

import pytest
import torch

from mpnb.core.hardware import cpu_info, half_support
from mpnb.core.number_formats import format_named
from mpnb.lab import machine
from mpnb.lab.stats import torch_threads


def test_fp8_is_emulated_on_a_cpu():
    assert machine.fp8_support("cpu") == "emulated"
    assert machine.fp8_support() == "emulated"  # the default device: the CPU


def test_fp8_support_reads_the_measured_dtype_support(monkeypatch):
    class _Support:
        def __init__(self, status):
            self.status = status

    fp8 = format_named("fp8").probe.dtype
    monkeypatch.setattr(machine, "dtype_support", lambda device: {fp8: _Support("native")})
    assert machine.fp8_support("cuda") == "native"
    monkeypatch.setattr(machine, "dtype_support", lambda device: {fp8: _Support("slow")})
    assert machine.fp8_support("cuda") == "emulated"  # anything but native is emulated


def test_the_summary_of_a_cpu():
    with torch_threads(1):
        hw = machine.hardware_summary("cpu")
    cpu, halves = cpu_info(), half_support("cpu")
    assert hw["device"] == "cpu" and hw["torch"] == torch.__version__
    assert hw["threads"] == 1  # the threads the run had, not the machine's
    assert (hw["cpu"], hw["isa"]) == (cpu.model, cpu.isa)
    assert (hw["bf16"], hw["fp16"]) == (halves["bfloat16"], halves["float16"])
    assert hw["fp8"] == "emulated" and "gpu" not in hw and "block_scaled" not in hw
    assert hw["summary"] == (
        f"{cpu.model} ({cpu.isa}, 1 threads); bf16 {halves['bfloat16']}, "
        f"fp16 {halves['float16']}, fp8 emulated"
    )


def test_the_block_scaled_formats_are_number_formats():
    assert machine.BLOCK_SCALED == ("mxfp8", "nvfp4", "mxfp4")
    for name in machine.BLOCK_SCALED:
        assert format_named(name).name == name


@pytest.mark.gpu
def test_the_summary_of_a_gpu_names_it_and_the_block_scaled_decision():
    hw = machine.hardware_summary("cuda")
    assert hw["summary"].startswith(hw["gpu"]["name"] + ";")
    assert set(hw["block_scaled"]) == set(machine.BLOCK_SCALED)
