"""What the runs ran on: the hardware facts every comparison (one process or ``ranks=N``)
stamps on its rows and its DataFrame's ``attrs["hardware"]``."""

from __future__ import annotations

import math
import os

import torch

from mpnb.core.dtype_names import HALF_NAMES, torch_name
from mpnb.core.hardware import cpu_info, cuda_info, dtype_support, half_support
from mpnb.core.number_formats import format_named
from mpnb.lab.stats import loadavg

__all__ = ["fp8_support", "hardware_summary", "BLOCK_SCALED"]

#: the block-scaled formats whose GEMMs go native only on sm100+ (after a first-use check)
BLOCK_SCALED = ("mxfp8", "nvfp4", "mxfp4")


def fp8_support(device: str = "cpu") -> str:
    """``"native"`` where ``device`` runs FP8 GEMMs faster than fp32 in this process
    (:func:`mpnb.core.hardware.dtype_support`: measured ``torch._scaled_mm``), else
    ``"emulated"``: FP8 numerics computed with wider arithmetic, slower than fp32.

    MXFP8's GEMM is emulated except on a CUDA device of capability 10.0+ whose first-use check
    passed (its configuration's ``status``; :func:`hardware_summary` records the decision).

    Example::

        >>> fp8_support("cpu")
        'emulated'
    """
    native = dtype_support(device)[format_named("fp8").probe.dtype].status == "native"
    return "native" if native else "emulated"


def hardware_summary(device: str = "cpu") -> dict:
    """What the runs ran on: device, CPU/GPU model, threads, torch, native/emulated halves.

    Example::

        >>> hardware_summary("cpu")["bf16"]
        'emulated'
    """
    cpu, hs = cpu_info(), half_support(device)
    load = loadavg() or [math.nan]
    out = {
        "device": device,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "cpus": os.cpu_count(),
        "load_avg": load[0],
        "cpu": cpu.model,
        "isa": cpu.isa,
        **{h: hs[torch_name(h)] for h in HALF_NAMES},
        "fp8": fp8_support(device),
    }
    if torch.device(device).type == "cuda":
        out["gpu"] = cuda_info(torch.device(device).index or 0)
        # the block-scaled GEMMs' decision on this card (sm100+: after the first-use check),
        # kept with the rows so that a frame read back elsewhere says what ran here
        from mpnb.core.fp8.gemm import block_scaled_status  # fp8 on first use: ~200 ms cold

        out["block_scaled"] = {f: block_scaled_status(device, f) for f in BLOCK_SCALED}
        name = out["gpu"]["name"]
    else:
        name = f"{cpu.model} ({cpu.isa}, {out['threads']} threads)"
    out["summary"] = f"{name}; bf16 {hs['bfloat16']}, fp16 {hs['float16']}, fp8 {out['fp8']}"
    return out
