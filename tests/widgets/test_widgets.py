"""mpnb.widgets: the package's lazy names (importing it imports no widget library)."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest


def test_importing_the_package_imports_neither_ipywidgets_nor_plotly():
    code = (
        "import sys, mpnb.widgets as w; "
        "print(sorted(m for m in ('ipywidgets', 'plotly') if m in sys.modules)); print(dir(w))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.splitlines()
    assert out[0] == "[]"
    assert out[1] == str(
        sorted(["CompareWidget", "ProfileWidget", "ScalerExplorer", "compare", "profile"])
    )


@pytest.mark.parametrize(
    "name, module",
    [
        ("ScalerExplorer", "scaler_explorer"),
        ("CompareWidget", "compare_widget"),
        ("compare", "compare_widget"),
        ("ProfileWidget", "profile_widget"),
        ("profile", "profile_widget"),
    ],
)
def test_each_lazy_name_is_its_modules_object(name, module):
    pytest.importorskip("ipywidgets")
    widgets = importlib.import_module("mpnb.widgets")
    target = importlib.import_module(f"mpnb.widgets.{module}")
    assert getattr(widgets, name) is getattr(target, name)
    assert name in widgets.__all__


def test_an_unknown_name_is_an_attribute_error_naming_it():
    widgets = importlib.import_module("mpnb.widgets")
    with pytest.raises(AttributeError, match="no_such_widget"):
        widgets.no_such_widget  # noqa: B018
