"""Just-in-time build of mpnb's C++ kernels (``csrc/cpu/*.cpp``) into a verified cache.

Every ``csrc/<backend>/<op>.cpp`` is its own translation unit (changing one kernel recompiles
one file); the heavy torch headers are compiled once into a precompiled header that every
unit reuses. The build is driven by a ``build.ninja`` file of our own:

* **Cache key.** The build directory is named by a hash of everything the build file
  contains: torch version, compiler and its version, flags, include and library paths, the
  CPU. The sources are copied into the build directory (a file only when its contents
  changed) and the build file uses relative paths only, so two checkouts of the same sources
  share one build and never rebuild each other, and a changed kernel file recompiles that
  file alone. The build record holds a hash of every source's name and contents: a library
  built from other sources is rebuilt (incrementally) before it is loaded.
* **Verified loads.** After linking, the library's size and SHA-256 are recorded next to it
  (``mpnb_cpu.so.json``); a load checks both first. A truncated or corrupt library is never
  mapped (mapping one kills the process with SIGBUS on first use): it is rebuilt, or, when
  the cache cannot be written, the references run, with one warning.
* **Locks only to build.** A valid build is loaded without taking the build lock, so a
  read-only cache that holds one works; a build takes an exclusive ``flock`` on the build
  directory, and a second process waits for it and then loads the result.

A missing compiler or ninja, or a failed build, never breaks ``import mpnb``: the failure is
recorded, warned about once, and every op runs its pure-PyTorch reference.
``MPNB_DISABLE_EXT=1`` (read once, when this module is imported) forces the references.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.resources
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from mpnb.core.hardware import cpu_info

__all__ = [
    "BuildResult",
    "Extension",
    "ExtensionWarning",
    "cache_root",
    "cpu_extension",
    "csrc_dir",
    "DISABLED",
]


class ExtensionWarning(UserWarning):
    """Warned once when mpnb's C++ kernels cannot be used and the references run instead."""


#: ``MPNB_DISABLE_EXT=1`` at import: never build or load the kernels (the references run).
DISABLED = os.environ.get("MPNB_DISABLE_EXT", "") not in ("", "0", "false", "False")

_SOURCE_SUFFIXES = {".cpp", ".h"}
_LIB = "mpnb_{backend}.so"


def csrc_dir() -> Path:
    """Locate the C++ sources: ``mpnb/_csrc`` of an installed wheel or sdist, else the
    ``csrc/`` of a source checkout (an editable install).

    The installed copy is package data of the ``mpnb`` package itself (``mpnb._csrc`` is a
    directory without ``__init__.py``: asking ``importlib.resources`` for it as a package
    gives a namespace ``MultiplexedPath``, which is not a file-system path).
    """
    installed = importlib.resources.files("mpnb").joinpath("_csrc")
    if isinstance(installed, Path) and (installed / "cpu").is_dir():
        return installed
    checkout = Path(__file__).resolve().parents[3] / "csrc"
    if (checkout / "cpu").is_dir():
        return checkout
    where = installed if isinstance(installed, Path) else f"{installed!r} (not on a file system)"
    raise FileNotFoundError(
        f"mpnb's C++ sources were not found (looked in {where} and {checkout}); reinstall "
        "mpnb from a wheel or sdist (`pip install mpnb-*.whl`), or `pip install -e .` from a "
        "full checkout."
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


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@dataclass
class BuildResult:
    """What happened when the kernels were (or were not) built and loaded.

    Attributes:
        loaded: the library is loaded and its kernels are registered with the dispatcher.
        reason: why not, in words (empty when loaded).
        seconds: wall time of this build and load (0 for a cached load).
        path: the library file.
        built: True when this call compiled or linked something.
        compiled: translation units compiled by this call (0 when nothing changed).
        note: what happened to a bad cached library, if anything (doctor reports it).
    """

    loaded: bool
    reason: str = ""
    seconds: float = 0.0
    path: str = ""
    built: bool = False
    compiled: int = 0
    note: str = ""


class Extension:
    """One backend's compiled kernels: built on first use, verified, loaded once.

    Args:
        backend: ``"cpu"`` (``csrc/cpu/*.cpp``).
        source_dir: the ``csrc`` directory to build from (default: :func:`csrc_dir`).
        progress: print build progress (files compiled of total, elapsed) to stderr.

    Example::

        >>> ext = Extension("cpu")
        >>> ext.available()        # builds on first use, then loads from the cache
        True
    """

    def __init__(
        self, backend: str = "cpu", source_dir: Path | None = None, progress: bool = True
    ) -> None:
        self.backend = backend
        self._source_dir = Path(source_dir) if source_dir is not None else None
        self.progress = progress
        self._lock = threading.Lock()
        self._result: BuildResult | None = None
        self._warned = False

    # -- configuration ---------------------------------------------------------------------
    def source_dir(self) -> Path:
        """The ``csrc`` directory the kernels are built from."""
        return self._source_dir if self._source_dir is not None else csrc_dir()

    def sources(self) -> list[Path]:
        """The translation units: every ``.cpp`` of ``csrc/<backend>/``, one per op family."""
        return sorted((self.source_dir() / self.backend).glob("*.cpp"))

    def _tree(self) -> list[Path]:
        root = self.source_dir()
        return sorted(p for p in (root / self.backend).rglob("*") if p.suffix in _SOURCE_SUFFIXES)

    def cflags(self) -> list[str]:
        """Compiler flags: C++20, -O3, OpenMP, and the host's own vector ISA."""
        isa = cpu_info().isa
        # -ffp-contract=off: no silent FMA contraction, so kernels round exactly like the
        # references (an explicit fmadd is used where a kernel wants one).
        flags = [
            "-std=c++20",
            "-fPIC",
            "-O3",
            "-fopenmp",
            "-ffp-contract=off",
            "-Wno-unused-function",
            *_isa_flags(isa),
        ]
        if isa != "DEFAULT" and cpu_info().arch in ("x86_64", "AMD64"):
            flags.append("-march=native")
        abi = getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", None)
        if abi is not None:
            flags.append(f"-D_GLIBCXX_USE_CXX11_ABI={int(abi)}")
        return flags

    def _includes(self) -> list[str]:
        from torch.utils import cpp_extension

        paths = list(cpp_extension.include_paths())
        py = sysconfig.get_paths().get("include")
        if py and (Path(py) / "Python.h").is_file():  # list_facts' Python entry (else left out)
            paths.append(py)
        return ["-Isrc", *(f"-isystem{p}" for p in paths)]

    def _ldflags(self) -> list[str]:
        from torch.utils import cpp_extension

        libs = [f"-L{p}" for p in cpp_extension.library_paths()]
        return ["-shared", "-fopenmp", *libs, "-lc10", "-ltorch_cpu", "-ltorch", "-ltorch_python"]

    def compiler(self) -> str:
        """The C++ compiler: ``$CXX`` or ``c++``."""
        return os.environ.get("CXX", "c++")

    def _compiler_version(self) -> str:
        try:
            out = subprocess.run(
                [self.compiler(), "--version"], capture_output=True, text=True, timeout=30
            )
            return out.stdout.splitlines()[0] if out.stdout else ""
        except (OSError, subprocess.SubprocessError):
            return ""

    def key(self) -> str:
        """A hash of everything the build file holds: the build directory's name."""
        h = hashlib.sha256()
        for part in (
            torch.__version__,
            self.compiler(),
            self._compiler_version(),
            " ".join(self.cflags()),
            " ".join(self._includes()),
            " ".join(self._ldflags()),
            cpu_info().model,
            " ".join(sorted(cpu_info().flags)),
        ):
            h.update(part.encode())
            h.update(b"\0")
        return h.hexdigest()[:16]

    def sources_key(self) -> str:
        """A hash of every source's relative name and contents (kept in the build record)."""
        h = hashlib.sha256()
        root = self.source_dir()
        for p in self._tree():
            h.update(str(p.relative_to(root)).encode())
            h.update(b"\0")
            h.update(p.read_bytes())
            h.update(b"\0")
        return h.hexdigest()[:16]

    def build_dir(self) -> Path:
        """Where this exact build lives."""
        tv = torch.__version__.replace("+", "_")
        isa = cpu_info().isa.lower()
        return cache_root() / f"{self.backend}-torch{tv}-{isa}-{self.key()}"

    def library(self) -> Path:
        """The library file of this build (it may not exist yet)."""
        return self.build_dir() / _LIB.format(backend=self.backend)

    # -- state -----------------------------------------------------------------------------
    @property
    def disabled(self) -> bool:
        """True when ``MPNB_DISABLE_EXT=1`` was set at import: the references run."""
        return DISABLED

    def is_built(self) -> bool:
        """True when a verified build for the current sources is in the cache."""
        return self._verify(self.library()) == ""

    def status(self) -> BuildResult | None:
        """The result of the last load attempt, or None if none was made in this process."""
        return self._result

    def available(self) -> bool:
        """Load (building on first use) and report whether the kernels are registered."""
        if self._result is None:
            with self._lock:
                if self._result is None:
                    self._result = self._load(force=False, verbose=False)
        if not self._result.loaded:
            self._warn_once(self._result.reason)
        return self._result.loaded

    def build(self, force: bool = False, verbose: bool = False, load: bool = True) -> BuildResult:
        """Build (with ``force`` from scratch) and, with ``load``, load the kernels now.

        A library already loaded in this process stays loaded (a process cannot unload its
        kernels); ``force`` then rebuilds the cache for the next process. ``load=False``
        builds and verifies the cache only (``loaded`` is then False and ``reason`` empty).
        """
        with self._lock:
            if self._result is not None and self._result.loaded and not force:
                return self._result
            result = self._load(force=force, verbose=verbose, load=load)
            if load and (self._result is None or not self._result.loaded):
                self._result = result
            return result

    # -- internals -------------------------------------------------------------------------
    def _missing_tools(self) -> str:
        if _ninja() is None:
            return "ninja was not found (install it with `pip install ninja`)"
        if shutil.which(self.compiler()) is None:
            return f"no C++ compiler ({self.compiler()}) on PATH (install g++ or set CXX)"
        return ""

    def _verify(self, lib: Path) -> str:
        """Empty when ``lib`` matches its recorded size and SHA-256, else what is wrong."""
        manifest = lib.with_name(lib.name + ".json")
        if not lib.is_file() or not manifest.is_file():
            return "not built"
        try:
            rec = json.loads(manifest.read_text())
            size = lib.stat().st_size
        except (OSError, ValueError) as e:
            return f"unreadable record ({e})"
        if size != rec.get("size"):
            return f"the library is {size} bytes but was built as {rec.get('size')}"
        if _sha256(lib) != rec.get("sha256"):
            return "the library's SHA-256 does not match its build record"
        if rec.get("sources") != self.sources_key():
            return "sources changed"
        return ""

    def _load(self, force: bool, verbose: bool, load: bool = True) -> BuildResult:
        if self.disabled:
            return BuildResult(False, "disabled by MPNB_DISABLE_EXT=1")
        start = time.perf_counter()
        lib, note = self.library(), ""
        problem = "forced rebuild" if force else self._verify(lib)
        if problem:  # only now is the build lock needed
            if problem not in ("not built", "forced rebuild", "sources changed"):
                note = f"the cached library was rejected ({problem}) and rebuilt"
            missing = self._missing_tools()
            if missing:
                return BuildResult(False, missing, note=note)
            try:
                built = self._build_locked(force, verbose)
            except Exception as exc:  # a failed build must never break the package
                text = str(exc).strip().splitlines()
                detail = "\n".join(text[-15:]) if text else type(exc).__name__
                why = f"the build failed: {detail}"
                if note:
                    why = f"{note.replace(' and rebuilt', '')}; {why}"
                return BuildResult(False, why, time.perf_counter() - start, str(lib), note=note)
        else:
            built = 0
        seconds = time.perf_counter() - start if built else 0.0
        if not load:
            return BuildResult(False, "", seconds, str(lib), bool(built), built, note)
        try:
            torch.ops.load_library(str(lib))
        except Exception as exc:  # noqa: BLE001 - any loader error: fall back
            return BuildResult(False, f"the library did not load: {exc}", path=str(lib))
        return BuildResult(
            True, "", seconds, str(lib), built=bool(built), compiled=built, note=note
        )

    def _build_locked(self, force: bool, verbose: bool) -> int:
        bdir = self.build_dir()
        try:
            bdir.mkdir(parents=True, exist_ok=True)
            fd = os.open(bdir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise RuntimeError(
                f"the cache {bdir} cannot be written ({e}); set MPNB_CACHE_DIR to a writable "
                "directory, or run `mpnb build-ext` once where it can be written."
            ) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            lib = self.library()
            if not force and self._verify(lib) == "":
                return 0  # another process built it while this one waited
            for stale in (lib, lib.with_name(lib.name + ".json")):
                stale.unlink(missing_ok=True)
            if force:  # from scratch: every object and the precompiled header
                for obj in (*bdir.glob("obj/*"), *bdir.glob("pch/*.gch")):
                    obj.unlink()
            return self._run_ninja(bdir, verbose)
        finally:
            os.close(fd)

    def _write_tree(self, bdir: Path) -> list[str]:
        """Copy the sources into the build directory; returns the relative unit paths.

        A file is written only when its contents differ (ninja then rebuilds what depends on
        it and nothing else); copies of files that no longer exist are removed.
        """
        root = self.source_dir()
        wanted = set()
        for p in self._tree():
            dst = bdir / "src" / p.relative_to(root)
            wanted.add(dst)
            dst.parent.mkdir(parents=True, exist_ok=True)
            data = p.read_bytes()
            if not dst.is_file() or dst.read_bytes() != data:
                dst.write_bytes(data)
        for old in (bdir / "src").rglob("*"):
            if old.is_file() and old not in wanted:
                old.unlink()
        return [str(Path("src") / p.relative_to(root)) for p in self.sources()]

    def _ninja_file(self, units: list[str]) -> str:
        pch_src = Path("src") / self.backend / "pch.h"
        has_pch = (self.source_dir() / self.backend / "pch.h").is_file()
        cflags = " ".join([*self.cflags(), *self._includes()])
        lines = [
            "ninja_required_version = 1.3",
            f"cxx = {self.compiler()}",
            f"cflags = {cflags}",
            f"ldflags = {' '.join(self._ldflags())}",
            "rule pch",
            "  command = $cxx -x c++-header $cflags -MMD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = precompiled torch headers",
            "rule compile",
            "  command = $cxx $cflags $extra -MMD -MF $out.d -c $in -o $out",
            "  depfile = $out.d",
            "  deps = gcc",
            "  description = $in",
            "rule link",
            "  command = $cxx $in $ldflags -o $out.tmp && mv -f $out.tmp $out",
            "  description = link $out",
        ]
        extra, implicit = "", ""
        if has_pch:
            # GCC uses pch/pch.h.gch for `-include pch/pch.h` when the flags match.
            lines.append(f"build pch/pch.h.gch: pch {pch_src}")
            extra, implicit = "-include pch/pch.h -Winvalid-pch", " | pch/pch.h.gch"
        objs = []
        for u in units:
            obj = f"obj/{Path(u).stem}.o"
            objs.append(obj)
            lines.append(f"build {obj}: compile {u}{implicit}")
            lines.append(f"  extra = {extra}")
        lines.append(f"build {_LIB.format(backend=self.backend)}: link {' '.join(objs)}")
        return "\n".join(lines) + "\n"

    def _run_ninja(self, bdir: Path, verbose: bool) -> int:
        sources = self.sources_key()
        units = self._write_tree(bdir)
        pch = bdir / "src" / self.backend / "pch.h"
        if pch.is_file():  # the header GCC pairs with pch/pch.h.gch (written when changed)
            (bdir / "pch").mkdir(exist_ok=True)
            copy = bdir / "pch" / "pch.h"
            if not copy.is_file() or copy.read_bytes() != pch.read_bytes():
                copy.write_bytes(pch.read_bytes())
        text = self._ninja_file(units)
        build_file = bdir / "build.ninja"
        if not build_file.is_file() or build_file.read_text() != text:
            build_file.write_text(text)
        env = {**os.environ, "NINJA_STATUS": "[%f/%t %es] "}
        jobs = str(max(1, os.cpu_count() or 1))
        cmd = [_ninja(), "-C", str(bdir), "-j", jobs, "-k", "0"] + (["-v"] if verbose else [])
        if self.progress:
            dry = subprocess.run([*cmd, "-n"], capture_output=True, text=True, env=env)
            todo = [ln for ln in dry.stdout.splitlines() if ln.startswith("[")]
            units_todo = sum(ln.rstrip().endswith(".cpp") for ln in todo)
            pch = any("precompiled" in ln for ln in todo)
            print(
                f"mpnb: compiling {units_todo} of {len(units)} {self.backend.upper()} kernel "
                f"files{' and the precompiled torch headers' if pch else ''} in {bdir} "
                f"({_estimate(units_todo, pch, _BuildPace.last())} on {os.cpu_count()} cores)",
                file=sys.stderr,
                flush=True,
            )
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
        )
        tail: list[str] = []
        pace = _BuildPace()
        for line in proc.stdout:
            line = line.rstrip()
            tail = (tail + [line])[-40:]
            if line.startswith("[") and "/" in line.split("]")[0]:
                left = pace.step(line)
                if self.progress:
                    eta = f" (about {_duration(left)} left)" if left else ""
                    print(f"mpnb: {line}{eta}", file=sys.stderr, flush=True)
            elif verbose:
                print(line, file=sys.stderr, flush=True)
        if proc.wait() != 0:
            raise RuntimeError("\n".join(tail))
        compiled = pace.steps
        pace.save()
        lib = self.library()
        rec = {
            "size": lib.stat().st_size,
            "sha256": _sha256(lib),
            "torch": torch.__version__,
            "sources": sources,
            "units": len(units),
        }
        tmp = lib.with_name(lib.name + ".json.tmp")
        tmp.write_text(json.dumps(rec))
        os.replace(tmp, lib.with_name(lib.name + ".json"))
        return compiled

    def _warn_once(self, reason: str) -> None:
        if self._warned:
            return
        self._warned = True
        warnings.warn(
            f"mpnb: the {self.backend.upper()} C++ kernels are not available ({reason}); "
            "every op runs its pure-PyTorch reference instead (correct, but slower). "
            "Run `mpnb doctor` for details and `mpnb build-ext --force` to retry.",
            ExtensionWarning,
            stacklevel=4,
        )


def _duration(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def _estimate(units: int, pch: bool, last: dict | None) -> str:
    """The opening line's time: from the last build's pace on this machine when there is one,
    else the range measured on 2-core machines (the precompiled header 17-25 s, then 3.8-10
    core-seconds per kernel file: an AVX-512 EPYC and a Zen 3 EPYC)."""
    if last is not None:
        seconds = (last["pch_s"] if pch else 0.0) + last["unit_s"] * units + 2
        return f"about {_duration(seconds)}, at the last build's pace here,"
    cores = max(1, min(os.cpu_count() or 1, max(units, 1)))
    lo = (17 if pch else 0) + 3.8 * units / cores + 2
    hi = (25 if pch else 0) + 10 * units / cores + 2
    return f"about {_duration(lo)}" if hi < 1.5 * lo else f"{_duration(lo)} to {_duration(hi)}"


class _BuildPace:
    """The build's pace, read from ninja's status lines (``[done/total elapsed]``): the time
    left after each kernel file, and, saved in the cache root, the pace of this machine's last
    build for the next first build's opening line."""

    FILE = "build-pace.json"

    def __init__(self) -> None:
        self.steps = 0
        self.units = 0
        self.pch_s: float | None = None  # when the precompiled header finished
        self.units_end = 0.0  # when the last kernel file finished
        self.total = 0

    def step(self, line: str) -> float | None:
        """Count one ninja status line; return the seconds still to go (None until known)."""
        self.steps += 1
        head, _, what = line.partition("] ")
        done, _, rest = head.lstrip("[").partition("/")
        total, _, elapsed = rest.partition(" ")
        try:
            self.total, now = int(total), float(elapsed.rstrip("s"))
        except ValueError:
            return None
        if "precompiled" in what:
            self.pch_s = now
        elif what.endswith((".cpp", ".cu")):
            self.units += 1
            self.units_end = now
            units_left = self.total - int(done) - 1  # the link is the last step
            # while one file finishes, the other jobs' files are on average half done
            in_flight = (min(os.cpu_count() or 1, units_left + 1) - 1) / 2
            per_unit = (now - (self.pch_s or 0.0)) / (self.units + in_flight)
            return per_unit * units_left + 1 if units_left > 0 else None
        return None

    @staticmethod
    def _path() -> Path:
        return cache_root() / _BuildPace.FILE

    @staticmethod
    def _machine() -> str:
        cpu = cpu_info()
        return f"{cpu.model} {cpu.isa} {os.cpu_count()} cores"

    @classmethod
    def last(cls) -> dict | None:
        """This machine's last measured pace, or None (none yet, another machine, unreadable)."""
        try:
            rec = json.loads(cls._path().read_text())
        except (OSError, ValueError):
            return None
        ok = isinstance(rec, dict) and rec.get("machine") == cls._machine()
        return rec if ok and "unit_s" in rec and "pch_s" in rec else None

    def save(self) -> None:
        """Remember this build's pace (2 or more kernel files timed; best effort)."""
        rec = self.last() or {}
        if self.pch_s is not None:
            rec["pch_s"] = self.pch_s
        if self.units < 2 or "pch_s" not in rec:
            return  # a pace is two measured numbers, never a guessed one
        rec["unit_s"] = (self.units_end - (self.pch_s or 0.0)) / self.units
        rec["machine"] = self._machine()
        try:
            tmp = self._path().with_suffix(f".{os.getpid()}.tmp")
            tmp.write_text(json.dumps(rec))
            os.replace(tmp, self._path())
        except OSError:
            pass  # an unwritable cache root costs only the next estimate


def _ninja() -> str | None:
    found = shutil.which("ninja")
    if found:
        return found
    try:  # the PyPI package puts its binary beside the module
        import ninja

        path = Path(ninja.BIN_DIR) / "ninja"
        return str(path) if path.is_file() else None
    except (ImportError, AttributeError):
        return None


_CPU = Extension("cpu")


def cpu_extension() -> Extension:
    """The process-wide handle on the CPU kernels."""
    return _CPU
