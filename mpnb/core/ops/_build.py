"""Just-in-time build of mpnb's C++ kernels (``csrc/``) with ``torch.utils.cpp_extension``.

One translation unit per backend (``csrc/cpu/mpnb_cpu.cpp`` includes every CPU kernel), so the
heavy torch headers are compiled once. The build lands in a cache directory keyed by the torch
version, the hash of every source file, the compiler flags and the CPU's vector ISA, so a
changed source, flag, torch or machine gets a fresh build and an unchanged one loads at once.

A missing compiler or ninja, or a failed build, never breaks ``import mpnb``: the failure is
recorded, warned about once, and every op runs its pure-PyTorch reference.
``MPNB_DISABLE_EXT=1`` forces the references without trying to build.
"""

from __future__ import annotations

import hashlib
import importlib.resources
import os
import shutil
import sys
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mpnb.core.hardware import cpu_info

__all__ = ["Extension", "ExtensionWarning", "cpu_extension", "csrc_dir", "cache_root"]


class ExtensionWarning(UserWarning):
    """Warned once when mpnb's C++ kernels cannot be used and the references run instead."""


def env_reader(name: str):
    """A zero-argument function returning ``os.environ.get(name)``, about 10x cheaper.

    Every op call asks whether ``MPNB_DISABLE_EXT`` is set (it may change in-process, as the
    tests do with ``monkeypatch.setenv``); ``os.environ.get`` costs about 1 us through its
    Mapping methods. CPython's ``os.environ`` keeps its items in ``_data`` under encoded
    keys, and every change made through ``os.environ`` updates that dict, so this reads it
    directly. Where that layout is missing, the plain ``os.environ.get`` is returned.
    """
    env = os.environ
    data = getattr(env, "_data", None)
    encode, decode = getattr(env, "encodekey", None), getattr(env, "decodevalue", None)
    if isinstance(data, dict) and callable(encode) and callable(decode):
        try:
            key = encode(name)
        except Exception:  # noqa: BLE001 - any failure: use the public path
            key = None
        if key is not None:
            get = data.get

            def read() -> str | None:
                v = get(key)
                return None if v is None else decode(v)

            return read
    return lambda: env.get(name)


_read_disable_ext = env_reader("MPNB_DISABLE_EXT")


def csrc_dir() -> Path:
    """Locate the C++ sources: ``csrc/`` of a source checkout, or ``mpnb/_csrc`` when installed."""
    here = Path(__file__).resolve().parents[3] / "csrc"
    if (here / "cpu" / "mpnb_cpu.cpp").is_file():
        return here
    installed = Path(str(importlib.resources.files("mpnb._csrc")))
    if (installed / "cpu" / "mpnb_cpu.cpp").is_file():
        return installed
    raise FileNotFoundError(
        f"mpnb's C++ sources were not found (looked in {here} and {installed}); "
        "reinstall mpnb with `pip install .` or `pip install -e .` from a full checkout."
    )


def cache_root() -> Path:
    """The build cache: ``$MPNB_CACHE_DIR``, else ``$XDG_CACHE_HOME/mpnb`` or ``~/.cache/mpnb``."""
    env = os.environ.get("MPNB_CACHE_DIR")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "mpnb"


def _isa_flags(isa: str) -> list[str]:
    # ATen's Vectorized<T> picks its implementation from CPU_CAPABILITY_*; CPU_CAPABILITY also
    # names the inline namespace, so our instantiations never collide with libtorch's own.
    flags = [f"-DCPU_CAPABILITY={isa}"]
    if isa != "DEFAULT":
        flags.append(f"-DCPU_CAPABILITY_{isa}")
    return flags


@dataclass
class BuildResult:
    """What happened when the extension was (or was not) built and loaded."""

    loaded: bool
    reason: str = ""
    seconds: float = 0.0
    path: str = ""
    module: object = None  # the loaded Python module (its ``caller`` makes direct callers)


class Extension:
    """One backend's compiled kernels: built on first use, loaded once, failures remembered.

    Args:
        backend: ``"cpu"`` (``csrc/cpu/mpnb_cpu.cpp``).
    """

    def __init__(self, backend: str = "cpu") -> None:
        self.backend = backend
        self._lock = threading.Lock()
        self._result: BuildResult | None = None
        self._warned = False

    # -- configuration ---------------------------------------------------------------------
    def sources(self) -> list[Path]:
        """The translation units handed to the compiler: the kernels and their Python entry.

        ``mpnb_<backend>.cpp`` holds every kernel (one unit, so the torch headers are compiled
        once); ``dispatch.cpp`` holds the Autograd-key kernels of the list ops and the
        module's direct caller (:func:`mpnb.core.ops._registry.op_caller`). ninja compiles
        the two in parallel.
        """
        d = csrc_dir() / self.backend
        return [d / f"mpnb_{self.backend}.cpp", d / "dispatch.cpp"]

    def _all_source_files(self) -> list[Path]:
        root = csrc_dir()
        return sorted(p for p in root.rglob("*") if p.suffix in {".cpp", ".h", ".cu", ".cuh"})

    def cflags(self) -> list[str]:
        """Compiler flags: -O3, OpenMP, and the host's own vector ISA."""
        isa = cpu_info().isa
        # -ffp-contract=off: no silent FMA contraction, so kernels round exactly like the
        # references (an explicit fmadd is used where a kernel wants one).
        flags = ["-O3", "-fopenmp", "-ffp-contract=off", "-Wno-unused-function", *_isa_flags(isa)]
        if isa != "DEFAULT" and cpu_info().arch in ("x86_64", "AMD64"):
            flags.append("-march=native")
        return flags

    def key(self) -> str:
        """A hash of torch version, sources, flags and CPU: the cache directory's name."""
        h = hashlib.sha256()
        h.update(torch.__version__.encode())
        h.update(" ".join(self.cflags()).encode())
        h.update(cpu_info().model.encode())
        h.update(" ".join(sorted(cpu_info().flags)).encode())
        root = csrc_dir()
        for p in self._all_source_files():
            h.update(str(p.relative_to(root)).encode())
            h.update(p.read_bytes())
        return h.hexdigest()[:16]

    def build_dir(self) -> Path:
        """Where this exact build lives."""
        tv = torch.__version__.replace("+", "_")
        return cache_root() / f"{self.backend}-torch{tv}-{cpu_info().isa.lower()}-{self.key()}"

    # -- state -----------------------------------------------------------------------------
    @property
    def disabled(self) -> bool:
        """True when ``MPNB_DISABLE_EXT=1`` forces the pure-PyTorch references."""
        return _read_disable_ext() not in (None, "", "0", "false", "False")

    def is_built(self) -> bool:
        """True when a build for the current sources is in the cache (nothing is compiled)."""
        d = self.build_dir()
        return any(d.glob(f"mpnb_{self.backend}_*.so"))

    def status(self) -> BuildResult | None:
        """The result of the last load attempt, or None if none was made in this process."""
        return self._result

    def available(self) -> bool:
        """Load (building on first use) and report whether the kernels can be called."""
        if self.disabled:
            return False
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = self._load(force=False, verbose=False)
        if not self._result.loaded:
            self._warn_once(self._result.reason)
        return self._result.loaded

    def build(self, force: bool = False, verbose: bool = False) -> BuildResult:
        """Build (or with ``force`` rebuild from scratch) and load the kernels now."""
        with self._lock:
            if self._result is not None and self._result.loaded and not force:
                return self._result
            if force and self.build_dir().exists():
                shutil.rmtree(self.build_dir())
            self._result = self._load(force=force, verbose=verbose)
            return self._result

    # -- internals -------------------------------------------------------------------------
    def _missing_tools(self) -> str:
        from torch.utils import cpp_extension

        try:
            cpp_extension.verify_ninja_availability()
        except RuntimeError:
            return "ninja was not found (install it with `pip install ninja`)"
        cxx = os.environ.get("CXX", "c++")
        if shutil.which(cxx) is None:
            return f"no C++ compiler ({cxx}) on PATH (install g++ or set CXX)"
        return ""

    def _load(self, force: bool, verbose: bool) -> BuildResult:
        if self.disabled:
            return BuildResult(False, "disabled by MPNB_DISABLE_EXT=1")
        missing = self._missing_tools()
        if missing:
            return BuildResult(False, missing)
        from torch.utils import cpp_extension

        start = time.perf_counter()
        try:
            build_dir = self.build_dir()
            build_dir.mkdir(parents=True, exist_ok=True)
            name = f"mpnb_{self.backend}_{self.key()[:10]}"
            if not self.is_built():
                print(
                    f"mpnb: compiling the {self.backend.upper()} kernels into {build_dir} "
                    "(first use only, about a minute)...",
                    file=sys.stderr,
                    flush=True,
                )
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                module = cpp_extension.load(
                    name=name,
                    sources=[str(s) for s in self.sources()],
                    extra_cflags=self.cflags(),
                    extra_ldflags=["-fopenmp"],
                    extra_include_paths=[str(csrc_dir())],
                    build_directory=str(build_dir),
                    is_python_module=True,
                    verbose=verbose,
                )
        except Exception as exc:  # a failed build must never break the package
            text = str(exc).strip().splitlines()
            detail = "\n".join(text[-15:]) if text else type(exc).__name__
            return BuildResult(False, f"the build failed: {detail}", time.perf_counter() - start)
        so = next(iter(self.build_dir().glob(f"{name}*.so")), None)
        return BuildResult(
            True, "", time.perf_counter() - start, str(so or self.build_dir()), module
        )

    def _warn_once(self, reason: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"mpnb: the {self.backend.upper()} C++ kernels are not available ({reason}); "
            "every op runs its pure-PyTorch reference instead (correct, but slower). "
            "Run `mpnb doctor` for details and `mpnb build-ext --force` to retry.",
            ExtensionWarning,
            stacklevel=3,
        )


_CPU = Extension("cpu")


def cpu_extension() -> Extension:
    """The process-wide handle on the CPU kernels."""
    return _CPU
