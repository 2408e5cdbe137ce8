"""The README's Python snippets run as written, in order, in one namespace."""

import re
import warnings
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _snippets() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_snippets():
    blocks = _snippets()
    assert len(blocks) >= 3 and all("import" in b for b in blocks[:2])


@pytest.mark.slow
def test_readme_python_snippets_run_as_written(tmp_path, monkeypatch):
    pytest.importorskip("transformers").utils.logging.set_verbosity_error()
    monkeypatch.chdir(tmp_path)  # report.html lands here
    ns: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for i, block in enumerate(_snippets()):
            exec(compile(block, f"README.md python block {i + 1}", "exec"), ns)  # noqa: S102
    assert (tmp_path / "report.html").exists()
    assert ns["df"]["status"].eq("ok").all()
