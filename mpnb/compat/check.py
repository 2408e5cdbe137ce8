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
from dataclasses import asdict, dataclass, field

from mpnb.compat.names import EMULATES, LACKS, MODULES, NAMES, PROVIDES

__all__ = ["NameReport", "CheckReport", "check_script", "resolve", "format_report", "report_json"]


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
    """

    name: str
    status: str
    mpnb: str | None
    port: str
    note: str
    lines: tuple[int, ...]


@dataclass
class CheckReport:
    """Everything ``--check`` found in one script.

    Attributes:
        script: the path as given.
        names: one :class:`NameReport` per Apex name, in order of first use.
        cuda_only: each CUDA-only call found (``".cuda()"``, ``'backend="nccl"'``...) and its
            lines.
    """

    script: str
    names: list[NameReport] = field(default_factory=list)
    cuda_only: dict[str, list[int]] = field(default_factory=dict)

    def count(self, status: str) -> int:
        """How many names have ``status``."""
        return sum(r.status == status for r in self.names)


def _is_apex(name: str) -> bool:
    return name == "apex" or name.startswith("apex.") or name.split(".")[0] in MODULES


class _Scanner(ast.NodeVisitor):
    """Collects Apex names (with line numbers) and CUDA-only calls from a module's AST."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}
        self.uses: dict[str, list[int]] = {}
        self.cuda: dict[str, list[int]] = {}
        self._inner: set[int] = set()

    def _use(self, name: str, line: int) -> None:
        self.uses.setdefault(name, []).append(line)

    def _cuda(self, what: str, line: int) -> None:
        self.cuda.setdefault(what, []).append(line)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            if _is_apex(a.name):
                self._use(a.name, node.lineno)
                if a.asname:
                    self.bound[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    self.bound[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        if node.level or not _is_apex(mod):
            return
        for a in node.names:
            if a.name == "*":
                self._use(mod, node.lineno)
                continue
            full = f"{mod}.{a.name}"
            self._use(full, node.lineno)
            self.bound[a.asname or a.name] = full

    def visit_Name(self, node: ast.Name) -> None:
        # ``DDP(model)`` after ``from apex.parallel import DistributedDataParallel as DDP``;
        # names bound to modules are counted through their attribute chains instead.
        full = self.bound.get(node.id)
        if full is not None and full not in MODULES and isinstance(node.ctx, ast.Load):
            self._use(full, node.lineno)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Attribute):
            self._inner.add(id(node.value))
        if id(node) not in self._inner:
            parts, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                parts.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name):
                dotted = ".".join([base.id, *reversed(parts)])
                if base.id in self.bound:
                    self._use(self.bound[base.id] + dotted[len(base.id) :], node.lineno)
                elif dotted.startswith("torch.cuda.") and len(parts) == 2:
                    self._cuda(dotted, node.lineno)
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = ast.unparse(f)
        first = _text(node.args[0]) if node.args else None
        if isinstance(f, ast.Attribute) and f.attr == "cuda":
            self._cuda(".cuda()", node.lineno)
        if isinstance(f, ast.Attribute) and f.attr == "to" and (first or "").startswith("cuda"):
            self._cuda('.to("cuda")', node.lineno)
        if name == "torch.device" and (first or "").startswith("cuda"):
            self._cuda('torch.device("cuda")', node.lineno)
        if name.endswith("init_process_group") and "nccl" in (first or ""):
            self._cuda('backend="nccl"', node.lineno)
        if name in ("importlib.import_module", "import_module") and first and _is_apex(first):
            self._use(first, node.lineno)
        for kw in node.keywords:
            text = _text(kw.value) or ""
            if kw.arg == "device" and text.startswith("cuda"):
                self._cuda('device="cuda"', node.lineno)
            if kw.arg == "backend" and "nccl" in text:
                self._cuda('backend="nccl"', node.lineno)
        self.generic_visit(node)


def _text(node: ast.AST) -> str | None:
    """A string constant's value, or an f-string's leading text (``f"cuda:{r}"`` -> ``cuda:``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _text(node.values[0])
    return None


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


def resolve(name: str) -> tuple[str, str, str | None, str, str]:
    """``(apex name, status, mpnb location, port, note)`` for one Apex name (normalized to a
    module, or a module and one attribute)."""
    mod, attr = _module_of(name)
    if mod is None:
        return name, LACKS, None, "no equivalent known", "not an Apex name mpnb knows"
    row = MODULES[mod]
    full = mod if attr is None else f"{mod}.{attr}"
    entry = NAMES.get(full)
    port = entry.port if entry else row.port
    if row.status == LACKS:  # the whole module is missing: keep the name as the script wrote it
        return name, LACKS, None, port, row.note
    if attr is None:
        return full, row.status, row.mpnb, port, row.note
    if not _has(row.mpnb, attr):
        return full, LACKS, None, port, f"{row.mpnb} has no {attr!r}"
    status = (entry.status if entry and entry.status else None) or row.status
    note = (entry.note if entry and entry.note else "") or (row.note if status == EMULATES else "")
    return full, status, f"{row.mpnb}.{attr}", port, note


def check_script(path: str) -> CheckReport:
    """Parse ``path`` (never run it) and report every Apex name it uses.

    Args:
        path: a Python script.

    Returns:
        A :class:`CheckReport`: the names in order of first use, and the CUDA-only calls.

    Example::

        >>> r = check_script("train.py"); r.count("lacks")
        0
    """
    with open(path, encoding="utf-8") as f:
        source = f.read()
    try:
        tree = ast.parse(source, filename=path)
    except SyntaxError as e:
        raise SyntaxError(
            f"mpnb.apex --check: {path} is not valid Python ({e.msg}, line {e.lineno}); fix the "
            "syntax, or check the file with `python -m py_compile` first."
        ) from e
    scan = _Scanner()
    scan.visit(tree)
    merged: dict[str, tuple] = {}
    for used, lines in scan.uses.items():
        full, *rest = resolve(used)
        _, old_lines = merged.get(full, (None, []))
        merged[full] = (rest, sorted({*old_lines, *lines}))
    names = [
        NameReport(full, st, where, port, note, tuple(lines))
        for full, ((st, where, port, note), lines) in merged.items()
    ]
    names.sort(key=lambda r: (r.lines[0], r.name))
    cuda = {k: sorted(set(v)) for k, v in scan.cuda.items()}
    return CheckReport(path, names, cuda)


def _lines(lines) -> str:
    return ",".join(str(n) for n in lines)


def format_report(report: CheckReport) -> str:
    """The report as text: a table of names, the ports, the notes, the CUDA-only calls."""
    n = len(report.names)
    out = [
        f"{report.script}: {n} Apex name{'s' * (n != 1)}: {report.count(PROVIDES)} provided by "
        f"mpnb, {report.count(EMULATES)} emulated, {report.count(LACKS)} lacking.",
        "",
    ]
    rows = [("line", "apex name", "status", "mpnb")]
    rows += [(_lines(r.lines), r.name, r.status, r.mpnb or "-") for r in report.names]
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
    if report.cuda_only:
        calls = "; ".join(f"{k} (line {_lines(v)})" for k, v in report.cuda_only.items())
        out += [
            "",
            f"CUDA-only calls: {calls}. Without a GPU, rehearse the script on the CPU with "
            f"`python -m mpnb.apex --cpu {report.script}`.",
        ]
    return "\n".join(out)


def report_json(report: CheckReport) -> str:
    """The report as JSON: ``script``, ``counts``, ``names`` (one object each), ``cuda_only``."""
    counts = {s: report.count(s) for s in (PROVIDES, EMULATES, LACKS)}
    names = [asdict(r) for r in report.names]
    body = {"script": report.script, "counts": counts, "names": names}
    return json.dumps({**body, "cuda_only": report.cuda_only}, indent=1)
