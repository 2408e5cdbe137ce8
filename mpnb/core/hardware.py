"""What the hardware at hand really supports: vector ISA, and native bf16/fp16/FP8 GEMMs.

Everything here is read from the machine (``/proc/cpuinfo``, ``torch.cuda``) or measured in
this process, never assumed. Whether a low-precision dtype is native is decided by what
PyTorch will run here (:func:`dtype_support`: a short timed GEMM probe, with ATen's
capability, oneDNN's ISA limit and the CPU flags as evidence): the flags alone mislead where
``ATEN_CPU_CAPABILITY``/``ONEDNN_MAX_CPU_ISA`` or a VM hide the instructions from PyTorch.
The kernel build (``mpnb.core.ops``), ``mpnb doctor``, the amp front end (which warns when a
half dtype is emulated), the lab's rows and verdict and the widgets all read it from here.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch

from mpnb.core._gemm_probe import GemmTiming, time_gemms

# default_half_dtype is re-exported: a naming fact, not a probe, so it lives in dtype_names
from mpnb.core.dtype_names import HALF_NAMES, default_half_dtype, lookup, short_name, torch_name
from mpnb.core.number_formats import format_of
from mpnb.core.number_formats import native_min_speeds as _table_speeds

__all__ = [
    "CpuInfo",
    "DtypeSupport",
    "NATIVE_MIN_SPEED",
    "classify",
    "cpu_info",
    "cuda_info",
    "default_half_dtype",
    "dtype_support",
    "half_support",
    "status_of",
]

# x86 flags of hardware half-precision arithmetic (each format's ``probe.cpu_flags`` in
# mpnb.core.number_formats) are evidence printed beside the probe, not the decision (PyTorch
# may not use them: ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, a VM's mask).
_AVX512_TORCH = ("avx512f", "avx512bw", "avx512vl", "avx512dq")


@dataclass(frozen=True)
class CpuInfo:
    """A summary of the host CPU.

    Attributes:
        model: the model name reported by the OS.
        arch: ``platform.machine()``.
        flags: the CPU feature flags (lower case).
        isa: the widest vector ISA our kernels are built for: ``"AVX512"``, ``"AVX2"`` or
            ``"DEFAULT"`` (portable C++, auto-vectorized by the compiler).
    """

    model: str
    arch: str
    flags: frozenset[str] = field(repr=False)
    isa: str

    def has(self, *names: str) -> bool:
        """True when every one of ``names`` is among the CPU flags."""
        return all(n in self.flags for n in names)


def _read_cpuinfo() -> tuple[str, frozenset[str]]:
    model, flags = platform.processor() or "unknown", frozenset()
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return model, flags
    m = re.search(r"^model name\s*:\s*(.+)$", text, re.M)
    if m:
        model = m.group(1).strip()
    m = re.search(r"^(?:flags|Features)\s*:\s*(.+)$", text, re.M)
    if m:
        flags = frozenset(m.group(1).split())
    return model, flags


@functools.cache
def cpu_info() -> CpuInfo:
    """Return the host CPU's model, flags and the vector ISA our kernels target (cached)."""
    model, flags = _read_cpuinfo()
    if all(f in flags for f in _AVX512_TORCH):
        isa = "AVX512"
    elif "avx2" in flags and "fma" in flags:
        isa = "AVX2"
    else:
        isa = "DEFAULT"
    return CpuInfo(model=model, arch=platform.machine(), flags=flags, isa=isa)


@dataclass(frozen=True)
class DtypeSupport:
    """How PyTorch computes one low-precision dtype's GEMMs in this process, and the evidence.

    Attributes:
        dtype: ``"bfloat16"``, ``"float16"`` or ``"float8_e4m3fn"``.
        status: ``"native"`` (the measured GEMM speed is at least :data:`NATIVE_MIN_SPEED` of
            float32's), ``"emulated"`` (it runs, far slower: computed in software) or
            ``"unsupported"`` (PyTorch cannot run it here).
        speed_vs_fp32: float32's GEMM time over this dtype's (above 1: faster), measured by
            the probe; None when nothing was timed.
        reason: one line of evidence: the probe's times, ATen's capability, oneDNN's ISA
            limit, the CPU flags (or the CUDA capability).
    """

    dtype: str
    status: str
    speed_vs_fp32: float | None
    reason: str


#: What "native" means, measured: a dtype's GEMM runs at least this fraction of float32's
#: speed. Emulated half GEMMs measure 20-400x slower than float32 and native ones 0.5-5x
#: faster (fp16 on AVX512-FP16 runs near float32's speed and is native), so a half dtype is
#: native unless it is several times slower. FP8 exists only for speed: an FP8 GEMM slower
#: than float32 is dequantized and computed in a wider type, so FP8 must beat float32.
#: Derived, read-only, from :data:`mpnb.core.number_formats.FORMATS` (each row's
#: ``native_min_speed``, keyed by its probe's dtype): a registered format appears here.
def _format(dtype: str):
    return format_of(dtype)


def native_min_speeds() -> dict[str, float]:
    """Doctor's key -> native threshold, read from the table now (see NATIVE_MIN_SPEED)."""

    return _table_speeds()


class _NativeMinSpeed(Mapping):
    def __getitem__(self, dtype: str) -> float:
        return native_min_speeds()[dtype]

    def __iter__(self):
        return iter(native_min_speeds())

    def __len__(self) -> int:
        return len(native_min_speeds())

    def __repr__(self) -> str:
        return repr(native_min_speeds())


NATIVE_MIN_SPEED: Mapping[str, float] = _NativeMinSpeed()


def _cpu_flags(dtype: str) -> tuple[str, ...]:
    return _format(dtype).probe.cpu_flags


#: environment variables read by ATen and oneDNN that change which kernels run
PROBE_ENV = (
    "ATEN_CPU_CAPABILITY",
    "ONEDNN_MAX_CPU_ISA",
    "DNNL_MAX_CPU_ISA",
    "ONEDNN_DEFAULT_FPMATH_MODE",
    "DNNL_DEFAULT_FPMATH_MODE",
    "CUDA_VISIBLE_DEVICES",
)


def classify(dtype: str, timings: Sequence[GemmTiming], evidence: str) -> DtypeSupport:
    """Decide native/emulated from a probe's timings (the last one is the answer).

    Args:
        dtype: the dtype's torch name (a key of :data:`NATIVE_MIN_SPEED`).
        timings: the probe's measurements, smallest size first.
        evidence: what else was read (capability, ISA limit, flags), appended to the reason.

    Example::

        >>> classify("bfloat16", [GemmTiming(128, 28e-6, 1.1e-3)], "ATen AVX2").status
        'emulated'
    """
    t = timings[-1]
    ratio = t.speed_vs_fp32
    status = "native" if ratio >= NATIVE_MIN_SPEED[dtype] else "emulated"
    shown = f"{ratio:.2f}" if ratio >= 0.01 else f"{ratio:.2g}"  # never "0.00x"
    reason = (
        f"{shown}x fp32's GEMM speed ({t.n}x{t.n} at 1 thread: fp32 {t.fp32_s * 1e3:.3f} ms, "
        f"{short_name(dtype)} {t.dtype_s * 1e3:.3f} ms); {evidence}"
    )
    return DtypeSupport(dtype, status, ratio, reason)


def _onednn_limit() -> str:
    isa = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
    return f"oneDNN ISA limit {isa}" if isa else "no oneDNN ISA limit"


def _cpu_evidence(dtype: str) -> str:
    cap = torch.backends.cpu.get_cpu_capability()
    flags = _cpu_flags(dtype)
    have = [f for f in flags if f in cpu_info().flags]
    if not flags:
        named = "torch._scaled_mm"
    elif have:
        named = f"CPU flags {' '.join(have)}"
    else:
        named = f"CPU flags: none of {'/'.join(flags)}"
    return f"ATen capability {cap}, {_onednn_limit()}, {named}"


def _cuda_rule(dtype: str, info: dict | None) -> str:
    """Why ``dtype`` cannot run on this CUDA device ("" when it may: then it is probed)."""
    if info is None:
        return "no CUDA device"
    return _format(dtype).capability_refusal(info["name"], info["capability"])


def _refusal(dtype: str, device: torch.device) -> str:
    """Why ``dtype`` cannot run on ``device`` without trying ("" when it is to be probed)."""
    if _format(dtype).probe.op == "scaled_mm" and not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if device.type == "cuda":
        return _cuda_rule(dtype, cuda_info(device.index or 0))
    return ""


def _evidence(dtype: str, device: torch.device) -> str:
    if device.type == "cuda":
        info = cuda_info(device.index or 0)
        return f"{info['name']}, CUDA capability {info['capability']}"
    return _cpu_evidence(dtype) if device.type == "cpu" else f"device {device}"


def _probe(device: torch.device) -> dict[str, DtypeSupport]:
    refused = {d: _refusal(d, device) for d in NATIVE_MIN_SPEED}
    # far below the line, one timed call settles it (and an emulated GEMM is not re-timed)
    stop = {d: NATIVE_MIN_SPEED[d] / 8 for d in NATIVE_MIN_SPEED}
    todo = [d for d, why in refused.items() if not why]
    timed = time_gemms(todo, device, stop) if todo else {}
    out = {}
    for dtype, why in refused.items():
        if why:
            out[dtype] = DtypeSupport(dtype, "unsupported", None, why)
            continue
        got, evidence = timed[dtype], _evidence(dtype, device)
        if isinstance(got, Exception):  # PyTorch cannot run it here: that is the answer
            text = (str(got).strip().splitlines() or [type(got).__name__])[0]
            first = text.split(". ")[0][:160]  # its first sentence
            why = f"the {short_name(dtype)} GEMM failed: {first}; {evidence}"
            out[dtype] = DtypeSupport(dtype, "unsupported", None, why)
        else:
            out[dtype] = classify(dtype, got, evidence)
            if out[dtype].status == "emulated" and _flags_unused(dtype, device):
                note = " (present, but not used by PyTorch in this process)"
                out[dtype] = replace(out[dtype], reason=out[dtype].reason + note)
    return out


def _flags_unused(dtype: str, device: torch.device) -> bool:
    return device.type == "cpu" and any(f in cpu_info().flags for f in _cpu_flags(dtype))


def _matmul_precision() -> str:
    """The fp32 matmul precision setting, whichever API set it: PyTorch 2.9+ refuses the
    legacy getter once the per-backend ``fp32_precision`` settings were used (e.g. for TF32)."""
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:
        b = torch.backends
        return f"cuda {b.cuda.matmul.fp32_precision}, mkldnn {b.mkldnn.matmul.fp32_precision}"


def _probe_key(device: torch.device) -> tuple:
    env = tuple(os.environ.get(k) for k in PROBE_ENV)
    mkldnn = torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled
    return (str(device), env, mkldnn, _matmul_precision())


@functools.cache
def _dtype_support(key: tuple) -> dict[str, DtypeSupport]:
    return _probe(torch.device(key[0]))


def dtype_support(device: str | torch.device = "cpu") -> dict[str, DtypeSupport]:
    """Say, per low-precision dtype, how PyTorch computes its GEMMs on ``device`` here.

    Decided by what this process will run, not by the CPU flags alone: a short timed probe of
    a GEMM in the dtype against float32 (a few ms; :mod:`mpnb.core._gemm_probe`), with ATen's
    capability in force, oneDNN's ISA limit and the CPU flags (or the CUDA capability) as
    evidence. The answer is cached per process and device, keyed by the environment
    variables that change it (:data:`PROBE_ENV`) and torch's float32 matmul settings.

    Returns:
        ``{"bfloat16": DtypeSupport, "float16": ..., "float8_e4m3fn": ...}``.

    Example::

        >>> s = dtype_support("cpu")["bfloat16"]
        >>> s.status, round(s.speed_vs_fp32, 1)       # on a CPU with AMX
        ('native', 3.1)
    """
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", 0)
    return _dtype_support(_probe_key(dev))


def half_support(device: str | torch.device = "cpu") -> dict[str, str]:
    """Say, per half dtype, whether ``device`` computes it natively or emulates it.

    The status of :func:`dtype_support` (measured in this process), for the two half dtypes.

    Returns:
        ``{"bfloat16": status, "float16": status}`` where status is ``"native"``,
        ``"emulated"`` (works, but several times slower than fp32) or ``"unsupported"``.

    Example::

        >>> half_support("cpu")            # AVX2 only, or ATEN_CPU_CAPABILITY=avx2
        {'bfloat16': 'emulated', 'float16': 'emulated'}
    """
    support = dtype_support(device)
    return {torch_name(h): support[torch_name(h)].status for h in HALF_NAMES}


def status_of(facts: Mapping, dtype) -> str:
    """``"native"``, ``"emulated"`` or ``"unsupported"``: the status of ``dtype`` (any of its
    names, :mod:`mpnb.core.dtype_names`) in ``facts``, which may be :func:`dtype_support`'s
    ``DtypeSupport`` values, :func:`half_support`'s statuses or a compare DataFrame's
    ``attrs["hardware"]`` (keyed ``"bf16"``, ``"fp16"``, ``"fp8"``).

    Example::

        >>> status_of(dtype_support("cpu"), "bf16")
        'native'
    """
    fact = lookup(facts, dtype)
    return str(getattr(fact, "status", fact))


def cuda_info(index: int = 0) -> dict | None:
    """Describe CUDA device ``index`` (name, capability, tensor cores, bf16), or None."""
    if not torch.cuda.is_available():
        return None
    props = torch.cuda.get_device_properties(index)
    cap = (props.major, props.minor)
    return {
        "name": props.name,
        "capability": f"{cap[0]}.{cap[1]}",
        "memory_gib": round(props.total_memory / 2**30, 1),
        "tensor_cores": cap >= (7, 0),
        "bf16": cap >= (8, 0),
    }
