"""mpnb.compat.names: the one table of Apex's names, checked against the code it names."""

from __future__ import annotations

import importlib
import types

import pytest

from mpnb.compat import names
from mpnb.compat.names import EMULATES, LACKS, MODULES, NAMES, PRIVATE, PROVIDES

STATUSES = {PROVIDES, EMULATES, LACKS}


def test_every_row_has_a_known_status_and_a_port():
    for row in MODULES.values():
        assert row.status in STATUSES, row
        assert row.port, row
    for name, row in NAMES.items():
        assert row.status in STATUSES | {None}, name
        assert row.port, name
    for name, row in PRIVATE.items():
        assert row.status in STATUSES and row.what and row.mpnb and row.port, name


def test_a_module_lacks_exactly_when_it_has_no_mpnb_home():
    for row in MODULES.values():
        assert (row.mpnb is None) == (row.status == LACKS), row


@pytest.mark.parametrize("apex", [a for a, r in MODULES.items() if r.mpnb is not None])
def test_every_home_module_imports(apex):
    importlib.import_module(MODULES[apex].mpnb)


def test_rules_rows_name_a_module_whose_names_the_home_has():
    ruled = [row for row in MODULES.values() if row.rules]
    assert ruled, "apex_rules serves some rows"
    for row in ruled:
        rules, home = importlib.import_module(row.rules), importlib.import_module(row.mpnb)
        served = [n for n in rules.__all__ if hasattr(home, n)]
        assert served, f"{row.apex}: {row.rules} replaces none of {row.mpnb}'s names"


def test_names_belong_to_a_known_module():
    for name in NAMES:
        module = name.rpartition(".")[0]
        while module and module not in MODULES:
            module = module.rpartition(".")[0]
        assert module, f"{name}: no row of MODULES holds it"


def test_top_level_modules_re_export_their_core_module():
    tops = names.top_level_modules()
    assert tops["mpnb.amp"] == "mpnb.core.amp"
    for top, core in tops.items():
        a, b = importlib.import_module(top), importlib.import_module(core)
        assert a.__all__ == b.__all__, top
        # a subpackage name (mpnb.transformer.functional) is the top-level one once imported
        objects = [n for n in a.__all__ if not isinstance(getattr(b, n), types.ModuleType)]
        assert all(getattr(a, n) is getattr(b, n) for n in objects), top


def test_build_flags_are_apex_setup_options():
    flagged = {row.apex: row.build_flag for row in MODULES.values() if row.build_flag}
    assert flagged.get("fused_adam_cuda") == "--deprecated_fused_adam"
    assert all(flag.startswith("--") for flag in flagged.values())
