"""``mpnb.lab``: the headless experiment engine (no IPython, no widgets).

* :func:`compare`: train a workload (a built-in one, or your model factory and data) under
  O0/O1/O2/O3 or any configuration of :data:`mpnb.core.precision_configs.PRECISION_CONFIGS` (FP8
  recipes, pure bf16 with stochastic rounding or Kahan summation, and the peers torch-amp,
  tf32 and torch-amp+compile in the same round-robin) and return a DataFrame, one row per
  configuration (one speed figure with its interval, memory by role, accuracy, loss-scale
  history, host syncs per step, the code to train that way) and a :func:`verdict`.
* :class:`Plan`: the same request as one frozen value, its knobs grouped
  (:class:`WorkloadPlan`, :class:`ConfigsPlan`, :class:`TimingPlan`, :class:`OutputPlan`,
  :class:`DistributedPlan`); ``plan.run()`` is ``compare``, and
  ``dataclasses.replace(plan, ...)`` a variant of it.
* :mod:`workloads`: built-in workloads (a small GPT on generated text, a CNN and an MLP on
  digits, each small/medium/large) and :func:`workloads.custom` for your own;
  :func:`transformers_workload` adapts a Hugging Face model in one call.
* :func:`profile`: per-phase and per-module times, FLOPs, the ``torch.profiler`` op table.
* :func:`trace_overflow`, :func:`underflow_report`: which layer leaves the half range.
* :func:`gemm_shapes`, :func:`step_overhead`: GEMM sizes tensor cores dislike, and whether a
  step is bound by overhead that half precision cannot shrink.
* :func:`trace_precision`: which dtype every op of a step ran in, and why.
* :func:`quant_stats`: per-layer quantization statistics (underflow, saturation, error,
  scale inverses, dynamic range) of one step, or what a format would do to it (``what_if``).
* :func:`report`: one self-contained offline HTML page from a :func:`compare` DataFrame.
* :mod:`story`: every hardware sentence the notebooks and the verdict print, computed from
  doctor's facts and the measured numbers.

Example::

    >>> import mpnb.lab
    >>> df = mpnb.lab.compare("transformer", configs=("O0", "O2"))
    >>> print(df.attrs["verdict"]["text"])
    >>> mpnb.lab.report(df, "report.html")
    >>> from dataclasses import replace
    >>> plan = mpnb.lab.Plan(mpnb.lab.WorkloadPlan("mlp"), mpnb.lab.ConfigsPlan(("O0", "O2")))
    >>> df = plan.run()  # == mpnb.lab.compare("mlp", configs=("O0", "O2"))
    >>> df1 = replace(plan, timing=mpnb.lab.TimingPlan(seed=1)).run()  # another seed
"""

from __future__ import annotations

import importlib
import sys
import types

# Public names and the module that defines each, imported on first use (PEP 562) so that
# `import mpnb.lab.bench` (and `mpnb bench --list`) does not import pandas or plotly.
_LAZY = {
    "compare": "runner",
    "Plan": "runner",
    "WorkloadPlan": "runner",
    "ConfigsPlan": "runner",
    "TimingPlan": "runner",
    "OutputPlan": "runner",
    "DistributedPlan": "runner",
    "hardware_summary": "machine",
    "verdict": "verdict",
    "accuracy": "workloads",
    "transformers_workload": "hf",
    "torch_threads": "stats",
    "RunConfig": "config",
    "LossScaleRule": "config",
    "MemoryTracker": "memory",
    "profile": "profiling",
    "trace_overflow": "diagnosis",
    "underflow_report": "diagnosis",
    "gemm_shapes": "troubleshoot",
    "step_overhead": "troubleshoot",
    "report": "html_report",
    "trace_precision": "precision_trace",
    "sweep_kept": "keep_sweep",
    "quant_stats": "quant_stats",
}

__all__ = [*_LAZY, "workloads", "story"]


def __getattr__(name: str):
    if name in ("workloads", "story"):
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY:
        value = getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'mpnb.lab' has no attribute {name!r}")


class _Lab(types.ModuleType):
    """``mpnb.lab``'s module type. A function named as its own module (``verdict``,
    ``quant_stats``) stays the package's attribute once the module is loaded: the import system
    binds a loaded submodule to its package (``mpnb.lab.verdict = <module>``), which would hide
    the function from ``mpnb.lab.verdict(df)``; a property of the type keeps the function.
    (``importlib.import_module("mpnb.lab.verdict")`` is the module.)"""


def _function_named_as_its_module(name: str) -> property:
    def get(module: types.ModuleType):
        fn = module.__dict__.get(f"_{name}_function")
        if fn is None:
            fn = getattr(importlib.import_module(f"{__name__}.{name}"), name)
            module.__dict__[f"_{name}_function"] = fn
        return fn

    def put(module: types.ModuleType, value) -> None:
        # the import system binding the submodule is ignored; anything else replaces the name
        if not isinstance(value, types.ModuleType):
            module.__dict__[f"_{name}_function"] = value

    return property(get, put, doc=f"mpnb.lab.{name}.{name}")


for _name in [n for n, m in _LAZY.items() if n == m]:
    setattr(_Lab, _name, _function_named_as_its_module(_name))
sys.modules[__name__].__class__ = _Lab
