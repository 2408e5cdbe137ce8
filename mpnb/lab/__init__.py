"""``mpnb.lab``: the headless experiment engine (no IPython, no widgets).

* :func:`compare`: train a workload under O0/O1/O2/O3 and return a DataFrame, one row per
  configuration (speed, memory breakdown, accuracy, loss-scale history).
* :mod:`workloads`: built-in workloads (digits MLP/CNN, a tiny Transformer LM) and
  :func:`workloads.custom` for your own.
* :func:`profile`: per-phase and per-module times, FLOPs, the ``torch.profiler`` op table.
* :func:`trace_overflow`, :func:`underflow_report`: which layer leaves the half range.
* :func:`trace_precision`: which dtype every op of a step ran in, and why.
* :func:`report`: one self-contained offline HTML page from a :func:`compare` DataFrame.

Example::

    >>> import mpnb.lab
    >>> df = mpnb.lab.compare("mlp", opt_levels=("O0", "O2"), steps=60)
    >>> mpnb.lab.report(df, "report.html")
"""

from __future__ import annotations

import importlib

# Public names and the module that defines each, imported on first use (PEP 562) so that
# `import mpnb.lab.bench` (and `mpnb bench --list`) does not import pandas or plotly.
_LAZY = {
    "compare": "runner",
    "hardware_summary": "runner",
    "RunConfig": "config",
    "LossScaleSpec": "config",
    "MemoryTracker": "memory",
    "profile": "profiling",
    "trace_overflow": "diagnosis",
    "underflow_report": "diagnosis",
    "report": "html_report",
    "trace_precision": "precision",
}

__all__ = [*_LAZY, "workloads"]


def __getattr__(name: str):
    if name == "workloads":
        return importlib.import_module(f"{__name__}.workloads")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpnb.lab' has no attribute {name!r}")
