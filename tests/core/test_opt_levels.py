"""mpnb.core.opt_levels: the opt levels' names, descriptions, default list and check, once."""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from mpnb.core import amp
from mpnb.core.opt_levels import (
    OPT_LEVEL_DESCRIPTIONS,
    OPT_LEVEL_NAMES,
    check_names,
    parse_opt_level,
)
from mpnb.core.precision_configs import DEFAULT_CONFIGS, PRECISION_CONFIGS, get_config

ROOT = Path(__file__).resolve().parents[2]


def test_check_names_names_the_bad_values_and_the_choices():
    check_names(["O0", "O3"], OPT_LEVEL_NAMES, "unknown level")
    with pytest.raises(ValueError) as e:
        check_names(["O0", "02", "O9", 2], OPT_LEVEL_NAMES, "unknown level")
    assert str(e.value) == (
        "unknown level '02', 'O9', 2 (use the letter O, not zero); valid choices: O0, O1, O2, O3."
    )
    with pytest.raises(ValueError, match=r"^unknown level 'O9';") as e:
        check_names(["O9"], OPT_LEVEL_NAMES, "unknown level")
    assert "letter O" not in str(e.value)


def test_every_entry_point_refuses_a_zero_with_the_same_hint():
    from mpnb.lab.config import expand

    hint = "(use the letter O, not zero)"
    with pytest.raises(ValueError, match=r"^amp.initialize: ") as e:
        amp.initialize(torch.nn.Linear(2, 2), opt_level="02")
    assert "opt_level '02' " + hint in str(e.value)
    with pytest.raises(ValueError, match=r"^amp.initialize: unknown") as e:
        parse_opt_level("02")
    assert "opt_level" in str(e.value)
    with pytest.raises(ValueError, match=r"^unknown precision") as e:
        get_config("02")
    assert "config '02' " + hint in str(e.value) and "mxfp8" in str(e.value)
    with pytest.raises(ValueError, match="unknown configuration") as e:
        expand("mlp", ("O0", "02"), steps=4, device="cpu")
    assert "'02' " + hint in str(e.value) and "mxfp8" in str(e.value)
    cmd = [sys.executable, "-m", "mpnb.cli", "compare", "--configs", "O0,02", "--json"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and hint in p.stderr and not p.stdout
    # the hint is written once, where the check is (docstrings may mention it)
    files = [
        f for f in (ROOT / "mpnb").rglob("*.py") if "use the letter O, not zero" in f.read_text()
    ]
    assert [f.name for f in files] == ["opt_levels.py"]


def test_one_description_per_level_for_amp_and_the_configurations():
    for name, text in OPT_LEVEL_DESCRIPTIONS.items():
        assert amp.OPT_LEVELS[name].brief == text == PRECISION_CONFIGS[name].description
    props = amp.resolve_properties("O2")
    assert OPT_LEVEL_DESCRIPTIONS["O2"] in amp._properties.format_properties(props)


def test_the_default_list_is_one_constant():
    import mpnb.lab
    import mpnb.widgets
    from mpnb.core.precision_configs import default_configs
    from mpnb.lab.config import expand
    from mpnb.lab.profiling import profile
    from mpnb.widgets._compare_controls import DEFAULT_LEVELS

    # compare's default: Apex's levels and torch.amp beside them (tf32 too on CUDA)
    assert DEFAULT_CONFIGS == (*OPT_LEVEL_NAMES, "torch-amp") == default_configs("cpu")
    assert default_configs("cuda:1") == (*DEFAULT_CONFIGS, "tf32")
    assert DEFAULT_LEVELS is DEFAULT_CONFIGS
    assert inspect.signature(expand).parameters["configs"].default is DEFAULT_CONFIGS
    # the profiler times amp's phases: Apex's levels only
    for fn in (profile, mpnb.widgets.profile):
        assert inspect.signature(fn).parameters["opt_levels"].default is OPT_LEVEL_NAMES
    # compare and the widget take None for "the default", resolved to the same constant
    from mpnb.lab.config import configs_argument

    assert configs_argument(None) is DEFAULT_CONFIGS
    assert configs_argument(None, device="cpu") == DEFAULT_CONFIGS
    assert inspect.signature(mpnb.lab.compare).parameters["configs"].default is None
    levels = re.compile(r"""["']O0["'],\s*["']O1["'],\s*["']O2["'],\s*["']O3["']""")
    spelled = [f.name for f in (ROOT / "mpnb").rglob("*.py") if levels.search(f.read_text())]
    assert spelled == ["opt_levels.py"], spelled  # its docstring shows the value
