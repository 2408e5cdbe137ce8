"""Native vs emulated low precision, measured: the classifier, the probe's caps, the cache.

The classifier and the probe's control flow are tested on fake timings (no timing is ever
asserted). The subprocess cases run ``mpnb doctor`` and a short ``mpnb compare`` natively and
under ``ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2`` on a CPU with avx512_bf16: the two
environments must give two different answers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from mpnb.core import _gemm_probe as probe
from mpnb.core import hardware
from mpnb.core._gemm_probe import GemmTiming
from mpnb.core.hardware import NATIVE_MIN_SPEED, DtypeSupport, classify

AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


# -- the classifier ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    "dtype, fp32_ms, dtype_ms, expected",
    [
        ("bfloat16", 1.8, 0.39, "native"),  # AMX: 4.6x faster than fp32
        ("float16", 1.8, 1.7, "native"),  # AVX512-FP16: about fp32's speed is native
        ("float16", 1.8, 3.6, "native"),  # half fp32's speed: still not emulated
        ("bfloat16", 1.8, 117.0, "emulated"),  # software bf16: 65x slower
        ("float16", 1.8, 100.0, "emulated"),
        ("bfloat16", 1.0, 5.0, "emulated"),  # 5x slower: "several times slower" is emulated
        ("float8_e4m3fn", 1.0, 0.5, "native"),  # FP8 hardware beats fp32
        ("float8_e4m3fn", 1.0, 1.5, "emulated"),  # dequantized to a wider type: slower
    ],
)
def test_classify_decides_from_the_measured_ratio(dtype, fp32_ms, dtype_ms, expected):
    got = classify(dtype, [GemmTiming(128, fp32_ms * 1e-3, dtype_ms * 1e-3)], "ATen AVX512")
    assert got.status == expected
    assert got.speed_vs_fp32 == pytest.approx(fp32_ms / dtype_ms)
    assert f"{fp32_ms / dtype_ms:.2f}x fp32's GEMM speed" in got.reason
    assert "128x128" in got.reason and got.reason.endswith("ATen AVX512")


def test_classify_reads_the_last_size_tried():
    small, large = GemmTiming(16, 1e-6, 1.5e-6), GemmTiming(128, 1e-4, 2e-5)
    assert classify("float8_e4m3fn", [small, large], "").status == "native"
    assert classify("float8_e4m3fn", [large, small], "").status == "emulated"


def test_the_line_sits_between_native_and_emulated_halves():
    # emulated half GEMMs measure 20-400x slower than fp32, native ones 0.5-5x faster
    for dtype in ("bfloat16", "float16"):
        assert 1 / 20 < NATIVE_MIN_SPEED[dtype] < 0.5


# -- the probe's control flow, on a fake clock -------------------------------------------------
class FakeClock:
    """Seconds per call for each dtype; counts how many timed calls each dtype got."""

    def __init__(self, seconds: dict, fail: set = frozenset()):
        self.seconds, self.fail, self.calls = seconds, fail, {}

    def gemm(self, dtype, n, device):
        if dtype in self.fail:
            raise RuntimeError(f"could not create a primitive descriptor ({dtype})")

        def fn():  # the warm-up call
            return None

        fn.key = (dtype, n)
        return fn

    def time(self, fn, number, device):
        dtype, n = fn.key
        self.calls[fn.key] = self.calls.get(fn.key, 0) + number
        return self.seconds[dtype] * (n / 128) ** 3


@pytest.fixture
def clock(monkeypatch):
    def install(seconds, fail=frozenset()):
        fake = FakeClock(seconds, fail)
        monkeypatch.setattr(probe, "_gemm", fake.gemm)
        monkeypatch.setattr(probe, "_seconds", fake.time)
        return fake

    return install


def test_an_emulated_dtype_is_timed_once_and_a_native_one_several_times(clock):
    fake = clock({"float32": 2e-5, "bfloat16": 1e-3, "float16": 4e-5})
    stop = {d: NATIVE_MIN_SPEED[d] / 8 for d in NATIVE_MIN_SPEED}
    got = probe.time_gemms(["bfloat16", "float16"], "cpu", stop)
    assert fake.calls[("bfloat16", 128)] == 2  # 50x slower: two single calls settle it
    assert fake.calls[("float16", 128)] > 1  # close to the line: the fastest of several
    assert fake.calls[("float32", 128)] > 1  # timed once, shared by both dtypes
    assert got["bfloat16"][-1].speed_vs_fp32 == pytest.approx(0.02)


def test_one_preempted_call_does_not_settle_a_native_dtype(clock):
    """On a busy machine one call can take 50x its time; the probe must not call a native
    dtype emulated for that (seen once in about 20 runs of notebook 01)."""
    fake = clock({"float32": 2e-5, "bfloat16": 1e-5})
    slow_first = iter([1e-3])
    timed = fake.time

    def time(fn, number, device):
        t = timed(fn, number, device)
        return next(slow_first, t) if fn.key == ("bfloat16", 128) else t

    probe._seconds = time  # the fixture's monkeypatch restores the real clock
    got = probe.time_gemms(["bfloat16"], "cpu", {"bfloat16": NATIVE_MIN_SPEED["bfloat16"] / 8})
    assert got["bfloat16"][-1].speed_vs_fp32 == pytest.approx(2.0)


def test_fp8_on_a_cpu_starts_small_and_grows_only_when_undecided(clock):
    stop = {"float8_e4m3fn": NATIVE_MIN_SPEED["float8_e4m3fn"] / 8}
    fake = clock({"float32": 2e-5, "float8_e4m3fn": 2e-2})  # 1000x slower
    got = probe.time_gemms(["float8_e4m3fn"], "cpu", stop)["float8_e4m3fn"]
    assert [t.n for t in got] == [16] and ("float8_e4m3fn", 128) not in fake.calls
    clock({"float32": 2e-5, "float8_e4m3fn": 1e-5})  # as fast as fp32 at 16: try 128
    got = probe.time_gemms(["float8_e4m3fn"], "cpu", stop)["float8_e4m3fn"]
    assert [t.n for t in got] == [16, 128]


def test_a_gemm_pytorch_cannot_run_is_unsupported_and_the_threads_are_restored(clock, monkeypatch):
    clock({"float32": 2e-5, "bfloat16": 1e-5, "float16": 1e-5}, fail={"float8_e4m3fn"})
    prior = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        monkeypatch.setattr(hardware, "_evidence", lambda d, dev: "ATen AVX2")
        got = hardware._probe(torch.device("cpu"))
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(prior)
    assert got["float8_e4m3fn"].status == "unsupported"
    assert got["float8_e4m3fn"].speed_vs_fp32 is None
    assert "primitive descriptor" in got["float8_e4m3fn"].reason
    assert got["bfloat16"] == DtypeSupport("bfloat16", "native", 2.0, got["bfloat16"].reason)


def test_the_real_probe_restores_the_thread_count():
    prior = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        probe.time_gemms(["bfloat16"], "cpu")
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(prior)


def test_the_answer_is_cached_per_process_and_keyed_by_the_environment(monkeypatch):
    calls = []

    def fake_probe(device):
        calls.append(os.environ.get("ATEN_CPU_CAPABILITY"))
        s = "emulated" if calls[-1] == "avx2" else "native"
        return {d: DtypeSupport(d, s, None, "fake") for d in NATIVE_MIN_SPEED}

    monkeypatch.setattr(hardware, "_probe", fake_probe)
    hardware._dtype_support.cache_clear()
    try:
        for k in AVX2_ENV:
            monkeypatch.delenv(k, raising=False)
        assert hardware.half_support("cpu")["bfloat16"] == "native"
        assert hardware.half_support("cpu")["bfloat16"] == "native"
        assert len(calls) == 1  # cached
        monkeypatch.setenv("ATEN_CPU_CAPABILITY", "avx2")
        assert hardware.half_support("cpu") == {"bfloat16": "emulated", "float16": "emulated"}
        assert len(calls) == 2  # a changed environment is probed again
    finally:
        hardware._dtype_support.cache_clear()


def test_cuda_without_a_device_is_unsupported_without_timing_anything(monkeypatch):
    monkeypatch.setattr(hardware, "cuda_info", lambda index=0: None)
    monkeypatch.setattr(hardware, "time_gemms", lambda *a, **k: pytest.fail("timed"))
    got = hardware._probe(torch.device("cuda", 0))
    assert {s.status for s in got.values()} == {"unsupported"}


def test_old_gpus_refuse_bf16_and_fp8_before_any_probe():
    info = {"name": "Tesla V100", "capability": "7.0"}
    assert "bf16 needs 8.0+" in hardware._cuda_rule("bfloat16", info)
    assert "need 8.9+" in hardware._cuda_rule("float8_e4m3fn", info)
    assert hardware._cuda_rule("float16", info) == ""
    assert hardware._cuda_rule("float8_e4m3fn", {"name": "H100", "capability": "9.0"}) == ""


def test_fp8_layers_fall_back_where_scaled_mm_cannot_run_here(monkeypatch):
    from mpnb.core import fp8
    from mpnb.core.fp8 import gemm

    a = fp8.quantize_tensorwise(torch.randn(4, 8), fp8.E4M3)
    b = fp8.quantize_tensorwise(torch.randn(6, 8), fp8.E4M3)
    failed = DtypeSupport("float8_e4m3fn", "unsupported", None, "the fp8 GEMM failed: oneDNN")
    monkeypatch.setattr(gemm, "dtype_support", lambda d: {"float8_e4m3fn": failed})
    category, why = fp8.scaled_mm_blocker(a, b, torch.float32)
    assert category == "device" and "oneDNN" in why


@pytest.mark.parametrize("status, category", [("native", None), ("emulated", "speed")])
def test_fp8_layers_use_scaled_mm_only_where_it_measured_faster(monkeypatch, status, category):
    """On an AMX CPU torch._scaled_mm runs through oneDNN far slower than float32: the probe
    says "emulated" and the layer computes the same math with the emulated GEMM, silently
    (doctor and the verdict name FP8 emulated)."""
    import warnings

    from mpnb.core import fp8
    from mpnb.core.fp8 import gemm

    support = DtypeSupport("float8_e4m3fn", status, 0.01, "probe: 0.01x fp32's speed")
    monkeypatch.setattr(gemm, "dtype_support", lambda d: {"float8_e4m3fn": support})
    a = fp8.quantize_tensorwise(torch.randn(4, 8), fp8.E4M3)
    b = fp8.quantize_tensorwise(torch.randn(6, 8), fp8.E4M3)
    blocker = fp8.scaled_mm_blocker(a, b, torch.float32)
    assert (blocker and blocker[0]) == category
    layer = fp8.convert_to_float8_training(torch.nn.Sequential(torch.nn.Linear(8, 6)), "tensorwise")
    with warnings.catch_warnings():
        warnings.simplefilter("error", fp8.Float8FallbackWarning)
        layer(torch.randn(4, 8)).sum().backward()


# -- the two environments, end to end ----------------------------------------------------------
def _has_avx512_bf16() -> bool:
    return "avx512_bf16" in hardware.cpu_info().flags


needs_bf16 = pytest.mark.skipif(
    not _has_avx512_bf16(), reason="needs a CPU with avx512_bf16 (native bf16 to switch off)"
)


def _run(args, extra_env, timeout=600):
    env = {k: v for k, v in os.environ.items() if k not in AVX2_ENV}
    env.update(extra_env, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "mpnb.cli", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.mark.e2e
@needs_bf16
def test_doctor_gives_two_answers_under_the_two_environments():
    native = _run(["doctor", "--no-build"], {})
    emulated = _run(["doctor", "--no-build"], AVX2_ENV)
    assert "bf16 on CPU: native: " in native and "ATen capability AVX512" in native
    assert "bf16 on CPU: emulated: " in emulated and "ATen capability AVX2" in emulated
    assert "oneDNN ISA limit AVX2" in emulated
    assert "present, but not used by PyTorch in this process" in emulated


@pytest.mark.e2e
@pytest.mark.slow
@needs_bf16
def test_compare_labels_and_verdict_follow_the_environment():
    args = [
        "compare",
        "--workload",
        "mlp",
        "--opt-levels",
        "O0,O3,fp8-tensorwise",
        "--steps",
        "3",
        "--threads",
        "1",
        "--json",
        "--out",
        "",
    ]
    native = json.loads(_run(args, {}))
    emulated = json.loads(_run(args, AVX2_ENV))
    assert native["hardware"]["bf16"] == "native" and emulated["hardware"]["bf16"] == "emulated"
    labels = {
        e: {r["configuration"]: r["precision"] for r in d["rows"]}
        for e, d in (("native", native), ("emulated", emulated))
    }
    assert "bf16 (native)" in labels["native"].values()
    assert "bf16 (emulated)" in labels["emulated"].values()
    for d in (native, emulated):  # under the ISA limit torch._scaled_mm fails: emulated GEMM
        assert all(not r["error"] for r in d["rows"]), [r["error"] for r in d["rows"]]
    assert "bf16" in emulated["verdict"]["emulated"]
    assert "bf16" not in native["verdict"]["emulated"]
