"""The reference pages of the docs, generated from the code so that nothing is written twice.

Each page is drawn from the object that owns its facts:

* ``reference/cli.md``: every command's argparse parser (``mpnb``, its subcommands,
  ``mpnb bench``, ``python -m mpnb.lab.distributed``, ``python -m mpnb.lab.sync_count``) and
  ``python -m mpnb.apex``'s usage text; a new flag appears here without being written again.
* ``reference/configurations.md``: ``PRECISION_CONFIGS`` and ``DISTRIBUTED_CONFIGS``.
* ``reference/bench.md``: the suites found on disk and the table's columns.
* ``reference/apex.md``: ``mpnb.compat.names``, the table of Apex names and what mpnb does
  with each.

``mkdocs.yml`` names this file under ``hooks:``, so ``mkdocs build`` adds the pages
(:func:`on_files`). Run as a script, it writes them to a folder, to read without a build::

    python scripts/gen_docs.py /tmp/mpnb-docs
"""

from __future__ import annotations

import argparse
import inspect
import logging
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # mkdocs imports this hook with the checkout's mpnb in mind
    sys.path.insert(0, str(ROOT))


def _cell(text: object) -> str:
    """``text`` as one Markdown table cell: one line, ``|`` escaped."""
    return " ".join(str(text).split()).replace("|", "\\|")


def _table(head: tuple[str, ...], rows: list[tuple]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + [""]


def _doc(obj: object) -> str:
    """The first paragraph of ``obj``'s docstring, on one line."""
    return " ".join(inspect.getdoc(obj).split("\n\n")[0].split()) if inspect.getdoc(obj) else ""


# --- the command line ---------------------------------------------------------------------


class _Captured(Exception):
    """Raised instead of parsing, carrying the parser a ``main`` built."""

    def __init__(self, parser: argparse.ArgumentParser):
        super().__init__(parser.prog)
        self.parser = parser


def captured_parser(main: Callable[[list[str]], object]) -> argparse.ArgumentParser:
    """The parser that ``main`` builds, caught at its ``parse_args`` (nothing runs)."""

    def catch(self, *args, **kwargs):
        raise _Captured(self)

    with mock.patch.object(argparse.ArgumentParser, "parse_args", catch):
        try:
            main([])
        except _Captured as c:
            return c.parser
    raise RuntimeError(f"{main.__module__}.main returned without calling parse_args")


def parsers() -> list[argparse.ArgumentParser]:
    """Every argparse parser of mpnb's commands, top-level ones first."""
    from mpnb.cli import build_parser
    from mpnb.lab import sync_count
    from mpnb.lab.bench import main as bench_main
    from mpnb.lab.distributed.__main__ import main as distributed_main

    return [
        build_parser(),
        captured_parser(bench_main),
        captured_parser(distributed_main),
        sync_count.parser(),
    ]


def _expand(action: argparse.Action, parser: argparse.ArgumentParser) -> str:
    if not action.help or action.help == argparse.SUPPRESS:
        return ""
    return parser._get_formatter()._expand_help(action)


def _value(action: argparse.Action) -> str:
    if action.nargs == 0:
        return ""
    if action.choices is not None and not isinstance(action, argparse._SubParsersAction):
        return "{" + ",".join(map(str, action.choices)) + "}"
    return action.metavar or action.dest.upper()


def _default(action: argparse.Action) -> str:
    d = action.default
    if action.nargs == 0 or d is None or d == argparse.SUPPRESS or d == "":
        return ""
    if isinstance(d, tuple):
        d = ",".join(map(str, d))
    return f"`{d}`"


def _parser_page(parser: argparse.ArgumentParser, level: int) -> Iterator[str]:
    yield f"{'#' * level} `{parser.prog}`"
    yield ""
    if parser.description:
        yield parser.description
        yield ""
    yield "```text"
    yield parser.format_usage().strip()
    yield "```"
    yield ""
    rows, subs = [], None
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            subs = a
        elif isinstance(a, argparse._HelpAction):
            continue
        elif a.option_strings:
            flags = ", ".join(f"`{s}`" for s in a.option_strings)
            rows.append((flags, _value(a), _default(a), _expand(a, parser)))
        else:
            rows.append((f"`{a.dest}` (positional)", _value(a), _default(a), _expand(a, parser)))
    if rows:
        yield from _table(("flag", "value", "default", "what it does"), rows)
    if subs is not None:
        helps = {c.dest: c.help or "" for c in subs._choices_actions}
        yield from _table(
            ("command", "what it does"), [(f"`{n}`", helps.get(n, "")) for n in subs.choices]
        )
        for name, sub in subs.choices.items():
            if name == "bench":  # its own parser, below (`mpnb bench` parses its own argv)
                continue
            yield from _parser_page(sub, level + 1)


def cli_page() -> str:
    """Every command, its usage and a table of its flags, from the parsers themselves."""
    import mpnb.apex

    out = [
        "# Command line",
        "",
        "Generated from the commands' own parsers (`scripts/gen_docs.py`). Every command also "
        "answers `--help`.",
        "",
    ]
    for p in parsers():
        out += list(_parser_page(p, 2))
    out += [
        "## `python -m mpnb.apex`",
        "",
        _doc(mpnb.apex),
        "",
        "```text",
        mpnb.apex._USAGE,
        "```",
        "",
        "See [Coming from Apex](../guide/apex.md) for what each mode does.",
        "",
    ]
    return "\n".join(out)


# --- precision configurations --------------------------------------------------------------


def _dtypes(names: tuple[str, ...]) -> str:
    return ", ".join(names)


def configurations_page() -> str:
    """One row per configuration of ``PRECISION_CONFIGS`` and of ``DISTRIBUTED_CONFIGS``."""
    from mpnb.core import precision_configs as pc

    rows = [
        (
            f"`{name}`",
            type(c).__name__,
            c.description,
            _dtypes(c.weights),
            _dtypes(c.grads),
            _dtypes(c.optimizer_state),
            c.compute,
        )
        for name, c in pc.PRECISION_CONFIGS.items()
    ]
    dist = [
        (f"`{name}`", c.strategy if hasattr(c, "strategy") else "", c.description)
        for name, c in pc.DISTRIBUTED_CONFIGS.items()
    ]
    return "\n".join(
        [
            "# Precision configurations",
            "",
            "Generated from `mpnb.core.precision_configs.PRECISION_CONFIGS` and "
            "`DISTRIBUTED_CONFIGS`. Each row is one object that sets a model and an optimizer "
            "up; `mpnb compare --configs` and `mpnb.lab.compare(configs=...)` take these names. "
            f"The default set is `{','.join(pc.DEFAULT_CONFIGS)}` (and `tf32` on CUDA). "
            '`"half"` is the run\'s half dtype (`--dtype`).',
            "",
            "## One process",
            "",
            *_table(
                ("name", "kind", "what it is", "weights", "grads", "optimizer state", "compute"),
                rows,
            ),
            "## Distributed policies (`--ranks N`)",
            "",
            *_table(("name", "strategy", "what it is"), dist),
            "## The configuration object",
            "",
            "::: mpnb.core.precision_configs.PrecisionConfig",
            "    options:",
            "      members: false",
            "",
        ]
    )


# --- mpnb bench ---------------------------------------------------------------------------


def bench_page() -> str:
    """The suites of ``mpnb bench`` and its table's columns."""
    from mpnb.lab.bench import suites
    from mpnb.lab.bench._report import _COLUMNS, _MORE_COLUMNS

    return "\n".join(
        [
            "# `mpnb bench`",
            "",
            "Generated from the suites found on disk (`mpnb/lab/bench/<suite>.py`) and from "
            "`mpnb.lab.bench._report`. The flags are in the "
            "[command-line reference](cli.md#mpnb-bench).",
            "",
            "## Suites",
            "",
            *_table(("suite", "what it measures"), [(f"`{n}`", d) for n, d in suites().items()]),
            "## Columns",
            "",
            "A table shows these columns unless its suite names its own in `COLUMNS`: "
            + ", ".join(f"`{c[0]}`" for c in _COLUMNS)
            + ". A suite's `COLUMNS` may also name "
            + ", ".join(f"`{c[0]}`" for c in _MORE_COLUMNS)
            + ". What each means:",
            "",
            "::: mpnb.lab.bench._report.format_rows",
            "    options:",
            "      show_root_heading: false",
            "      show_signature: false",
            "",
            "## The run's header",
            "",
            "::: mpnb.lab.bench._report.collect_header",
            "    options:",
            "      show_root_heading: false",
            "",
            "The allocator settings it records: "
            + ", ".join(f"`{k}`" for k in _allocator_env())
            + ".",
            "",
        ]
    )


def _allocator_env() -> tuple[str, ...]:
    from mpnb.lab.bench._report import ALLOCATOR_ENV

    return ALLOCATOR_ENV


# --- Apex ---------------------------------------------------------------------------------


def apex_page() -> str:
    """``mpnb.compat.names``: every Apex module, attribute and internal, and mpnb's answer."""
    from mpnb.compat import names

    def home(m):
        return f"`{m}`" if m else ""

    modules = [
        (f"`{r.apex}`", home(r.mpnb), r.status, r.port, r.note) for r in names.MODULES.values()
    ]
    attrs = [
        (f"`{k}`", r.status or "as its module", r.port, r.note) for k, r in names.NAMES.items()
    ]
    private = [(f"`{k}`", r.what, r.status, r.mpnb, r.port) for k, r in names.PRIVATE.items()]
    return "\n".join(
        [
            "# Apex names in mpnb",
            "",
            "Generated from `mpnb.compat.names`, the one table that the import alias, "
            "`python -m mpnb.apex --check` and the Apex-named modules all read. "
            "Statuses: `provides` (Apex's names and behaviour), `emulates` (Apex's surface "
            "over a different mechanism; the note says what differs), `lacks` (the port says "
            "what to use instead).",
            "",
            "## Modules",
            "",
            *_table(("Apex module", "mpnb module", "status", "torch port", "note"), modules),
            "## Attributes",
            "",
            *_table(("Apex name", "status", "torch port", "note"), attrs),
            "## Internals that scripts write or call",
            "",
            *_table(("attribute", "on", "status", "what mpnb does", "torch port"), private),
        ]
    )


# --- the GPU runs and the home page ---------------------------------------------------------


def gpu_runs_page() -> str:
    """A link to each record that ``scripts/gpu-check.sh`` wrote to ``docs/gpu/``."""
    runs = sorted((ROOT / "docs" / "gpu").glob("*.md"), reverse=True)
    lines = [
        "# GPU runs",
        "",
        "Each `bash scripts/gpu-check.sh` on a GPU writes its summary to "
        "`docs/gpu/<date>-<card>-<rev>.md`; newest first:",
        "",
    ]
    lines += [f"- [{p.stem}](../gpu/{p.name})" for p in runs] or ["- none yet"]
    return "\n".join([*lines, ""])


def index_page() -> str:
    """The README, as the site's home page (its ``docs/`` links made relative to ``docs/``)."""
    return (ROOT / "README.md").read_text().replace("](docs/", "](")


# --- mkdocs -------------------------------------------------------------------------------

PAGES: dict[str, Callable[[], str]] = {
    "reference/cli.md": cli_page,
    "reference/configurations.md": configurations_page,
    "reference/bench.md": bench_page,
    "reference/apex.md": apex_page,
    "reference/gpu-runs.md": gpu_runs_page,
    "index.md": index_page,
}


def pages() -> dict[str, str]:
    """Every generated page, by its path under ``docs/``."""
    return {path: make() for path, make in PAGES.items()}


#: What griffe reports about the sources that is fixed there, not here: (the message's start,
#: where, the fix). Each is dropped from the build's warnings until its fix lands; any other
#: warning fails ``mkdocs build --strict``.
KNOWN_SOURCE_WARNINGS = (
    (
        "griffe: Unsupported item in mpnb.compat.fused_layer_norm.__all__",
        "mpnb/compat/fused_layer_norm.py:26",
        "spell __all__ as string literals instead of *_ln.__all__",
    ),
)


class _KnownWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not any(text.startswith(start) for start, _, _ in KNOWN_SOURCE_WARNINGS)


def on_startup(command, dirty):
    """mkdocs hook: drop the known source warnings (``KNOWN_SOURCE_WARNINGS``) from the build."""
    logging.getLogger("mkdocs.plugins.griffe").addFilter(_KnownWarnings())


def on_files(files, config):
    """mkdocs hook: add the generated pages to the build (they are never written to docs/)."""
    from mkdocs.structure.files import File

    for path, text in pages().items():
        files.append(File.generated(config, path, content=text))
    return files


def main(argv: list[str] | None = None) -> int:
    """Write the generated pages under the folder ``argv[0]``."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python scripts/gen_docs.py OUTDIR", file=sys.stderr)
        return 2
    for path, text in pages().items():
        out = Path(argv[0]) / path
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
