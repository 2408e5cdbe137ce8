"""The docs name every CLI flag and every ``MPNB_*`` variable that the code reads.

The flags and variables are found by scanning the sources, not by asking the docs generator,
so a flag added to a parser that ``scripts/gen_docs.py`` does not know, or a variable read
without a line in ``docs/environment.md``, fails here. ``scripts/test.sh`` also builds the
docs with ``mkdocs build --strict``.
"""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
ENV_PAGE = DOCS / "environment.md"
_VAR = re.compile(r"\bMPNB_[A-Z0-9_]*[A-Z0-9]\b")


def _gen_docs():
    spec = importlib.util.spec_from_file_location("gen_docs", ROOT / "scripts" / "gen_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def generated() -> dict[str, str]:
    return _gen_docs().pages()


def _docs_text(generated: dict[str, str]) -> str:
    """Every page of the site: the hand-written ones (not the GPU run records) and the
    generated ones."""
    written = [p.read_text() for p in DOCS.rglob("*.md") if "gpu" not in p.relative_to(DOCS).parts]
    return "\n".join([*written, *generated.values()])


def cli_flags(root: Path) -> dict[str, str]:
    """Every option string of the commands under ``root``, with where it is defined: the
    literal ``-x``/``--x`` arguments of every ``add_argument`` call, and the ``--x`` string
    constants of ``mpnb/apex.py`` (which parses its few flags by hand)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        hand_parsed = path.name == "apex.py" and path.parent == root
        for node in ast.walk(tree):
            strings = []
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument":
                strings = [a.value for a in node.args if isinstance(a, ast.Constant)]
            elif hand_parsed and isinstance(node, ast.Constant):
                strings = [node.value] if re.fullmatch(r"--[a-z][\w-]*", str(node.value)) else []
            for s in strings:
                if isinstance(s, str) and s.startswith("-"):
                    found.setdefault(s, f"{path.relative_to(root.parent)}:{node.lineno}")
    return found


def env_vars(root: Path) -> dict[str, str]:
    """Every ``MPNB_*`` name in the Python, C++ and shell sources under ``root``'s ``mpnb/``,
    ``csrc/`` and ``scripts/``, with the first place it appears."""
    found = {}
    for folder, patterns in (("mpnb", ("*.py",)), ("csrc", ("*.cpp", "*.h")), ("scripts", ("*",))):
        for pattern in patterns:
            for path in sorted((root / folder).rglob(pattern)):
                if not path.is_file() or path.suffix in (".json", ".pyc"):
                    continue
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                    for name in _VAR.findall(line):
                        found.setdefault(name, f"{path.relative_to(root)}:{n}")
    return found


def _mentions(text: str, flag: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text) is not None


def test_every_cli_flag_is_in_the_docs(generated):
    flags = cli_flags(ROOT / "mpnb")
    assert {"--configs", "--keep-last", "--quick", "--ranks", "--check"} <= set(flags)
    text = _docs_text(generated)
    missing = {f: where for f, where in flags.items() if f != "-h" and not _mentions(text, f)}
    assert not missing, (
        f"CLI flags with no line in the docs: {missing}; a parser that scripts/gen_docs.py "
        "does not know needs adding to its parsers()"
    )


def test_every_command_is_in_the_cli_reference(generated):
    """Each ``prog=`` of a parser, and each ``mpnb`` subcommand, heads a section."""
    page = generated["reference/cli.md"]
    progs = set()
    for path in (ROOT / "mpnb").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.keyword) and node.arg == "prog":
                if isinstance(node.value, ast.Constant):
                    progs.add(node.value.value)
    assert {"mpnb", "mpnb bench", "python -m mpnb.lab.distributed"} <= progs
    subcommands = {f"mpnb {c}" for c in ("doctor", "build-ext", "compare")}
    missing = [p for p in sorted(progs | subcommands) if f"## `{p}`" not in page]
    assert not missing, f"commands without a section in reference/cli.md: {missing}"


def test_every_mpnb_variable_is_in_the_environment_page():
    read = env_vars(ROOT)
    assert {"MPNB_DISABLE_EXT", "MPNB_TRITON", "MPNB_CPU_NORM_BWD_ROWS"} <= set(read)
    page = ENV_PAGE.read_text()
    documented = set(_VAR.findall(page))
    missing = {v: where for v, where in read.items() if v not in documented}
    assert not missing, f"MPNB_* variables read but not in docs/environment.md: {missing}"
    stale = documented - set(read)
    assert not stale, f"docs/environment.md names variables nothing reads: {sorted(stale)}"


def test_the_scans_find_what_a_new_command_adds(tmp_path):
    """A new flag or variable in a source is found, so a missing doc line fails the tests."""
    pkg = tmp_path / "mpnb"
    pkg.mkdir()
    (pkg / "new.py").write_text(
        'import os\nFLAG = os.environ.get("MPNB_BRAND_NEW")\n'
        'def add(p):\n    p.add_argument("--brand-new", "-b", help="x")\n'
    )
    assert set(cli_flags(pkg)) == {"--brand-new", "-b"}
    assert env_vars(tmp_path) == {"MPNB_BRAND_NEW": "mpnb/new.py:2"}
    assert not _mentions(_docs_text({}), "--brand-new")


def test_generated_pages_name_every_configuration_suite_column_and_apex_module(generated):
    from mpnb.compat.names import MODULES
    from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS, PRECISION_CONFIGS
    from mpnb.lab.bench import suites
    from mpnb.lab.bench._report import COLUMN_TITLES

    configs = generated["reference/configurations.md"]
    assert all(f"`{n}`" in configs for n in (*PRECISION_CONFIGS, *DISTRIBUTED_CONFIGS))
    bench = generated["reference/bench.md"]
    assert all(f"`{n}`" in bench for n in (*suites(), *COLUMN_TITLES))
    apex = generated["reference/apex.md"]
    assert all(f"`{n}`" in apex for n in MODULES)


def test_every_hand_written_page_is_in_the_nav():
    """mkdocs.yml's nav lists every page under docs/ (the GPU records are listed by the
    generated reference/gpu-runs.md)."""
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = [p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md")]
    missing = [p for p in pages if not p.startswith("gpu/") and f": {p}" not in nav]
    assert not missing, f"docs pages missing from mkdocs.yml's nav: {missing}"
