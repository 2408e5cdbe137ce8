"""The just-in-time build: verified loads, a shared cache, incremental rebuilds, failures.

Most cases build a tiny source tree of their own into a temporary cache (seconds), never the
user's cache. One case takes a copy of the real build and truncates its library: the process
must not die (SIGBUS) and the op must still run.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest

from mpnb.core.ops._build import (
    Extension,
    ExtensionWarning,
    _BuildPace,
    _estimate,
    csrc_dir,
)

ROOT = Path(__file__).resolve().parents[3]

_UNIT = 'extern "C" int {name}() {{ return {value}; }}\n'


def _tree(root: Path, values=(1, 2)) -> Path:
    """A csrc/ with a tiny precompiled header and one unit per value."""
    cpu = root / "cpu"
    cpu.mkdir(parents=True)
    (cpu / "pch.h").write_text("#pragma once\n#include <cstdint>\n")
    for i, v in enumerate(values):
        (cpu / f"unit{i}.cpp").write_text(_UNIT.format(name=f"mpnb_test_unit{i}", value=v))
    return root


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MPNB_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_key_names_the_configuration_not_the_sources(tmp_path, cache, monkeypatch):
    a = Extension("cpu", _tree(tmp_path / "a"))
    b = Extension("cpu", _tree(tmp_path / "b", values=(3, 4)))
    assert a.key() == b.key() and a.build_dir() == b.build_dir()
    assert a.sources_key() != b.sources_key()
    assert str(a.build_dir()).startswith(str(cache))
    before = a.key()
    monkeypatch.setattr(Extension, "cflags", lambda self: ["-O0"])
    assert a.key() != before


def test_build_records_size_and_hash_and_loads(tmp_path, cache):
    ext = Extension("cpu", _tree(tmp_path / "src"), progress=False)
    result = ext.build()
    assert result.loaded and result.built, result.reason
    rec = json.loads((ext.library().parent / "mpnb_cpu.so.json").read_text())
    assert rec["size"] == ext.library().stat().st_size and len(rec["sha256"]) == 64
    assert rec["sources"] == ext.sources_key()
    text = (ext.build_dir() / "build.ninja").read_text()
    assert str(tmp_path / "src") not in text  # relative paths only: any checkout shares it


def test_two_checkouts_of_the_same_sources_share_one_build(tmp_path, cache):
    first = Extension("cpu", _tree(tmp_path / "one"), progress=False)
    assert first.build().compiled > 0
    for _ in range(2):  # alternate: neither rebuilds
        for path in ("two", "one"):
            if not (tmp_path / path).exists():
                _tree(tmp_path / path)
            ext = Extension("cpu", tmp_path / path, progress=False)
            result = ext.build()
            assert result.loaded and not result.built, (path, result)


def test_changing_one_kernel_file_recompiles_that_file_only(tmp_path, cache):
    src = _tree(tmp_path / "src", values=(1, 2, 3))
    assert Extension("cpu", src, progress=False).build().loaded
    (src / "cpu" / "unit1.cpp").write_text(_UNIT.format(name="mpnb_test_unit1", value=20))
    result = Extension("cpu", src, progress=False).build()
    assert result.loaded and result.compiled == 2, result  # unit1.cpp and the link


def test_a_first_build_says_what_it_compiles_and_shows_progress(tmp_path, cache, capfd):
    src = _tree(tmp_path / "src", values=(1, 2))
    assert Extension("cpu", src, progress=True).build(load=False).built
    err = capfd.readouterr().err
    assert re.search(r"mpnb: compiling 2 of 2 CPU kernel files .* \(.+ on \d+ cores\)", err)
    steps = re.findall(r"^mpnb: \[(\d+)/(\d+) [\d.]+s\] ", err, re.M)  # [k/n elapsed] file
    assert steps and steps[-1][0] == steps[-1][1], err
    # after the first kernel file, the time left at its pace (one file and the link to go)
    assert re.search(r"^mpnb: \[\d+/4 [\d.]+s\] \S+unit\d\.cpp \(about \d+ s left\)$", err, re.M)


def test_the_next_first_build_is_estimated_at_this_machines_pace(tmp_path, cache, capfd):
    src = _tree(tmp_path / "src", values=(1, 2, 3))
    Extension("cpu", src, progress=True).build(load=False)
    pace = json.loads((cache / _BuildPace.FILE).read_text())
    assert pace["machine"] == _BuildPace._machine()
    assert 0 < pace["pch_s"] < 60 and 0 < pace["unit_s"] < 30  # tiny files: seconds at most
    capfd.readouterr()
    Extension("cpu", src, progress=True).build(load=False, force=True)
    assert "last build's pace" in capfd.readouterr().err
    (cache / _BuildPace.FILE).write_text(json.dumps({**pace, "machine": "another CPU"}))
    assert _BuildPace.last() is None  # another machine's pace says nothing of this one


def test_a_pace_without_a_timed_header_is_not_saved(cache):
    cache.mkdir()
    pace = _BuildPace()
    for line in ("[1/3 2.0s] src/cpu/a.cpp", "[2/3 4.0s] src/cpu/b.cpp", "[3/3 4.1s] link x.so"):
        pace.step(line)
    pace.save()  # the header was not rebuilt and no earlier build timed it: nothing to save
    assert pace.units == 2 and not (cache / _BuildPace.FILE).exists()


def test_first_build_estimates():
    # no build timed here yet: the range measured on 2-core machines
    two = _estimate(16, True, None) if os.cpu_count() == 2 else None
    assert two in (None, "49 s to 2 min")
    assert _estimate(2, False, {"pch_s": 20.0, "unit_s": 4.0}) == (
        "about 10 s, at the last build's pace here,"
    )
    assert _estimate(16, True, {"pch_s": 17.0, "unit_s": 2.0}) == (
        "about 51 s, at the last build's pace here,"
    )


def test_truncated_library_is_rebuilt_never_loaded(tmp_path, cache):
    src = _tree(tmp_path / "src")
    ext = Extension("cpu", src, progress=False)
    # Built, not loaded: truncating a library mapped into this process would kill it.
    assert ext.build(load=False).built
    lib = ext.library()
    size = lib.stat().st_size
    os.truncate(lib, size // 2)  # the ELF header survives: mapping it would SIGBUS
    fresh = Extension("cpu", src, progress=False)
    assert not fresh.is_built()
    result = fresh.build()
    assert result.loaded and result.built and "rejected" in result.note, result
    assert "bytes but was built as" in result.note
    assert lib.stat().st_size == size and fresh.is_built()


def test_valid_build_loads_without_the_build_lock(tmp_path, cache, monkeypatch):
    src = _tree(tmp_path / "src")
    assert Extension("cpu", src, progress=False).build().loaded

    def refuse(*args, **kwargs):
        raise PermissionError("read-only cache")

    monkeypatch.setattr(fcntl, "flock", refuse)
    real_open = os.open
    monkeypatch.setattr(
        os,
        "open",
        lambda p, *a, **k: refuse() if str(p).endswith(".lock") else real_open(p, *a, **k),
    )
    result = Extension("cpu", src, progress=False).build()
    assert result.loaded and not result.built, result


def test_corrupt_library_in_an_unwritable_cache_falls_back_with_one_warning(
    tmp_path, cache, monkeypatch
):
    src = _tree(tmp_path / "src")
    ext = Extension("cpu", src, progress=False)
    assert ext.build(load=False).built  # never truncate a library this process has mapped
    os.truncate(ext.library(), 100)
    real_open = os.open

    def no_lock(p, *a, **k):
        if str(p).endswith(".lock"):
            raise PermissionError(13, "Permission denied", str(p))
        return real_open(p, *a, **k)

    monkeypatch.setattr(os, "open", no_lock)
    fresh = Extension("cpu", src, progress=False)
    with pytest.warns(ExtensionWarning, match="cannot be written") as caught:
        assert fresh.available() is False
    assert "rejected" in str(caught[0].message) or "bytes but was built" in str(caught[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert fresh.available() is False  # warned once only


def test_failed_build_reports_the_compiler_error_and_warns_once(tmp_path, cache):
    src = _tree(tmp_path / "src")
    (src / "cpu" / "bad.cpp").write_text("this is not C++;\n")
    ext = Extension("cpu", src, progress=False)
    result = ext.build()
    assert not result.loaded
    assert "build failed" in result.reason and "bad.cpp" in result.reason
    with pytest.warns(ExtensionWarning, match="pure-PyTorch reference"):
        assert ext.available() is False
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ext.available() is False


_REAL_TRUNCATED = r"""
import torch
from mpnb.core.ops import cpu_extension, multi_tensor_scale, op_path
f = torch.zeros(1, dtype=torch.int32)
src = [torch.tensor([1.0, 2.0]).bfloat16()]; dst = [torch.empty(2)]
multi_tensor_scale(f, src, dst, 0.5)
status = cpu_extension().status()
assert dst[0].tolist() == [0.5, 1.0] and f.item() == 0
assert status.loaded and "rejected" in status.note, status
print(op_path("multi_tensor_scale"))
"""


@pytest.mark.slow
def test_real_truncated_library_never_kills_the_process(kernels, tmp_path):
    """A copy of the real build, its library truncated: the op runs (relinked), no SIGBUS."""
    from mpnb.core.ops import cpu_extension

    real = cpu_extension().build_dir()
    copy = tmp_path / "cache" / real.name
    shutil.copytree(real, copy, ignore=shutil.ignore_patterns(".lock"))
    lib = copy / "mpnb_cpu.so"
    os.truncate(lib, lib.stat().st_size // 2)
    env = {**os.environ, "MPNB_CACHE_DIR": str(tmp_path / "cache")}
    env.pop("MPNB_DISABLE_EXT", None)
    out = subprocess.run(
        [sys.executable, "-c", _REAL_TRUNCATED],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, (out.returncode, out.stderr[-3000:])
    assert "C++ kernel" in out.stdout


_NO_COMPILER = r"""
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    from mpnb.core.ops import multi_tensor_scale
    f = torch.zeros(1, dtype=torch.int32)
    src = [torch.tensor([1.0, 2.0]).bfloat16()]; dst = [torch.empty(2)]
    multi_tensor_scale(f, src, dst, 0.5)
    multi_tensor_scale(f, src, dst, 0.5)
ext_warnings = [w for w in caught if "C++ kernels are not available" in str(w.message)]
assert len(ext_warnings) == 1, [str(w.message) for w in caught]
assert "no C++ compiler" in str(ext_warnings[0].message), str(ext_warnings[0].message)
assert dst[0].tolist() == [0.5, 1.0] and f.item() == 0
print("ok")
"""


def test_missing_compiler_imports_warns_once_and_falls_back(tmp_path):
    env = {**os.environ, "CXX": "/nonexistent/c++", "MPNB_CACHE_DIR": str(tmp_path)}
    env.pop("MPNB_DISABLE_EXT", None)
    out = subprocess.run(
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


_DISABLED = r"""
import os, torch
import mpnb.core.ops as ops
from mpnb.core.ops import cpu_extension
assert cpu_extension().disabled
os.environ["MPNB_DISABLE_EXT"] = "0"          # read once, at import: no effect now
assert cpu_extension().disabled and not ops.ensure_kernels()
print(ops.op_path("multi_tensor_scale"))
f = torch.zeros(1); dst = [torch.empty(2)]
ops.multi_tensor_scale(f, [torch.tensor([1.0, float("inf")])], dst, 2.0)
assert f.item() == 1 and dst[0][0].item() == 2.0
"""


def test_disable_ext_is_read_once_at_import(tmp_path):
    env = {**os.environ, "MPNB_DISABLE_EXT": "1", "MPNB_CACHE_DIR": str(tmp_path)}
    out = subprocess.run(
        [sys.executable, "-c", _DISABLED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "reference (MPNB_DISABLE_EXT=1)" in out.stdout
    assert not any(Path(tmp_path).iterdir())  # nothing was built


def test_sources_are_found():
    root = csrc_dir()
    assert (root / "cpu" / "scale.cpp").is_file() and (root / "cpu" / "pch.h").is_file()


_FROM_WHEEL = r"""
import mpnb
from mpnb.core.ops._build import Extension, csrc_dir
print(mpnb.__file__)
print(csrc_dir())
print(Extension("cpu").sources_key())
"""


@pytest.mark.slow
def test_wheel_ships_the_cpp_sources_and_finds_them_installed(tmp_path):
    """A non-editable install must find csrc/: the wheel carries it as mpnb/_csrc, and the
    installed package resolves it to a real directory (not a namespace MultiplexedPath)."""
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-deps",
        "--no-build-isolation",
        "-q",
        "-w",
        str(tmp_path),
        str(ROOT),
    ]
    out = subprocess.run(cmd, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("mpnb-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    expected = {
        f"mpnb/_csrc/{p.relative_to(ROOT / 'csrc')}"
        for p in (ROOT / "csrc").rglob("*")
        if p.suffix in {".cpp", ".h"}
    }
    assert expected and expected <= names, sorted(expected - names)
    site = tmp_path / "site"  # the wheel unpacked: an install's layout, outside the checkout
    zipfile.ZipFile(wheel).extractall(site)
    run = tmp_path / "elsewhere"
    run.mkdir()
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run(
        [sys.executable, "-c", _FROM_WHEEL],
        cwd=run,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    module, sources, key = out.stdout.split()
    assert Path(module).parent == site / "mpnb"
    assert Path(sources) == site / "mpnb" / "_csrc"
    assert key == Extension("cpu").sources_key()  # the same sources: the same build


def test_doctor_lists_every_op_and_the_hardware(kernels):
    from mpnb.core.doctor import report
    from mpnb.core.ops import all_ops
    from mpnb.core.ops import triton as _triton

    text = report(build=False)
    lines = {ln.split(" -> ")[0].strip(): ln for ln in text.splitlines() if " -> " in ln}
    for info in all_ops():
        line = lines[f"{info.family}: {info.name}"]
        cpu, cuda = line.split(" -> ")[1].split(" | ")  # the path on each device
        assert cpu and cuda, line
        if "MPNB_TRITON" not in os.environ:  # the Triton kernel's measured decision, if any
            if info.name in _triton.LAUNCHERS:
                assert _triton.decision(info.name).label in cuda, line
            else:
                assert "Triton" not in cuda, line
            expected = "PyTorch's fused CUDA ops" if info.torch_path else "reference"
            assert cuda.startswith(expected), line
    assert "bf16 on CPU: " in text and "fp16 on CPU: " in text and "vector ISA" in text
    assert "fp8 on CPU: " in text and "x fp32's GEMM speed" in text
    assert "library verified" in text
    assert f"C++ sources: {csrc_dir()}" in text and "FELL BACK" not in text
