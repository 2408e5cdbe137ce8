"""``mpnb.widgets``: ipywidgets + plotly views over :mod:`mpnb.lab` (and :mod:`mpnb.core`).

Widgets hold state in traitlets, build their figures once and update them in place, and show
callback errors in the widget. They never measure or train themselves: every number comes from
:mod:`mpnb.lab` (or, for :class:`ScalerExplorer`, from :mod:`mpnb.core`'s scaler update).

Example::

    >>> from mpnb import widgets
    >>> w = widgets.compare("mlp", configs=("O0", "O1", "O2"), steps=20)   # shows the widget
    >>> w.run()                                                               # or click Run
    >>> w.df                                                                  # the DataFrame
"""

from __future__ import annotations

import importlib

_LAZY = {
    "ScalerExplorer": "scaler_explorer",
    "CompareWidget": "compare_widget",
    "compare": "compare_widget",
    "ProfileWidget": "profile_widget",
    "profile": "profile_widget",
}

__all__ = list(_LAZY)


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(__all__)
