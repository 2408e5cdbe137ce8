"""``mpnb doctor``: what this machine supports and which path every op takes, in plain words."""

from __future__ import annotations

import os
import shutil
import sys

import torch

from mpnb.core.dtype_names import short_name
from mpnb.core.hardware import (
    cpu_info,
    cuda_info,
    default_half_dtype,
    dtype_support,
)
from mpnb.core.number_formats import probed_formats
from mpnb.core.ops import all_ops, cache_root, cpu_extension, kernels_loaded, op_path
from mpnb.core.ops._build import _ninja
from mpnb.core.ops._output_cache import ENV, env_problem, output_cache
from mpnb.core.ops.adam import TORCH_ROUTE_ELEMS, TORCH_ROUTE_MEASURED, cpu_route
from mpnb.core.ops.triton import LAUNCHERS, decision, triton_status

__all__ = ["kernel_fallbacks", "report"]


def _toolchain() -> list[str]:
    ninja = _ninja() or "NOT FOUND (pip install ninja)"
    cxx = cpu_extension().compiler()
    return [f"  ninja: {ninja}", f"  C++ compiler: {shutil.which(cxx) or f'{cxx} NOT FOUND'}"]


def _dtype_lines(device: str) -> list[str]:
    """One line per low-precision dtype: status, measured speed vs fp32, and the evidence."""
    where = "CPU" if device == "cpu" else device.upper()
    return [
        f"  {short_name(k)} on {where}: {s.status}: {s.reason}"
        for k, s in dtype_support(device).items()
    ]


def _thresholds() -> str:
    """``"0.25x fp32's speed; fp8 1x"``: the first probed format's native threshold, then
    each one that differs from it (:mod:`mpnb.core.number_formats`)."""
    rows = probed_formats()
    first = rows[0].native_min_speed
    rest = [f"{f.name} {f.native_min_speed:g}x" for f in rows if f.native_min_speed != first]
    return "; ".join([f"{first:g}x fp32's speed", *rest])


def _hardware() -> list[str]:
    cpu = cpu_info()
    lines = [
        f"  CPU: {cpu.model} ({cpu.arch}), {os.cpu_count()} logical cores, "
        f"torch threads: {torch.get_num_threads()}",
        f"  vector ISA for mpnb kernels: {cpu.isa}; torch's own dispatch: "
        f"{torch.backends.cpu.get_cpu_capability()}",
        f"  low precision, measured in this process (native: a GEMM at least {_thresholds()}):",
        *_dtype_lines("cpu"),
        f"  default half dtype on CPU: {str(default_half_dtype('cpu')).replace('torch.', '')}",
    ]
    info = cuda_info() if torch.cuda.is_available() else None
    if info is None:
        lines.append(f"  CUDA: not available (torch built with CUDA: {torch.version.cuda or 'no'})")
    else:
        lines.append(
            f"  CUDA: {info['name']}, capability {info['capability']}, {info['memory_gib']} GiB, "
            f"tensor cores: {'yes' if info['tensor_cores'] else 'no'}"
        )
        lines += _dtype_lines("cuda")
    return lines


def kernel_fallbacks(device: str | torch.device = "cpu") -> list[str]:
    """One line per cause: the ops that have a C++ kernel of ours but run their pure-PyTorch
    reference in this process now (a failed or missing build, ``MPNB_DISABLE_EXT=1``, a
    library without the op). Empty when nothing fell back, on CUDA, and before the kernels
    were first asked for (nothing has run yet).

    Example::

        >>> kernel_fallbacks("cpu")    # g++ missing
        ['23 ops run their pure-PyTorch reference, not their C++ kernel (build failed: no C++
        compiler (c++) on PATH (install g++ or set CXX)): fused_adam_, ...']
    """
    if torch.device(device).type != "cpu":
        return []
    causes: dict[str, list[str]] = {}
    for info in all_ops():
        path = op_path(info.name, "cpu")
        if info.cpu_kernel and path.startswith("reference (") and "use_reference" not in path:
            causes.setdefault(path[len("reference (") : -1].replace("; ", ", "), []).append(
                info.name
            )
    return [
        f"{len(ops)} op{'s' if len(ops) > 1 else ''} run their pure-PyTorch reference, not "
        f"their C++ kernel ({why}): {', '.join(ops)}"
        for why, ops in causes.items()
    ]


def _triton_lines() -> list[str]:
    """Whether our Triton kernels serve CUDA calls, and each kernel's measured decision."""

    tri = triton_status()
    which = "every kernel (MPNB_TRITON=1)" if tri.opted_in else "the default ones"
    state = f"Triton {tri.version}, {which}" if tri.usable else f"not used: {tri.reason}"
    lines = [f"  CUDA kernels of ours (Triton): {state}; the rest run PyTorch's own CUDA ops"]
    by_label: dict[str, list[str]] = {}
    for name in LAUNCHERS:
        by_label.setdefault(decision(name).label, []).append(name)
    for label, names in by_label.items():  # a measured kernel's ratio is on its own line
        lines.append(f"    {label}: {', '.join(names)}")
    return lines


def _adam_route_lines() -> list[str]:
    """Which path ``fused_adam_`` takes on the CPU for fp32 params without masters, by tensor
    size: observed on each side of the threshold, with the measurement the threshold is from."""

    if not op_path("fused_adam_", "cpu").startswith("C++ kernel"):
        return []
    n = TORCH_ROUTE_ELEMS
    below, above = cpu_route(n - 1), cpu_route(n)
    sweep = ", ".join(f"2^{k.bit_length() - 1}: {r:.2f}" for k, r in TORCH_ROUTE_MEASURED.items())
    return [
        f"  fused_adam_ on cpu, fp32 params without masters (bias correction, no loss scale), "
        f"per tensor: {n - 1:,} elements -> {below}, {n:,} -> {above} (observed now). Why: "
        "PyTorch's op computes the same bits and streams one large tensor at least as fast; "
        "ours pays one parallel region for all small tensors where PyTorch's pays one per "
        "tensor. Threshold from PyTorch's time / ours (above 1: ours faster) by tensor size, "
        f"1 thread, side by side (reasoning in csrc/cpu/adam.cpp): {sweep}"
    ]


def _output_cache_lines() -> list[str]:
    """The C++ layer kernels' output cache: its limit, what it holds, and a bad setting."""

    if not kernels_loaded():
        return []
    c = output_cache()
    state = (
        f"holds up to {c['limit_mib']:.0f} MiB of freed outputs of {c['min_mib']:.0f} MiB "
        f"or more for reuse (now {c['held_mib']:.0f} MiB in {c['held_blocks']} block(s)); "
        f"{ENV}=0 turns it off"
        if c["limit_mib"] > 0
        else f"off ({ENV}=0): every large output is fresh memory"
    )
    lines = [f"  output cache of the C++ layer kernels (norms, softmax, RoPE): {state}"]
    problem = env_problem()
    if problem:
        lines.append(f"    Warning: {problem}")
    return lines


def report(build: bool = True) -> str:
    """The doctor's report as text.

    Args:
        build: build (or load) the CPU kernels first, so the report says what really runs;
            with False nothing is compiled and the report says what would happen.
    """
    ext = cpu_extension()
    if build and not ext.disabled:
        ext.build()
    py = sys.version.split()[0]
    lines = [
        "mpnb doctor",
        f"  torch {torch.__version__} (debug={torch.version.debug}), Python {py}",
        "hardware",
        *_hardware(),
        "kernels",
        *_toolchain(),
        f"  C++ sources: {ext.source_dir()}",
        f"  cache directory: {cache_root()}",
        f"  CPU build for these sources: {ext.build_dir()}",
    ]
    status = ext.status()
    if ext.disabled:
        lines.append("  CPU kernels: disabled by MPNB_DISABLE_EXT=1 (references run)")
    elif status is None:
        problem = ext._verify(ext.library())
        state = "built, library verified" if not problem else f"not usable yet ({problem})"
        lines.append(f"  CPU kernels: {state}; not loaded (build on first use)")
    elif status.loaded:
        lines.append(
            f"  CPU kernels: loaded from {status.path} (library verified: its size and SHA-256 "
            "match its build record)"
        )
    else:
        lines.append(f"  CPU kernels: FAILED, references run. Reason: {status.reason}")
    if status is not None and status.note:
        lines.append(f"  note: {status.note}")
    lines += [f"  FELL BACK: {line}" for line in kernel_fallbacks("cpu")]
    lines += _triton_lines()
    lines.append("ops (family: op -> path on cpu | on cuda)")
    for info in all_ops():
        lines.append(
            f"  {info.family}: {info.name} -> {op_path(info.name, 'cpu')}"
            f" | {op_path(info.name, 'cuda')}"
        )
    lines += _adam_route_lines()
    lines += _output_cache_lines()
    return "\n".join(lines)
