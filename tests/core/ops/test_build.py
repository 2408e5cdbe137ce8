"""The just-in-time build: cache key, a failed or impossible build, and packaging of csrc/."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from mpnb.core.ops._build import Extension, csrc_dir

ROOT = Path(__file__).resolve().parents[3]


def test_key_depends_on_sources_and_flags(tmp_path, monkeypatch):
    ext = Extension("cpu")
    k1 = ext.key()
    assert k1 == ext.key()  # stable
    monkeypatch.setattr(Extension, "cflags", lambda self: ["-O0"])
    assert ext.key() != k1
    monkeypatch.setenv("MPNB_CACHE_DIR", str(tmp_path))
    assert str(ext.build_dir()).startswith(str(tmp_path))


def test_failed_build_reports_the_compiler_error(tmp_path, monkeypatch):
    bad = tmp_path / "bad.cpp"
    bad.write_text("this is not C++;\n")
    monkeypatch.setenv("MPNB_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("MPNB_DISABLE_EXT", raising=False)
    ext = Extension("cpu")
    monkeypatch.setattr(Extension, "sources", lambda self: [bad])
    result = ext.build()
    assert not result.loaded
    assert "build failed" in result.reason and "bad.cpp" in result.reason
    with pytest.warns(UserWarning, match="pure-PyTorch reference"):
        assert ext.available() is False
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ext.available() is False  # warned once only


_NO_COMPILER = r"""
import warnings, torch
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    import mpnb, mpnb.amp_C as A
    from mpnb.core.ops import cpu_extension
    f = torch.zeros(1, dtype=torch.int32)
    src = [torch.tensor([1.0, 2.0]).bfloat16()]; dst = [torch.empty(2)]
    A.multi_tensor_scale(0, f, [src, dst], 0.5)
    A.multi_tensor_scale(0, f, [src, dst], 0.5)
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
        [sys.executable, "-c", _NO_COMPILER], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_sources_are_found():
    root = csrc_dir()
    assert (root / "cpu" / "mpnb_cpu.cpp").is_file()


@pytest.mark.slow
def test_wheel_ships_the_cpp_sources(tmp_path):
    """A non-editable install must find csrc/: the wheel carries it as mpnb/_csrc."""
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
        if p.suffix in {".cpp", ".h", ".cu", ".cuh"}
    }
    assert expected and expected <= names, sorted(expected - names)


def test_doctor_lists_every_op_family_and_the_hardware(kernels):
    import pkgutil

    import mpnb.core.ops as ops_pkg
    from mpnb.core.doctor import report
    from mpnb.core.ops import all_ops

    text = report(build=False)
    modules = pkgutil.iter_modules(ops_pkg.__path__)
    families = {m.name for m in modules if not m.name.startswith("_")}
    assert {"multi_tensor", "optimizers", "optimizers_lamb", "norm_ops", "welford"} <= families
    names = [info.name for info in all_ops()]
    assert {"fused_lamb_", "fused_novograd_", "bias_act_bwd", "multi_tensor_scale"} <= set(names)
    for name in names:
        assert f": {name} -> " in text, name
    assert "bf16 on CPU: " in text and "fp16 on CPU: " in text and "vector ISA" in text
