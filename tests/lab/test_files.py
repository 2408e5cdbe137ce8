"""One check for every output path of the lab, before any work: a directory, a missing parent,
a file in the way and a read-only place are refused, naming the path; writes are atomic."""

from __future__ import annotations

import os

import pandas as pd
import pytest

import mpnb.lab
from mpnb.lab._files import check_writable, unwritable_reason, write_atomic


def _read_only(monkeypatch, where):
    """``where`` reads as not writable (root, as in CI containers, ignores mode bits)."""
    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if str(p) == str(where) else real(p, mode)
    )


@pytest.mark.parametrize(
    "make, says",
    [
        (lambda t: t, "is a directory"),
        (lambda t: t / "missing" / "out.json", "does not exist; create it first"),
        (lambda t: t / "a_file" / "out.json", "is a file, so"),
        (lambda t: t / "a_file" / "deeper" / "out.json", "is a file, so"),
    ],
    ids=["directory", "missing-parent", "file-parent", "file-ancestor"],
)
def test_check_writable_refuses_a_bad_path_naming_it(tmp_path, make, says):
    (tmp_path / "a_file").write_text("x")
    bad = make(tmp_path)
    with pytest.raises(ValueError, match=says) as e:
        check_writable(bad, "--json", "rows.json")
    assert str(bad) in str(e.value) and "--json" in str(e.value)
    assert not (tmp_path / "missing").exists()  # nothing was created


def test_check_writable_refuses_a_read_only_directory(tmp_path, monkeypatch):
    _read_only(monkeypatch, tmp_path)
    assert "is not writable" in unwritable_reason(tmp_path / "out.json")
    with pytest.raises(ValueError, match="not writable"):
        check_writable(tmp_path / "out.json")
    assert check_writable(tmp_path.parent / "x.json")  # elsewhere: fine


def test_write_atomic_names_the_file_not_its_temporary(tmp_path):
    """A missing directory failed with a raw error naming '.out.json.xyz.part'."""
    target = tmp_path / "missing" / "out.json"
    with pytest.raises(OSError, match="could not write") as e:
        write_atomic(target, "{}")
    assert str(target) in str(e.value) and ".part" not in str(e.value)
    assert "create it first" in str(e.value)


def _df():
    return pd.DataFrame({"configuration": ["O0"], "error": [""], "metric_name": [""]})


@pytest.mark.parametrize("where", ["missing", "read-only", "directory"])
def test_report_refuses_a_bad_path_before_building_the_page(tmp_path, monkeypatch, where):
    """lab.report into a missing or read-only directory raised a raw pathlib/OSError naming a
    '.part' temporary file, after the page was built."""
    path = {"missing": tmp_path / "no" / "r.html", "directory": tmp_path}.get(
        where, tmp_path / "r.html"
    )
    if where == "read-only":
        _read_only(monkeypatch, tmp_path)
    with pytest.raises(ValueError, match="report") as e:
        mpnb.lab.report(_df(), path)  # refused before the figures: _df() could not draw them
    assert str(path) in str(e.value) and ".part" not in str(e.value)
    assert os.listdir(tmp_path) == []
