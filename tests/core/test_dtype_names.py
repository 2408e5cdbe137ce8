"""mpnb.core.dtype_names: every spelling of a dtype, converted in one place."""

import re
from pathlib import Path

import pytest
import torch

from mpnb.core import amp, dtype_names, hardware
from mpnb.core.dtype_names import (
    HALF_DTYPES,
    HALF_NAMES,
    half_dtype_name,
    lookup,
    parse_half_dtype,
    short_name,
    torch_name,
)

ROOT = Path(__file__).resolve().parents[2]

SPELLINGS = [
    ("fp32", "float32", torch.float32),
    ("bf16", "bfloat16", torch.bfloat16),
    ("fp16", "float16", torch.float16),
    ("fp8", "float8_e4m3fn", torch.float8_e4m3fn),
]


@pytest.mark.parametrize("short, long, dtype", SPELLINGS)
def test_every_spelling_names_one_dtype(short, long, dtype):
    for spelling in (short, long, dtype, str(dtype)):
        assert short_name(spelling) == short
        assert torch_name(spelling) == long
    assert getattr(torch, long) is dtype


def test_half_names_parse_to_their_dtypes_and_back():
    assert HALF_NAMES == ("bf16", "fp16")
    for name, dtype in HALF_DTYPES.items():
        assert parse_half_dtype(name) is dtype and half_dtype_name(name) == short_name(dtype)
    assert parse_half_dtype(None, "cpu") is torch.bfloat16
    assert parse_half_dtype("auto", "cuda") is torch.float16
    with pytest.raises(ValueError, match="half_dtype='fp8'") as e:
        parse_half_dtype("fp8")
    assert "'bf16'" in str(e.value)  # the valid choices are listed
    # amp's names are these, not a copy
    assert amp.HALF_DTYPES is HALF_DTYPES and amp.parse_half_dtype is parse_half_dtype


def test_lookup_reads_facts_keyed_either_way():
    short = {"bf16": "native", "fp16": "emulated", "fp8": "emulated"}
    long = {"bfloat16": "native", "float16": "emulated"}
    for facts in (short, long):
        assert lookup(facts, torch.float16) == "emulated" and lookup(facts, "bfloat16") == "native"
    with pytest.raises(KeyError, match="no fact for 'fp8'") as e:
        lookup(long, "fp8")
    assert "dtype_support" in str(e.value)  # the fix: pass doctor's facts


def test_status_of_reads_doctor_and_the_lab_alike():
    support = hardware.dtype_support("cpu")
    hw = {"bf16": support["bfloat16"].status, "fp8": support["float8_e4m3fn"].status}
    for dtype in ("bf16", torch.bfloat16, "bfloat16"):
        assert hardware.status_of(support, dtype) == support["bfloat16"].status
        assert hardware.status_of(hardware.half_support("cpu"), dtype) == hw["bf16"]
        assert hardware.status_of(hw, dtype) == hw["bf16"]
    assert hardware.status_of(support, "fp8") == hw["fp8"]


# Re-deriving a name mapping by hand: {"bf16": "bfloat16"}, {torch.float16: "fp16"},
# "fp16" if dtype == torch.float16 else "bf16", ...
_BY_HAND = re.compile(
    r"""["'](bf16|fp16|fp8)["']\s*:\s*(torch\.|["']b?float)"""
    r"""|["']b?float(16|8\w*)["']\s*:\s*(torch\.|["'](bf16|fp16|fp8)["'])"""
    r"""|torch\.b?float16\s*:\s*["']"""
    r"""|["'](bf16|fp16|b?float16)["']\s+if\s+\w+(\.\w+)?\s*==\s*torch\."""
)
_USERS = [
    "mpnb/lab",
    "mpnb/widgets",
    "mpnb/core/hardware.py",
    "mpnb/core/doctor.py",
    "mpnb/core/precision_configs",
]
_OTHERS = {"mpnb/widgets/scaler_explorer.py"}  # the scaler explorer's own dtype table


def test_hardware_lab_story_and_widgets_take_the_names_from_one_module():
    assert _BY_HAND.search('key = {"bf16": "bfloat16", "fp16": "float16"}')  # the guard works
    assert _BY_HAND.search('name = "fp16" if r.dtype == torch.float16 else "bf16"')
    files = []
    for user in _USERS:
        path = ROOT / user
        files += sorted(path.rglob("*.py")) if path.is_dir() else [path]
    found = [
        f"{f.relative_to(ROOT)}: {m.group(0)}"
        for f in files
        if str(f.relative_to(ROOT)) not in _OTHERS
        for m in _BY_HAND.finditer(f.read_text())
    ]
    assert not found, found
    assert Path(dtype_names.__file__).name == "dtype_names.py"
