"""The migration report: ``python -m mpnb.apex --check SCRIPT`` lists the Apex names a script uses.

The script is parsed with :mod:`ast`, never run. Every Apex name it reaches (imports, attribute
chains on imported Apex modules, ``importlib.import_module("amp_C")``) is looked up in the
table of :mod:`mpnb.compat.names` and in the mpnb module that stands for it, giving one row per
name: whether mpnb **provides** it, **emulates** it, or **lacks** it, where it lives in mpnb,
and what to write instead when porting to ``torch.amp`` / plain PyTorch. CUDA-only calls
(``.cuda()``, ``torch.cuda.*``, ``device="cuda"``, the ``nccl`` backend) are listed too: on a
machine without a GPU such a script runs under ``python -m mpnb.apex --cpu``.

Example::

    >>> report = check_script("train.py")
    >>> [(r.name, r.status) for r in report.names][:2]
    [('apex.amp', 'provides'), ('apex.amp.initialize', 'provides')]
    >>> print(format_report(report))
"""

from __future__ import annotations

import ast
import importlib
import json
import os
from dataclasses import asdict, dataclass, field

from mpnb.compat._scan import Scanner, local_module, read_source
from mpnb.compat.names import EMULATES, LACKS, MODULES, NAMES, PRIVATE, PROVIDES

__all__ = ["NameReport", "CheckReport", "check_script", "resolve", "format_report", "report_json"]


Where = int | str  # a line of the script, or "module.py:line" in one of its local modules


@dataclass(frozen=True)
class NameReport:
    """One Apex name a script uses.

    Attributes:
        name: the Apex name (``"apex.amp.initialize"``).
        status: ``provides``, ``emulates`` or ``lacks``.
        mpnb: where it lives in mpnb (None when lacking).
        port: the ``torch.amp`` / PyTorch equivalent.
        note: what differs from Apex, or why it is missing.
        lines: the script lines that use it.
        elsewhere: its uses in the script's local modules, as ``"module.py:line"``.
    """

    name: str
    status: str
    mpnb: str | None
    port: str
    note: str
    lines: tuple[int, ...]
    elsewhere: tuple[str, ...] = ()


@dataclass(frozen=True)
class PrivateUse:
    """A write to (or call of) an Apex internal, such as ``loss_scaler._scale_seq_len = 64``.

    Attributes:
        key: its entry in :data:`mpnb.compat.names.PRIVATE`.
        status: ``provides``, ``emulates`` or ``lacks``.
        what: the Apex object it belongs to.
        mpnb: what the write or call does in mpnb.
        port: what to write instead.
        code: the source of its first use.
        where: its uses (script lines, or ``"module.py:line"``).
    """

    key: str
    status: str
    what: str
    mpnb: str
    port: str
    code: str
    where: tuple[Where, ...]


@dataclass
class CheckReport:
    """Everything ``--check`` found in one script and the local modules it imports.

    Attributes:
        script: the path as given.
        names: one :class:`NameReport` per Apex name, in order of first use.
        cuda_only: each CUDA-only call found (``".cuda()"``, ``'backend="nccl"'``...) and where.
        private: the Apex internals the code writes or calls, one :class:`PrivateUse` each.
        modules: the script's local modules that were read too (paths relative to its
            directory), in the order they were found.
    """

    script: str
    names: list[NameReport] = field(default_factory=list)
    cuda_only: dict[str, list[Where]] = field(default_factory=dict)
    private: list[PrivateUse] = field(default_factory=list)
    modules: list[str] = field(default_factory=list)

    def count(self, status: str) -> int:
        """How many names have ``status``."""
        return sum(r.status == status for r in self.names)

    def lacking(self) -> int:
        """Names and private uses mpnb lacks: a nonzero count fails ``--check``."""
        return self.count(LACKS) + sum(p.status == LACKS for p in self.private)


def _module_of(name: str) -> tuple[str | None, str | None]:
    """The longest table module that ``name`` starts with, and the attribute after it."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        mod = ".".join(parts[:i])
        if mod in MODULES:
            return mod, (parts[i] if i < len(parts) else None)
    return None, None


def _has(module_name: str, attr: str) -> bool:
    module = importlib.import_module(module_name)
    return attr in dir(module) or hasattr(module, attr)


def _entry(mod: str, attr: str | None):
    """The :data:`NAMES` entry of ``mod.attr``, also when the script reaches the attribute
    through a submodule (``apex.optimizers.fused_lamb.FusedLAMB``: the entry of
    ``apex.optimizers.FusedLAMB``)."""
    if attr is None:
        return NAMES.get(mod)
    parts = mod.split(".")
    for i in range(len(parts), 0, -1):
        entry = NAMES.get(".".join([*parts[:i], attr]))
        if entry is not None:
            return entry
    return None


def resolve(name: str) -> tuple[str, str, str | None, str, str]:
    """``(apex name, status, mpnb location, port, note)`` for one Apex name (normalized to a
    module, or a module and one attribute)."""
    mod, attr = _module_of(name)
    if mod is None:
        return name, LACKS, None, "no equivalent known", "not an Apex name mpnb knows"
    row = MODULES[mod]
    full = mod if attr is None else f"{mod}.{attr}"
    entry = _entry(mod, attr)
    port = entry.port if entry else row.port
    if row.status == LACKS or row.build_flag:  # the alias does not serve the module (by default)
        return name, LACKS, None, port, row.note
    if attr is None:
        return full, row.status, row.mpnb, port, row.note
    if not _has(row.mpnb, attr):
        return full, LACKS, None, port, f"{row.mpnb} has no {attr!r}"
    status = (entry.status if entry and entry.status else None) or row.status
    note = (entry.note if entry and entry.note else "") or (row.note if status == EMULATES else "")
    return full, status, f"{row.mpnb}.{attr}", port, note


def _parse(path: str) -> ast.Module:
    source = read_source(path)
    try:
        return ast.parse(source, filename=path)
    except SyntaxError as e:
        raise SyntaxError(
            f"mpnb.apex --check: {path} is not valid Python ({e.msg}, line {e.lineno}); fix the "
            "syntax, or check the file with `python -m py_compile` first."
        ) from e


def _scan_all(path: str) -> tuple[list[tuple[str, Scanner]], list[str]]:
    """Scan the script, then each local module it (transitively) imports, once each."""
    root = os.path.dirname(os.path.abspath(path))
    todo, seen, scans = [os.path.abspath(path)], set(), []
    while todo:
        f = todo.pop(0)
        if f in seen:
            continue
        seen.add(f)
        scan = Scanner()
        scan.visit(_parse(f))
        scans.append((f, scan))
        for module, level, names in scan.imports:
            todo += [m for m in local_module(root, f, module, level, names) if m not in seen]
    rel = [os.path.relpath(f, root) for f, _ in scans[1:]]
    return scans, rel


def check_script(path: str, follow_imports: bool = True) -> CheckReport:
    """Parse ``path`` (never run it) and report every Apex name it uses.

    The script's local modules (files beside it that it imports, as ``import modeling`` or
    ``from .utils import x``: they run when the script does) are read too, unless
    ``follow_imports`` is False; installed packages are not.

    Args:
        path: a Python script.
        follow_imports: also read the local modules the script imports.

    Returns:
        A :class:`CheckReport`: the names in order of first use, the CUDA-only calls, the
        writes to Apex internals, the local modules read.

    Raises:
        SyntaxError: a file is not valid Python.
        mpnb.compat._scan.SourceError: a file cannot be decoded (not UTF-8, and no coding
            line says what it is).

    Example::

        >>> r = check_script("train.py"); r.count("lacks")
        0
    """
    if follow_imports:
        scans, modules = _scan_all(path)
    else:
        scan = Scanner()
        scan.visit(_parse(path))
        scans, modules = [(os.path.abspath(path), scan)], []
    root = os.path.dirname(os.path.abspath(path))
    merged: dict[str, tuple] = {}
    cuda: dict[str, list] = {}
    private: dict[str, tuple] = {}
    for k, (f, scan) in enumerate(scans):
        rel = os.path.relpath(f, root)

        def at(line: int) -> Where:
            return line if k == 0 else f"{rel}:{line}"  # noqa: B023 - used at once

        for used, lines in scan.uses.items():
            full, *rest = resolve(used)
            _, old = merged.get(full, (None, []))
            merged[full] = (rest, old + [at(n) for n in lines])
        for what, lines in scan.cuda.items():
            cuda.setdefault(what, []).extend(at(n) for n in lines)
        for key, line, code in scan.private:
            first, wheres = private.get(key, (code, []))
            private[key] = (first, [*wheres, at(line)])
    names = [
        NameReport(
            full,
            st,
            home,
            port,
            note,
            tuple(sorted({w for w in wheres if isinstance(w, int)})),
            tuple(dict.fromkeys(w for w in wheres if isinstance(w, str))),
        )
        for full, ((st, home, port, note), wheres) in merged.items()
    ]
    names.sort(key=lambda r: (_first(r), r.name))
    uses = [
        PrivateUse(key, e.status, e.what, e.mpnb, e.port, code, tuple(dict.fromkeys(wheres)))
        for key, (code, wheres) in private.items()
        for e in [PRIVATE[key]]
    ]
    cuda = {k: _ordered(v) for k, v in cuda.items()}
    return CheckReport(path, names, cuda, uses, modules)


def _first(r: NameReport) -> tuple:
    # script lines first (by line), then the local modules' uses in the order found
    return (0, r.lines[0], "") if r.lines else (1, 0, r.elsewhere[0])


def _ordered(wheres: list) -> list:
    ints = sorted({w for w in wheres if isinstance(w, int)})
    return ints + list(dict.fromkeys(w for w in wheres if isinstance(w, str)))


def _lines(wheres) -> str:
    return ",".join(str(n) for n in wheres)


def format_report(report: CheckReport) -> str:
    """The report as text: the names, the ports, the notes, the writes to Apex internals, the
    CUDA-only calls."""
    n = len(report.names)
    out = [
        f"{report.script}: {n} Apex name{'s' * (n != 1)}: {report.count(PROVIDES)} provided by "
        f"mpnb, {report.count(EMULATES)} emulated, {report.count(LACKS)} lacking.",
    ]
    if report.modules:
        out.append(f"Read with the local modules it imports: {', '.join(report.modules)}.")
    out.append("")
    rows = [("where", "apex name", "status", "mpnb")]
    rows += [
        (_lines([*r.lines, *r.elsewhere]), r.name, r.status, r.mpnb or "-") for r in report.names
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)] + [0]
    for row in rows:
        out.append("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())
    ports = {r.name: r.port for r in report.names if r.port}
    if ports:
        out += ["", "Porting to torch.amp / PyTorch:"]
        out += [f"  {name}: {port}" for name, port in ports.items()]
    notes = [r for r in report.names if r.note]
    if notes:
        out += ["", "Notes:"]
        out += [f"  {r.name} ({r.status}): {r.note}" for r in notes]
    if report.private:
        out += ["", "Apex internals written or called (private state of Apex's objects):"]
        for p in report.private:
            out += [
                f"  {_lines(p.where)}: {p.code} ({p.status}; {p.what})",
                f"      mpnb: {p.mpnb}",
                f"      port: {p.port}",
            ]
    if report.cuda_only:
        calls = "; ".join(f"{k} ({_lines(v)})" for k, v in report.cuda_only.items())
        out += [
            "",
            f"CUDA-only calls: {calls}. Without a GPU, rehearse the script on the CPU with "
            f"`python -m mpnb.apex --cpu {report.script}`.",
        ]
    return "\n".join(out)


def report_json(report: CheckReport) -> str:
    """The report as JSON: ``script``, ``counts``, ``names`` (one object each), ``private``,
    ``modules``, ``cuda_only``."""
    counts = {s: report.count(s) for s in (PROVIDES, EMULATES, LACKS)}
    body = {
        "script": report.script,
        "counts": counts,
        "names": [asdict(r) for r in report.names],
        "private": [asdict(p) for p in report.private],
        "modules": report.modules,
    }
    return json.dumps({**body, "cuda_only": report.cuda_only}, indent=1)
