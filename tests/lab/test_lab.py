"""``mpnb.lab``: each public name is its defining module's object, imported on first use, so
that importing the package (and ``mpnb.lab.bench``) stays free of pandas and plotly."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import mpnb.lab

#: public names spelled as the submodule that defines them (see the test after the next)
_SHADOWED = ("verdict", "quant_stats")


def test_every_public_name_is_the_object_of_the_module_that_defines_it():
    assert set(mpnb.lab.__all__) == {*mpnb.lab._LAZY, "workloads", "story"}
    assert {n for n, m in mpnb.lab._LAZY.items() if n == m} == set(_SHADOWED)
    for name, module in mpnb.lab._LAZY.items():
        if name in _SHADOWED:
            continue
        defining = importlib.import_module(f"mpnb.lab.{module}")
        assert getattr(mpnb.lab, name) is getattr(defining, name), name
        ns: dict = {}
        exec(f"from mpnb.lab import {name}", ns)  # noqa: S102
        assert ns[name] is getattr(defining, name)
    assert mpnb.lab.workloads is importlib.import_module("mpnb.lab.workloads")
    assert mpnb.lab.story is importlib.import_module("mpnb.lab.story")


def test_an_unknown_name_is_an_attribute_error_naming_it():
    with pytest.raises(AttributeError, match="'no_such_tool'"):
        mpnb.lab.no_such_tool  # noqa: B018
    assert not hasattr(mpnb.lab, "runner_compare")


@pytest.mark.parametrize("module", ["mpnb.lab", "mpnb.lab.bench"])
def test_importing_the_package_loads_no_pandas_or_plotly(module):
    code = (
        f"import sys, {module}; print(sorted(m for m in ('pandas', 'plotly') if m in sys.modules))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_a_name_is_imported_once_then_cached_in_the_package():
    from mpnb.lab import runner

    value = mpnb.lab.compare
    assert mpnb.lab.__dict__["compare"] is value is runner.compare


@pytest.mark.parametrize("name", _SHADOWED)
def test_a_name_spelled_as_its_module_is_the_function_after_the_module_loaded(name):
    code = (
        f"import mpnb.lab, mpnb.lab.{name}; "
        f"print(callable(mpnb.lab.{name}) and not isinstance(mpnb.lab.{name}, type(mpnb)))"
    )
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "True"
