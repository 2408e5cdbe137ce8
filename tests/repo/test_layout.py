"""The tests mirror the code: every public module has its unit file where a newcomer looks for
it, every test file says by its path what it tests, and error asserts match a stable phrase.

The rules (``unit_file`` and ``subject_of`` spell them):

* ``mpnb/<path>/<module>.py`` is tested in ``tests/<path>/test_<module>.py``; a private
  ``_<module>.py`` in ``tests/<path>/test_<module>.py`` too (the underscore dropped; beside a
  public ``<module>.py`` it implements, the two share that file); a package
  whose ``__init__.py`` holds code in ``tests/<path>/<package>/test_<package>.py``.
* Beside a unit file, ``test_<module>_<aspect>.py`` may hold one aspect of the same module.
* Tests of behaviour across modules (training, digits, overhead, Apex's own suites) sit in
  ``tests/behaviour/``, the browser's in ``tests/e2e/``, and the checkout's own files (README,
  docs, scripts, the layers contract, this layout) in ``tests/repo/``.
* An error or warning assert matches the exception type and a key phrase of fewer than
  ``KEY_PHRASE`` characters (``pytest.raises(ValueError, match="found_inf")``), not the
  message's prose: rewording a message then breaks only the tests that are about its wording.

Run ``python -m pytest tests/repo/test_layout.py -q`` to list what is out of place.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "mpnb"
TESTS = ROOT / "tests"

# Folders whose tests are suites of their own, not the unit tests of one module.
SUITES = ("behaviour", "e2e", "repo")

# An error assert matches a phrase shorter than this; a longer one is prose.
KEY_PHRASE = 25

# Where an assert's right-hand side reads an exception or a warning's text.
_MESSAGE_SIDE = re.compile(
    r"\b(e|err|error|exc|excinfo|exc_info|ei|info|raised|caught)\.value\b|\bmessage\b|\bmsg\b"
    r"|\berr\b|\bexc\b|\berror\b|\bwarn|str\(e\)|\bw\.|\brecord"
)


def modules(root: Path = PACKAGE) -> list[Path]:
    """Every module of the package, as paths relative to ``mpnb/`` (``__init__.py`` files only
    where the package defines a function or a class)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if path.name == "__init__.py":
            tree = ast.parse(path.read_text())
            if not any(isinstance(n, (ast.FunctionDef, ast.ClassDef)) for n in tree.body):
                continue
        out.append(rel)
    return out


def is_public(module: Path) -> bool:
    """True when no part of the module's path (but ``__init__``) starts with an underscore."""
    return not any(part.startswith("_") and part != "__init__.py" for part in module.parts)


def unit_file(module: Path) -> Path:
    """The unit-test file of ``module`` (a path relative to ``mpnb/``), relative to ``tests/``."""
    if module.name == "__init__.py":
        return module.parent / f"test_{module.parent.name}.py"
    return module.parent / f"test_{module.stem.lstrip('_')}.py"


def subject_of(test: Path, units: dict[Path, Path]) -> Path | None:
    """The module a test file (relative to ``tests/``) is the unit file of, or of an aspect of:
    the longest module name that ``test_<name>.py`` or ``test_<name>_<aspect>.py`` spells."""
    named = [
        (len(unit.stem), module)
        for unit, module in units.items()
        if unit.parent == test.parent
        and (test.stem == unit.stem or test.stem.startswith(unit.stem + "_"))
    ]
    return max(named, key=lambda pair: pair[0])[1] if named else None


def test_files() -> list[Path]:
    """Every test file under ``tests/``, relative to it."""
    return sorted(p.relative_to(TESTS) for p in TESTS.rglob("test_*.py"))


def test_every_public_module_has_a_unit_file():
    missing = [
        f"mpnb/{m} -> tests/{unit_file(m)}"
        for m in modules()
        if is_public(m) and not (TESTS / unit_file(m)).is_file()
    ]
    assert not missing, "public modules without a unit file:\n" + "\n".join(missing)


def test_no_two_modules_share_a_unit_file():
    seen: dict[Path, Path] = {}
    clashes = []
    for m in modules():
        unit = unit_file(m)
        twin = m.with_name(m.name.lstrip("_"))
        if m.name.startswith("_") and (PACKAGE / twin).is_file():
            continue  # a private _x.py beside x.py implements it: both share x's unit file
        if unit in seen:
            clashes.append(f"mpnb/{seen[unit]} and mpnb/{m} -> tests/{unit}")
        seen[unit] = m
    assert not clashes, "two modules map onto one unit file:\n" + "\n".join(clashes)


def test_every_test_file_names_its_subject():
    units = {unit_file(m): m for m in modules()}
    stray = [
        f"tests/{t}"
        for t in test_files()
        if t.parts[0] not in SUITES and subject_of(t, units) is None
    ]
    assert not stray, (
        "test files that mirror no module (rename to tests/<path>/test_<module>[_<aspect>].py, "
        f"or move a cross-module suite under tests/{{{','.join(SUITES)}}}/):\n" + "\n".join(stray)
    )


def prose_asserts(path: Path, root: Path = ROOT) -> list[str]:
    """The error and warning asserts of a test file that match ``KEY_PHRASE`` characters or more
    of a message: ``match="..."`` arguments, and ``"..." in <the exception's text>``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        text = None
        if isinstance(node, ast.keyword) and node.arg == "match":
            if isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                text = node.value.value
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Constant)
            and isinstance(node.left.value, str)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and _MESSAGE_SIDE.search(ast.unparse(node.comparators[0]))
        ):
            text = node.left.value
        if text is not None and len(text) >= KEY_PHRASE:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {text!r}")
    return found


def test_error_asserts_match_a_key_phrase():
    found = [hit for t in test_files() for hit in prose_asserts(TESTS / t)]
    assert not found, (
        f"error asserts that match {KEY_PHRASE}+ characters of a message (match the type and "
        "a short key phrase instead):\n" + "\n".join(found)
    )


def test_the_rules_catch_what_they_are_about(tmp_path):
    # The rules themselves, on a made-up tree: a module without its unit file is found, a
    # stray test file is found, an aspect file is accepted, a prose match is found.
    pkg = tmp_path / "mpnb" / "core"
    pkg.mkdir(parents=True)
    (pkg / "casts.py").write_text("X = 1\n")
    (pkg / "_strategies.py").write_text("X = 1\n")
    (pkg / "__init__.py").write_text("")
    found = modules(tmp_path / "mpnb")
    assert found == [Path("core/_strategies.py"), Path("core/casts.py")]
    assert [is_public(m) for m in found] == [False, True]
    assert unit_file(Path("core/_strategies.py")) == Path("core/test_strategies.py")
    assert unit_file(Path("lab/bench/__init__.py")) == Path("lab/bench/test_bench.py")
    units = {unit_file(m): m for m in found}
    assert subject_of(Path("core/test_casts_handles.py"), units) == Path("core/casts.py")
    assert subject_of(Path("core/test_training.py"), units) is None
    bad = tmp_path / "test_bad.py"
    bad.write_text(
        "import pytest\n\n\ndef test_x():\n"
        "    with pytest.raises(ValueError, match='the value of found_inf must be a tensor'):\n"
        "        pass\n"
    )
    hits = [h.split(": ", 1)[1] for h in prose_asserts(bad, tmp_path)]
    assert hits == ["'the value of found_inf must be a tensor'"]
