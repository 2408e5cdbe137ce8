"""What ``--check`` reads in one source file: the Apex names, private-state writes, CUDA-only
calls and local imports, found with :mod:`ast` (never by running the file).

:func:`read_source` decodes a file as Python does (UTF-8, or the encoding its coding line
declares) and says clearly when it cannot; :class:`Scanner` walks one module's tree;
:func:`local_module` finds the file a local import names, so that ``--check`` reads the
script's own modules too (they run when the script imports them).
"""

from __future__ import annotations

import ast
import io
import os
import tokenize

from mpnb.compat.names import MODULES, PRIVATE

__all__ = ["SourceError", "read_source", "Scanner", "local_module", "is_apex"]


class SourceError(ValueError):
    """A file ``--check`` cannot read as Python source (undecodable, or not Python)."""


def read_source(path: str) -> str:
    """The text of a Python file, decoded as the interpreter decodes it (PEP 263: UTF-8 unless
    a coding line says otherwise).

    Raises:
        SourceError: the bytes are not valid in that encoding, or the file is not readable.
    """
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except OSError as e:
        raise SourceError(f"cannot read {path}: {e.strerror}; check the path.") from None
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as e:  # undecodable first lines, or an unknown declared encoding
        raise SourceError(_undecodable(path, "UTF-8 (it declares no other encoding)", e)) from None
    try:
        return raw.decode(encoding)
    except UnicodeDecodeError as e:
        raise SourceError(_undecodable(path, encoding, e)) from None


def _undecodable(path: str, encoding: str, err: Exception) -> str:
    return (
        f"{path} is not valid {encoding}, so Python would refuse to run it too ({err}). "
        "Re-save the file as UTF-8, or declare its encoding on its first or second line "
        "(for example `# -*- coding: latin-1 -*-`)."
    )


def is_apex(name: str) -> bool:
    """True for ``apex``/``apex.*`` and Apex's extension modules (``amp_C``...)."""
    return name == "apex" or name.startswith("apex.") or name.split(".")[0] in MODULES


def _text(node: ast.AST) -> str | None:
    """A string constant's value, or an f-string's leading text (``f"cuda:{r}"`` -> ``cuda:``)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr) and node.values:
        return _text(node.values[0])
    return None


def _chain(node: ast.AST) -> list[str]:
    """The attribute names of ``a.b[0].c`` from the outermost in: ``["c", "b"]`` (subscripts
    and calls are looked through)."""
    out = []
    while True:
        if isinstance(node, ast.Attribute):
            out.append(node.attr)
            node = node.value
        elif isinstance(node, (ast.Subscript, ast.Call)):
            node = node.value if isinstance(node, ast.Subscript) else node.func
        else:
            return out


class Scanner(ast.NodeVisitor):
    """Collects, from one module's tree: Apex names with their lines (``uses``), writes and
    calls of Apex internals (``private``: key of :data:`~mpnb.compat.names.PRIVATE`, line,
    source text), CUDA-only calls (``cuda``) and imports (``imports``: module, level, names)."""

    def __init__(self) -> None:
        self.bound: dict[str, str] = {}
        self.uses: dict[str, list[int]] = {}
        self.cuda: dict[str, list[int]] = {}
        self.private: list[tuple[str, int, str]] = []
        self.imports: list[tuple[str, int, tuple[str, ...]]] = []
        self._inner: set[int] = set()

    def _use(self, name: str, line: int) -> None:
        self.uses.setdefault(name, []).append(line)

    def _cuda(self, what: str, line: int) -> None:
        self.cuda.setdefault(what, []).append(line)

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self.imports.append((a.name, 0, ()))
            if is_apex(a.name):
                self._use(a.name, node.lineno)
                if a.asname:
                    self.bound[a.asname] = a.name
                else:
                    top = a.name.split(".")[0]
                    self.bound[top] = top

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        self.imports.append((mod, node.level, tuple(a.name for a in node.names)))
        if node.level or not is_apex(mod):
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
        if isinstance(node.ctx, ast.Store):
            self._private_write(node)
        self.generic_visit(node)

    def _private_write(self, node: ast.Attribute) -> None:
        above = _chain(node.value)
        if "_amp_stash" in above:
            key = f"_amp_stash.{node.attr}"
            key = key if key in PRIVATE else "_amp_stash.*"
        elif node.attr in PRIVATE:
            key = node.attr
        else:
            return
        self.private.append((key, node.lineno, ast.unparse(node)))

    def visit_Call(self, node: ast.Call) -> None:
        f = node.func
        name = ast.unparse(f)
        first = _text(node.args[0]) if node.args else None
        if isinstance(f, ast.Attribute) and f"{f.attr}()" in PRIVATE:
            self.private.append((f"{f.attr}()", node.lineno, ast.unparse(node)))
        if isinstance(f, ast.Attribute) and f.attr == "cuda":
            self._cuda(".cuda()", node.lineno)
        if isinstance(f, ast.Attribute) and f.attr == "to" and (first or "").startswith("cuda"):
            self._cuda('.to("cuda")', node.lineno)
        if name == "torch.device" and (first or "").startswith("cuda"):
            self._cuda('torch.device("cuda")', node.lineno)
        if name.endswith("init_process_group") and "nccl" in (first or ""):
            self._cuda('backend="nccl"', node.lineno)
        if name in ("importlib.import_module", "import_module") and first and is_apex(first):
            self._use(first, node.lineno)
        for kw in node.keywords:
            text = _text(kw.value) or ""
            if kw.arg == "device" and text.startswith("cuda"):
                self._cuda('device="cuda"', node.lineno)
            if kw.arg == "backend" and "nccl" in text:
                self._cuda('backend="nccl"', node.lineno)
        self.generic_visit(node)


def _module_file(base: str, parts: list[str]) -> str | None:
    """``base/a/b.py`` or ``base/a/b/__init__.py`` for ``parts = ["a", "b"]``, if it exists."""
    path = os.path.join(base, *parts)
    for candidate in (path + ".py", os.path.join(path, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def local_module(
    root: str, importer: str, module: str, level: int, names: tuple[str, ...]
) -> list[str]:
    """The files of ``root`` (the script's directory, first on ``sys.path``) that an import
    statement in ``importer`` runs: each package ``__init__`` on the way, the module, and the
    submodules ``from X import sub`` names. Empty for modules found elsewhere (installed
    packages are not followed) and for Apex's names.

    Args:
        root: the script's directory.
        importer: the file holding the import.
        module, level, names: the statement (``from ..a import b`` is ``("a", 2, ("b",))``;
            ``import a.b`` is ``("a.b", 0, ())``).
    """
    if level:
        base = os.path.dirname(os.path.abspath(importer))
        for _ in range(level - 1):
            base = os.path.dirname(base)
    else:
        if is_apex(module):
            return []
        base = os.path.abspath(root)
    parts = [p for p in module.split(".") if p]
    found = []
    for i in range(1, len(parts) + 1):
        f = _module_file(base, parts[:i])
        if f is None:
            break
        found.append(f)
    if len(found) < len(parts):
        return found
    for n in names:
        sub = _module_file(base, [*parts, n]) if n != "*" else None
        if sub is not None:
            found.append(sub)
    return found
