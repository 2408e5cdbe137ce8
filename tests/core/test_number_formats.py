"""The table of number formats: its rows, its lookups, and "a new format is one row"."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pandas as pd
import pytest
import torch

from mpnb.core import hardware, number_formats
from mpnb.core._gemm_probe import GemmTiming, probe_sizes
from mpnb.core.fp8.fp4 import E2M1_MAX
from mpnb.core.number_formats import (
    FORMATS,
    GemmProbe,
    NumberFormat,
    format_named,
    format_of,
    register_format,
)

ROOT = Path(__file__).resolve().parents[2]


def test_the_table_has_one_row_per_format_with_its_facts():
    assert list(FORMATS) == ["fp32", "tf32", "bf16", "fp16", "fp8", "mxfp8", "nvfp4", "mxfp4"]
    assert format_named("fp8").torch_dtypes == (torch.float8_e4m3fn, torch.float8_e5m2)
    assert format_named("nvfp4").dtypes == () and format_named("nvfp4").element_max == E2M1_MAX
    assert 6.0 in format_named("mxfp4").elements and -0.5 in format_named("mxfp4").elements
    assert (format_named("nvfp4").block, format_named("mxfp4").block) == (16, 32)
    assert format_named("mxfp8").scale_dtype == "float8_e8m0fnu"
    assert format_named("fp8").min_capability == (8, 9)
    assert {format_named(n).min_capability for n in ("mxfp8", "nvfp4", "mxfp4")} == {(10, 0)}
    for f in FORMATS.values():
        assert f.description and f.consequences.keys() >= {"native", "emulated"}
        assert f.name == "fp32" or f.divergence_advice


def test_lookups_by_name_dtype_and_configuration():
    from mpnb.core.precision_configs import get_config

    assert format_of(torch.bfloat16).name == "bf16"
    assert format_of("float8_e5m2").name == "fp8" and format_of("fp16").name == "fp16"
    assert format_of("float8_e8m0fnu").name == "mxfp8"  # a block-scale dtype: its MX format
    assert format_of("int64") is None
    assert get_config("O2").number_format("bf16").name == "bf16"
    fp8_cfg = next(c for c in map(get_config, ("fp8-tensorwise",)) if c is not None)
    assert fp8_cfg.number_format(fp8_cfg.halves(["bf16"])[0]).is_fp8
    with pytest.raises(KeyError, match="register_format"):
        format_named("fp5")


def test_quantizers_are_found_from_the_row():
    x = torch.randn(4, 32)
    assert format_named("fp16").quantize(x).dtype == torch.float16
    assert format_named("mxfp4").quantize(x) is not None
    assert format_named("nvfp4").quantize(x) is not None


def _fp6() -> NumberFormat:
    grid = (0.0, 0.0625, 0.125, 0.25, 0.5, 1.0, 2.0, 28.0)
    return NumberFormat(
        "fp6",
        "fictitious FP6 E3M2, one float32 scale per tensor",
        ("float6_e3m2",),
        elements=grid,
        element_max=28.0,
        scale="per tensor, float32",
        probe=GemmProbe("float6_e3m2", op="scaled_mm", cpu_sizes=(16, 128)),
        native_min_speed=1.5,
        min_capability=(10, 0),
        capability_subject="FP6 GEMMs need",
        scaled=True,
        divergence_advice="use fp8",
        quantizer=lambda x: x.clamp(-28.0, 28.0),
    )


@pytest.fixture
def fp6(monkeypatch):
    monkeypatch.setattr(number_formats, "FORMATS", dict(FORMATS))  # restored after the test
    return register_format(_fp6())


def test_a_new_format_is_one_row(fp6, monkeypatch):
    # the hardware threshold and doctor's probe list
    assert hardware.NATIVE_MIN_SPEED["float6_e3m2"] == 1.5
    assert probe_sizes("cpu", "float6_e3m2") == (16, 128)
    timed = {}

    def fake_time(dtypes, device, stop=None):
        timed["dtypes"] = list(dtypes)
        return {d: [GemmTiming(128, 1e-3, 5e-4)] for d in dtypes}

    monkeypatch.setattr(hardware, "time_gemms", fake_time)
    got = hardware._probe(torch.device("cpu"))
    assert "float6_e3m2" in timed["dtypes"] and got["float6_e3m2"].status == "native"
    assert "FP6 GEMMs need 10.0+" in hardware._cuda_rule(
        "float6_e3m2", {"name": "H100", "capability": "9.0"}
    )
    # the trace's low-precision test
    from mpnb.lab import precision_trace

    ops = pd.DataFrame({"dtype": ["float32", "float6_e3m2"]})
    assert precision_trace.has_scaled_ops(ops)
    assert not precision_trace.has_scaled_ops(ops.iloc[:1])
    assert fp6.quantize(torch.tensor([40.0])).item() == 28.0
    with pytest.raises(ValueError, match="exists already"):
        register_format(dataclasses.replace(fp6))


#: what code above core must not compare (it asks the format's row instead):
#: ``x.startswith("float8...")``; ``==``/``!=``/``in`` against a low-precision dtype's name
#: (torch or short); and any comparison with a row's display text (``"fp8 (emulated)"``).
_NAMES = re.compile(r"(bfloat16|float16|float8\w*|bf16|fp16|fp8|nvfp4|mxfp[48])")
_TEXT = re.compile(r"\w+ \((native|emulated|unsupported)\)")
#: files not yet converted, owned elsewhere (each one is a change listed in the report)
KNOWN: set[str] = set()


def _banned(node: ast.AST) -> bool:
    def name_or_text(n):
        s = n.value if isinstance(n, ast.Constant) and isinstance(n.value, str) else None
        return s is not None and bool(_NAMES.fullmatch(s) or _TEXT.fullmatch(s))

    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
        args = node.args[:1]
        if node.func.attr == "startswith" and args and isinstance(args[0], ast.Constant):
            return str(args[0].value).startswith("float")
        return node.func.attr in ("eq", "ne", "isin") and any(map(name_or_text, args))
    if isinstance(node, ast.Compare):
        sides = [node.left, *node.comparators]
        elts = [e for s in sides if isinstance(s, ast.Tuple | ast.List | ast.Set) for e in s.elts]
        return any(map(name_or_text, sides + elts))
    return False


def test_nothing_above_core_switches_on_a_dtype_name_or_display_text():
    found = []
    for top in ("mpnb/lab", "mpnb/widgets"):
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = str(path.relative_to(ROOT))
            if rel in KNOWN:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if _banned(node):
                    found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def test_the_tables_element_facts_are_the_ones_fp8_quantizes_with():
    # the table names its elements itself (it sits below mpnb.core.fp8 in the layers), so
    # this ties its FP8 and E2M1 facts to the quantizers' own
    from mpnb.core.fp8 import fp4
    from mpnb.core.fp8.formats import E4M3, E5M2, fp8_max

    assert fp4.E2M1_GRID is number_formats.E2M1_GRID and fp4.E2M1_MAX == E2M1_MAX
    fp8 = format_named("fp8")
    assert fp8.element_max == fp8_max(E4M3) == 448.0
    assert fp8.torch_dtypes == (E4M3, E5M2)
