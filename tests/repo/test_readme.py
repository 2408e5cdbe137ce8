"""The README's two commands exist as written, and its Python snippets, then the guides', run
as written, in order, in one namespace."""

import re
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
#: the guides with Python snippets, in the order a reader meets them (mkdocs.yml's nav)
GUIDES = [ROOT / "docs" / "guide" / f"{name}.md" for name in ("amp", "lab", "notebooks")]


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def test_readme_has_the_two_commands_and_they_exist():
    commands = [line for b in _blocks(README, "bash") for line in b.splitlines() if line]
    assert commands == ["bash scripts/run.sh", "bash scripts/test.sh"]
    for command in commands:
        assert (ROOT / command.split()[1]).is_file(), command


def test_readme_is_a_front_door():
    """Short enough to read in minutes, with no line that runs on, and a line for every
    notebook."""
    lines = README.read_text().splitlines()
    assert len(lines) <= 150 and max(map(len, lines)) <= 120
    table = README.read_text().split("## What each notebook teaches")[1]
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert f"| `{nb.stem}` |" in table, f"{nb.name} has no line in the README"


def test_readme_and_guides_have_python_snippets():
    readme = _blocks(README, "python")
    assert len(readme) == 1 and len(readme[0].strip().splitlines()) <= 16
    assert all(_blocks(g, "python") for g in GUIDES)


@pytest.mark.slow
def test_python_snippets_run_as_written(tmp_path, monkeypatch):
    pytest.importorskip("transformers").utils.logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)  # report.html lands here
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for path in (README, *GUIDES):
            for i, block in enumerate(_blocks(path, "python")):
                where = f"{path.relative_to(ROOT)} python block {i + 1}"
                exec(compile(block, where, "exec"), ns)  # noqa: S102
    assert (tmp_path / "report.html").exists()
    assert ns["df"]["status"].eq("ok").all()
