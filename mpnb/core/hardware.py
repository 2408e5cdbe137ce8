"""What the hardware at hand really supports: vector ISA and native fp16/bf16.

Everything here is read from the machine (``/proc/cpuinfo``, ``torch.cuda``), never assumed.
The kernel build (``mpnb.core.ops``), ``mpnb doctor`` and the amp front end (which warns when
a half dtype is emulated) all read it from here.
"""

from __future__ import annotations

import functools
import platform
import re
from dataclasses import dataclass, field

import torch

__all__ = ["CpuInfo", "cpu_info", "half_support", "cuda_info", "default_half_dtype"]

# Flags that make a half dtype "native" on x86: the CPU computes in that dtype (or converts and
# multiplies it) in hardware. Without them PyTorch emulates the dtype in software.
_BF16_NATIVE = ("avx512_bf16", "amx_bf16")
_FP16_NATIVE = ("avx512_fp16", "amx_fp16")
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


def half_support(device: str | torch.device = "cpu") -> dict[str, str]:
    """Say, per half dtype, whether ``device`` computes it natively or emulates it.

    Returns:
        ``{"bfloat16": status, "float16": status}`` where status is ``"native"``,
        ``"emulated"`` (works, but far slower than fp32) or ``"unsupported"``.

    Example::

        >>> half_support("cpu")            # on a CPU without avx512_bf16 / amx
        {'bfloat16': 'emulated', 'float16': 'emulated'}
    """
    dev = torch.device(device)
    if dev.type == "cuda":
        info = cuda_info(dev.index or 0)
        if info is None:
            return {"bfloat16": "unsupported", "float16": "unsupported"}
        return {
            "bfloat16": "native" if info["bf16"] else "unsupported",
            "float16": "native",
        }
    cpu = cpu_info()
    return {
        "bfloat16": "native" if any(f in cpu.flags for f in _BF16_NATIVE) else "emulated",
        "float16": "native" if any(f in cpu.flags for f in _FP16_NATIVE) else "emulated",
    }


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


def default_half_dtype(device: str | torch.device = "cpu") -> torch.dtype:
    """The half dtype mpnb picks when the user does not choose: fp16 on CUDA, bf16 on CPU."""
    return torch.float16 if torch.device(device).type == "cuda" else torch.bfloat16
