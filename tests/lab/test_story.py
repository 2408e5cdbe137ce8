"""The lessons' hardware sentences: fed native and emulated facts and measured numbers, every
sentence must say what the numbers say and explain it with the fact it was given."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from mpnb.core.hardware import DtypeSupport
from mpnb.lab import story
from mpnb.lab._rows import speed_label
from mpnb.lab.verdict import verdict

NATIVE = {
    "bfloat16": DtypeSupport("bfloat16", "native", 2.8, "2.80x fp32's GEMM speed; AMX"),
    "float16": DtypeSupport("float16", "native", 1.1, "1.10x fp32's GEMM speed; AVX512-FP16"),
    "float8_e4m3fn": DtypeSupport("float8_e4m3fn", "emulated", 0.01, "0.01x fp32's speed"),
}
EMULATED = {
    "bfloat16": DtypeSupport("bfloat16", "emulated", 0.05, "0.05x fp32's GEMM speed; AVX2"),
    "float16": DtypeSupport("float16", "emulated", 0.01, "0.01x fp32's GEMM speed; AVX2"),
    "float8_e4m3fn": DtypeSupport("float8_e4m3fn", "unsupported", None, "the fp8 GEMM failed"),
}


@pytest.mark.parametrize("facts", [NATIVE, EMULATED], ids=["native", "emulated"])
def test_hardware_says_the_fact_its_meaning_and_the_evidence(facts):
    text = story.hardware(facts)
    for long, short in (("bfloat16", "bf16"), ("float16", "fp16")):
        fact = facts[long]
        assert f"On this CPU {short} is {fact.status}:" in text
        assert fact.reason in text  # doctor's evidence, as measured
    native = facts["bfloat16"].status == "native"
    assert ("can save time as well as memory" in text) == native
    assert ("saves memory here, not time" in text) == (not native)


def test_every_way_of_keying_the_facts_gives_the_same_status():
    plain = {"bfloat16": "emulated", "float16": "native"}  # half_support's shape
    attrs = {"bf16": "emulated", "fp16": "native", "fp8": "emulated"}  # a compare's attrs
    for facts in (plain, attrs, {**EMULATED, "float16": NATIVE["float16"]}):
        assert story.status(facts, "bf16") == story.status(facts, "bfloat16") == "emulated"
        assert story.status(facts, "fp16") == "native"
    assert story.hardware(plain, dtypes=["bf16"]) == (
        "On this CPU bf16 is emulated: it saves memory here, not time."
    )
    with pytest.raises(KeyError, match="no fact for 'fp8'") as e:
        story.status(plain, "fp8")
    assert "story.facts" in str(e.value)  # where the facts are


def _number(text: str) -> float:
    return float(re.search(r"(\d+\.\d+)x (?:faster|slower)", text).group(1))


# (fact, ratio, lo, hi, the direction the numbers say, the explanation the fact gives)
CASES = [
    ("emulated", 0.20, 0.18, 0.22, "slower", "As expected where bf16 is emulated"),
    ("emulated", 1.02, 0.90, 1.15, "same", "Unexpected where bf16 is emulated"),
    ("emulated", 1.30, 1.10, 1.50, "faster", "Unexpected where bf16 is emulated"),
    ("native", 1.64, 1.40, 1.90, "faster", "its faster arithmetic shows"),
    ("native", 0.95, 0.80, 1.10, "same", "not faster here: at this size the casts to and from"),
    ("native", 0.35, 0.30, 0.40, "slower", "yet slower here: at this size the casts to and from"),
]


@pytest.mark.parametrize("fact, ratio, lo, hi, way, why", CASES)
def test_outcome_says_what_the_numbers_say_and_why(fact, ratio, lo, hi, way, why):
    text = story.outcome({"bf16": fact}, "bf16", ratio, lo, hi, subject="O3")
    assert story.direction(ratio, lo, hi) == way
    assert why in text and f"bf16 is {fact}" in text.replace("where bf16 is", "bf16 is")
    label = speed_label(ratio, lo, hi)  # what the table and the chart print for the same row
    if way == "same":
        assert "no measurable difference" in text and label == "no measurable difference"
        assert f"{lo:.2f}x-{hi:.2f}x contains 1" in text
    else:
        assert f"O3 ran {label}" in text  # the same words and number as the views
        assert _number(text) == pytest.approx(ratio if way == "faster" else 1 / ratio, abs=0.005)
        measured = text.split(". ")[0]
        assert ("faster" in measured) == (way == "faster")
        assert ("slower" in measured) == (way == "slower")


def test_outcome_without_an_interval_reads_the_ratio_alone():
    slow = story.outcome(EMULATED, "bf16", 1 / 27.3, subject="the bf16 forward", baseline="fp32")
    assert slow.startswith("Measured: the bf16 forward ran 27.30x slower than fp32.")
    assert "interval" not in slow and "As expected where bf16 is emulated" in slow
    fast = story.outcome(NATIVE, "bf16", 2.5, subject="the bf16 matmul", baseline="fp32")
    assert "2.50x faster than fp32" in fast and "bf16 is native" in fast


def test_outcome_names_why_native_was_not_faster():
    why = "PyTorch's {dtype} kernel for this shape costs {cost} its fp32 one"
    slower = story.outcome(
        NATIVE, "fp16", 0.5, subject="the fp16 matmul", baseline="fp32", not_faster=why
    )
    assert slower.endswith(
        "fp16 is native on this CPU, yet slower here: PyTorch's fp16 kernel "
        "for this shape costs more than its fp32 one."
    )
    same = story.outcome(NATIVE, "fp16", 1.0, 0.9, 1.1, not_faster=why)
    assert "not faster here: PyTorch's fp16 kernel for this shape costs about as much as" in same
    default = story.outcome(NATIVE, "fp16", 0.5)
    assert (
        "the casts to and from fp16, the per-op overhead and the ops that stay fp32 cost more"
        in default
    )


def test_fp8_is_read_for_accuracy_not_memory():
    text = story.outcome({"fp8": "emulated"}, "fp8", 0.5, 0.4, 0.6, subject="fp8-delayed b64")
    assert "dequantized and multiplied in float32" in text and "FP8's accuracy" in text
    assert "saves only memory" not in text
    assert "its rows show FP8's accuracy here" in story.hardware(NATIVE, dtypes=["fp8"])


def _frame(half_status: str, o3: tuple[float, float, float]) -> pd.DataFrame:
    ratio, lo, hi = o3
    rows = [
        dict(
            configuration="O0 fp32 b16",
            opt_level="O0",
            half_dtype="fp32",
            precision="fp32",
            status="ok",
            speedup_vs_O0=1.0,
            speedup_lo=1.0,
            speedup_hi=1.0,
        ),
        dict(
            configuration="O3 bf16 b16",
            opt_level="O3",
            half_dtype="bf16",
            precision=f"bf16 ({half_status})",
            status="ok",
            speedup_vs_O0=ratio,
            speedup_lo=lo,
            speedup_hi=hi,
        ),
        dict(
            configuration="O2 bf16 b16",
            opt_level="O2",
            half_dtype="bf16",
            precision=f"bf16 ({half_status})",
            status="error",
            speedup_vs_O0=float("nan"),
            speedup_lo=float("nan"),
            speedup_hi=float("nan"),
        ),
    ]
    df = pd.DataFrame(rows)
    cols = zip(df.speedup_vs_O0, df.speedup_lo, df.speedup_hi, strict=True)
    df["speed_label"] = [speed_label(*c, baseline=(i == 0)) for i, c in enumerate(cols)]
    df.attrs["hardware"] = dict(device="cpu", bf16=half_status, fp16=half_status, fp8="emulated")
    return df


@pytest.mark.parametrize(
    "half, o3, expect",
    [
        ("emulated", (0.17, 0.16, 0.19), "As expected where bf16 is emulated"),
        ("native", (1.23, 1.10, 1.40), "bf16 is native on this CPU, and its faster"),
        ("native", (0.80, 0.70, 0.90), "bf16 is native on this CPU, yet"),
    ],
)
def test_compare_story_agrees_with_each_rows_numbers_and_fact(half, o3, expect):
    df = _frame(half, o3)
    lines = story.compare(df)
    assert len(lines) == 1  # O0 is the baseline and the failed O2 has no speed
    o3_row = df.iloc[1]
    assert lines[0].startswith(f"Measured: O3 bf16 b16 ran {o3_row.speed_label}")
    assert expect in lines[0]


@pytest.mark.parametrize("half", ["native", "emulated"])
def test_the_verdict_speaks_through_the_story(half):
    df = _frame(half, (0.17, 0.16, 0.19))
    for col, val in dict(
        error="",
        peak_mem_mib=[10.0, 5.0, 5.0],
        mem_saving_vs_O0=[0.0, 0.5, 0.5],
        metric=0.9,
        metric_vs_O0=0.0,
        metric_name="accuracy",
        batch_size=16,
    ).items():
        df[col] = val
    v = verdict(df)
    lines = story.emulation_lines(["bf16"] if half == "emulated" else [], "cpu")
    assert all(line in v["text"] for line in lines)
    assert ("half precision saves memory here, not time" in v["text"]) == (half == "emulated")
    assert v["recommendation"].endswith(
        f"stay with O0 on this machine{story.emulated_clause(v['emulated'])}; if memory is the "
        "limit, O3 bf16 b16 saves 50%."
    )


def test_fixed_cost_reads_the_two_times():
    text = story.fixed_cost(0.25, 300e-6, "mpnb.amp O1", "autocast + GradScaler")
    assert text.startswith("Measured: mpnb.amp O1 at 0.25x the speed of autocast + GradScaler")
    assert "900 us more per call of 300 us (300% on top)" in text and "1.8%" in text
    assert "30 us less per call of 330 us" in story.fixed_cost(1.1, 330e-6)


def test_facts_are_doctors_measured_facts():
    facts = story.facts("cpu")
    assert {facts[d].status for d in ("bfloat16", "float16")} <= {"native", "emulated"}
    text = story.hardware(facts)
    assert all(facts[d].reason in text for d in ("bfloat16", "float16"))
