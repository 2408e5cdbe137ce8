"""Benchmark suites found on disk: ``mpnb/lab/bench/<name>.py`` is suite ``<name>``.

Listing reads each module's docstring with :mod:`ast` and imports nothing (not even torch),
so ``mpnb bench --list`` is instant; a suite is imported only when it runs.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path
from types import ModuleType

__all__ = ["suites", "load_suite"]

_HERE = Path(__file__).parent
_PACKAGE = __name__.rpartition(".")[0]


def suites() -> dict[str, str]:
    """``{suite name: one-line description}``; module ``multi_tensor`` is suite ``multi-tensor``."""
    out = {}
    for mod in sorted(pkgutil.iter_modules([str(_HERE)]), key=lambda m: m.name):
        if mod.name.startswith("_") or mod.ispkg:
            continue
        try:
            doc = ast.get_docstring(ast.parse((_HERE / f"{mod.name}.py").read_text())) or ""
        except (OSError, SyntaxError):
            doc = ""
        out[mod.name.replace("_", "-")] = (doc.strip().splitlines() or [""])[0]
    return out


def load_suite(name: str) -> ModuleType:
    """Import suite ``name``; a ``KeyError`` naming the known suites when there is none."""
    known = suites()
    if name not in known:
        raise KeyError(f"no benchmark suite {name!r}; known suites: {', '.join(known) or 'none'}.")
    module = importlib.import_module(f"{_PACKAGE}.{name.replace('-', '_')}")
    if not callable(getattr(module, "cases", None)):
        raise KeyError(f"suite {name!r} ({module.__name__}) defines no cases(opts) function.")
    return module
