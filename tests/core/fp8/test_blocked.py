"""The native block-scaled GEMM path (MXFP8, MXFP4, NVFP4 in torch._scaled_mm, sm100+).

No sm100 GPU is reachable here, so the layouts are tested against torchao's and torch's own
conventions, and the dispatcher against a pure-PyTorch interpretation of what cuBLAS is given
(the packed E2M1 bytes and the swizzled scales, decoded by index arithmetic written here).
"""

import warnings

import pytest
import torch

from mpnb.core.fp8 import blocked, gemm
from mpnb.core.fp8.fp4 import E2M1_GRID, pack_e2m1, round_to_e2m1
from mpnb.core.fp8.linear import Float8FallbackWarning, Float8Linear
from mpnb.core.fp8.mxfp4 import quantize_mxfp4
from mpnb.core.fp8.nvfp4 import quantize_nvfp4
from mpnb.core.fp8.quantize import quantize_mx
from mpnb.core.precision_configs import get_config


def _ao_utils():
    """torchao's MX helpers, imported in the test: torchao imports torch._dynamo (and so
    triton), which must not happen while the Triton tests' folder is still being collected."""
    return pytest.importorskip("torchao.prototype.mx_formats.utils")


SHAPES = [(128, 4), (1, 1), (144, 7), (300, 14), (256, 8), (5, 33), (129, 5)]


@pytest.mark.parametrize("dtype", [torch.float8_e8m0fnu, torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", SHAPES)
def test_to_blocked_is_torchaos_layout(shape, dtype):
    raw = torch.randint(
        0, 255, shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    scales = raw.view(dtype)
    got = blocked.to_blocked(scales)
    want = _ao_utils().to_blocked(scales)
    assert got.dtype == dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(blocked.from_blocked(got, *shape).view(torch.uint8), raw)


def test_from_blocked_refuses_a_wrong_size():
    with pytest.raises(ValueError, match="rows and columns"):
        blocked.from_blocked(torch.zeros(511, dtype=torch.uint8), 2, 4)
    with pytest.raises(ValueError, match="2-D"):
        blocked.to_blocked(torch.zeros(8, dtype=torch.uint8))


def test_fp4_packing_is_torchs_float4_e2m1fn_x2():
    common = pytest.importorskip("torch.testing._internal.common_quantized")
    grid = torch.tensor(E2M1_GRID[1:] + tuple(-g for g in E2M1_GRID[1:]) + (0.0,))
    gen = torch.Generator().manual_seed(1)
    x = grid[torch.randint(0, grid.numel(), (64, 32), generator=gen)]
    x[0, :15], x[0, 15:30] = grid, grid.flip(0)  # every value in both nibbles
    ours = blocked.as_float4_x2(pack_e2m1(round_to_e2m1(x)))
    torchs = common._bfloat16_to_float4_e2m1fn_x2(x.bfloat16())  # how torch's tests feed it
    assert ours.dtype == torch.float4_e2m1fn_x2 and ours.shape == (64, 16)
    assert torch.equal(ours.view(torch.uint8), torchs.view(torch.uint8))
    with pytest.raises(TypeError, match="pack_e2m1"):
        blocked.as_float4_x2(torch.zeros(2, 2))


# --- a pure-PyTorch interpretation of torch._scaled_mm's block-scaled operands -------------


def _e2m1(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 by its bits: sign, 2 exponent bits (bias 1), 1 mantissa bit."""
    sign = 1.0 - 2.0 * ((codes >> 3) & 1).double()
    e, m = ((codes >> 1) & 3).double(), (codes & 1).double()
    mag = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1) * (1 + 0.5 * m))
    return sign * mag


def _rows_of(mat: torch.Tensor, even_high: bool = False) -> torch.Tensor:
    """(rows, K) float64 values of a row-major operand (float8, or float4_e2m1fn_x2 bytes:
    the even element in the low nibble; ``even_high`` reads it wrongly, from the high one)."""
    if mat.dtype != torch.float4_e2m1fn_x2:
        return mat.double()
    b = mat.view(torch.uint8).long()
    pair = [b >> 4, b & 15] if even_high else [b & 15, b >> 4]
    return _e2m1(torch.stack(pair, dim=-1).reshape(b.shape[0], -1))


def _unswizzle(flat: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """cuBLAS's 128x4 tiles, 32x4x4 inside, read by index (not by reshaping)."""
    r, c = torch.arange(rows)[:, None], torch.arange(cols)[None, :]
    col_tiles = -(-cols // 4)
    idx = ((r // 128) * col_tiles + c // 4) * 512 + (r % 32) * 16 + ((r % 128) // 32) * 4 + c % 4
    return flat.view(torch.uint8)[idx].view(flat.dtype).double()


def _row_major_scales(flat, rows, cols):
    """A wrong reading: the flat scales as the padded matrix, row after row (no swizzle)."""
    padded_cols = -(-cols // 4) * 4
    return flat.view(torch.uint8).view(-1, padded_cols)[:rows, :cols].view(flat.dtype).double()


def interpret(read_scales=_unswizzle, even_high=False):
    """A stand-in for torch._scaled_mm that computes the block-scaled GEMM from its operands.

    ``even_high`` misreads the first operand's nibbles only: the same swap in both operands
    permutes K within a block alike on both sides and leaves every product unchanged."""

    def scaled_mm(mat_a, mat_b, scale_a, scale_b, bias=None, out_dtype=None, **kw):
        assert mat_b.stride(0) == 1, "the second operand must be column-major"
        a, b = _rows_of(mat_a, even_high), _rows_of(mat_b.t())
        block = 16 if scale_a.dtype == torch.float8_e4m3fn else 32
        k = a.shape[1]
        kb = -(-k // block)
        for s, rows in ((scale_a, a.shape[0]), (scale_b, b.shape[0])):
            want = -(-rows // 128) * 128 * (-(-kb // 4) * 4)
            if s.numel() != want:
                raise ValueError(f"scale should have {want} elements, got {s.numel()}")
        sa = read_scales(scale_a, a.shape[0], kb).repeat_interleave(block, 1)
        sb = read_scales(scale_b, b.shape[0], kb).repeat_interleave(block, 1)
        y = (a * sa[:, :k]) @ (b * sb[:, :k]).t()
        return y.to(out_dtype)

    def counted(*args, **kw):
        counted.calls += 1
        return scaled_mm(*args, **kw)

    counted.calls = 0
    return counted


def _data(rows, k, seed):
    gen = torch.Generator().manual_seed(seed)
    e = torch.randint(-6, 7, (rows, k // 16), generator=gen).float()
    return torch.randn(rows, k, generator=gen) * torch.exp2(e).repeat_interleave(16, dim=1)


def _pairs():
    x, w = _data(72, 96, 5), _data(48, 96, 6)
    return {
        "nvfp4": (quantize_nvfp4(x), quantize_nvfp4(w, tile_rows=16)),
        "mxfp4": (
            quantize_mxfp4(x, "floor", stochastic=True, generator=1),
            quantize_mxfp4(w, "floor", stochastic=True, generator=2),
        ),
        "mxfp8": (quantize_mx(x, torch.float8_e4m3fn), quantize_mx(w, torch.float8_e5m2)),
    }


def _emulated(a, b, out_dtype):
    return gemm.fp8_mm(a, b, out_dtype, scaled_mm=False)


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_blocked_scaled_mm_is_the_emulated_gemm_under_the_interpretation(monkeypatch, fmt):
    a, b = _pairs()[fmt]
    fake = interpret()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    for out in (torch.float32, torch.bfloat16):
        got, ref = blocked.blocked_scaled_mm(a, b, out), _emulated(a, b, out)
        assert got.dtype == out and got.shape == ref.shape == (72, 48)
        tol = blocked.check_tolerance(a, b, ref)
        assert bool(((got.double() - ref.double()).abs() <= tol).all())
    # the bound is tight enough to see a wrong layout
    monkeypatch.setattr(torch, "_scaled_mm", interpret(_row_major_scales))
    wrong = blocked.blocked_scaled_mm(a, b, torch.float32)
    ref = _emulated(a, b, torch.float32)
    assert not bool(
        ((wrong.double() - ref.double()).abs() <= blocked.check_tolerance(a, b, ref)).all()
    )


@pytest.fixture
def sm100(monkeypatch):
    """This CPU passed off as a CUDA 10.0 device with torch's FP4 dtypes; decisions fresh."""
    monkeypatch.setattr(gemm, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr(gemm, "native_dtypes_missing", lambda: [])
    monkeypatch.setattr(gemm, "_DECISIONS", {})
    fake = interpret()
    monkeypatch.setattr(torch, "_scaled_mm", fake)
    return fake


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_a_passing_first_use_check_goes_native_once(sm100, fmt):
    a, b = _pairs()[fmt]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert gemm.scaled_mm_blocker(a, b, torch.float32) is None
    assert sm100.calls == 1  # the check's GEMM
    assert gemm.scaled_mm_blocker(a, b, torch.float32) is None
    assert sm100.calls == 1  # decided: not checked again
    y = gemm.fp8_mm(a, b, torch.float32, scaled_mm=True)
    assert sm100.calls == 2
    ref = _emulated(a, b, torch.float32)
    assert bool(((y.double() - ref.double()).abs() <= blocked.check_tolerance(a, b, ref)).all())


def _failing(monkeypatch, mock, fmt="nvfp4"):
    monkeypatch.setattr(torch, "_scaled_mm", mock)
    a, b = _pairs()[fmt]
    with pytest.warns(gemm.NativeGemmCheckWarning) as seen:
        first = gemm.scaled_mm_blocker(a, b, torch.float32)
    assert len(seen) == 1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # decided: no second warning, no second try
        again = gemm.scaled_mm_blocker(a, b, torch.float32)
    assert first == again and first[0] == ("recipe" if fmt == "mxfp8" else "fp4")
    assert gemm.fp8_mm(a, b, torch.float32, scaled_mm=False).shape == (72, 48)
    return str(seen[0].message), first[1]


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_a_wrong_answer_keeps_the_format_emulated(sm100, monkeypatch, fmt):
    wrong = interpret(_row_major_scales)
    text, reason = _failing(monkeypatch, wrong, fmt)
    assert wrong.calls == 1
    assert "differ from the emulated GEMM" in text and torch.__version__ in text
    assert "cpu" in text and "stay emulated" in text and "first-use check" in reason


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4"])
def test_swapped_nibbles_keep_the_format_emulated(sm100, monkeypatch, fmt):
    text, _ = _failing(monkeypatch, interpret(even_high=True), fmt)
    assert "differ from the emulated GEMM" in text


def test_an_error_keeps_the_format_emulated(sm100, monkeypatch):
    def raising(*args, **kw):
        raising.calls += 1
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    raising.calls = 0
    text, _ = _failing(monkeypatch, raising)
    assert raising.calls == 1
    assert "RuntimeError: CUBLAS_STATUS_NOT_SUPPORTED" in text and torch.__version__ in text


def test_what_keeps_a_gemm_off_the_native_path(sm100, monkeypatch):
    a, b = _pairs()["nvfp4"]
    narrow = quantize_nvfp4(_data(40, 96, 7))  # N = 40: not a multiple of 16
    assert "N of 16" in gemm.scaled_mm_blocker(a, narrow, torch.float32)[1]
    mx_a, _ = _pairs()["mxfp8"]
    mx_b = quantize_mx(_data(40, 96, 7), torch.float8_e4m3fn)
    assert gemm.scaled_mm_blocker(mx_a, mx_b, torch.float32)[0] == "shape"
    assert sm100.calls == 0  # no check for a GEMM that cannot go native
    monkeypatch.setattr(gemm, "native_dtypes_missing", lambda: ["float4_e2m1fn_x2"])
    assert "torch.float4_e2m1fn_x2" in gemm.scaled_mm_blocker(a, b, torch.float32)[1]
    monkeypatch.setattr(gemm, "device_capability", lambda device: (9, 0))
    cat, why = gemm.scaled_mm_blocker(a, b, torch.float32)
    assert cat == "fp4" and "10.0+" in why and "9.0" in why
    assert sm100.calls == 0


def test_on_this_cpu_nothing_goes_native(monkeypatch):
    monkeypatch.setattr(gemm, "_DECISIONS", {})
    for fmt, (a, b) in _pairs().items():
        cat, why = gemm.scaled_mm_blocker(a, b, torch.float32)
        assert cat == ("fp4" if fmt != "mxfp8" else "recipe") and "emulated" in why
        assert gemm.block_scaled_status("cpu", fmt) == "emulated"
    assert gemm._DECISIONS == {}  # no check was run


def test_a_layer_runs_its_three_gemms_natively(sm100):
    torch.manual_seed(0)
    layer = Float8Linear(64, 64, recipe="nvfp4")
    x = torch.randn(32, 64, requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", Float8FallbackWarning)
        layer(x).sum().backward()
    assert sm100.calls == 1 + 3  # the check, then forward, dx and dW
    ref = Float8Linear.from_linear(layer.to_linear(), "nvfp4")
    x2 = x.detach().clone().requires_grad_()
    gemm._DECISIONS[(torch.device("cpu"), ("nvfp4",))] = "emulated for the reference"
    with pytest.warns(Float8FallbackWarning):
        ref(x2).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-6)


def test_labels_say_native_only_where_the_path_is_taken(sm100, monkeypatch):
    for name, fmt in (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "fp8")):
        cfg = get_config(name)
        assert cfg.status(fmt, {"device": "cpu"}) == "native"
        assert cfg.precision_text(fmt, cfg.status(fmt, {"device": "cpu"})) == f"{fmt} (native)"
        recorded = {"device": "cpu", "block_scaled": {name: "emulated"}}
        assert cfg.status(fmt, recorded) == "emulated"  # a run's recorded facts win
    monkeypatch.setattr(gemm, "_DECISIONS", {})
    monkeypatch.setattr(torch, "_scaled_mm", interpret(_row_major_scales))
    with pytest.warns(gemm.NativeGemmCheckWarning):
        assert get_config("nvfp4").status("nvfp4", {"device": "cpu"}) == "emulated"
    monkeypatch.setattr(gemm, "device_capability", lambda device: (9, 0))
    assert get_config("mxfp8").status("fp8", {"device": "cuda"}) == "emulated"


def test_labels_on_this_cpu_say_emulated():
    for name, fmt in (("nvfp4", "nvfp4"), ("mxfp4", "mxfp4"), ("mxfp8", "fp8")):
        assert get_config(name).status(fmt, {"device": "cpu"}) == "emulated"
        assert get_config(name).status(fmt) == "emulated"


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp4", "mxfp8"])
def test_on_this_cuda_gpu_the_decision_is_named(fmt, monkeypatch):
    monkeypatch.setattr(gemm, "_DECISIONS", {})
    a, b = (
        type(op)(*(v.cuda() if isinstance(v, torch.Tensor) else v for v in vars(op).values()))
        for op in _pairs()[fmt]
    )
    cap = torch.cuda.get_device_capability()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        blocker = gemm.scaled_mm_blocker(a, b, torch.float32)
        dtypes = (torch.float8_e4m3fn, torch.float8_e5m2)
        status = gemm.block_scaled_status("cuda", fmt, dtypes)
    failed = [w for w in seen if issubclass(w.category, gemm.NativeGemmCheckWarning)]
    if cap < (10, 0):
        assert status == "emulated" and f"{cap[0]}.{cap[1]}" in blocker[1] and not failed
    else:  # one decision, said the same way by the dispatcher and the label
        assert (blocker is None) == (status == "native") and len(failed) == (blocker is not None)
    y = gemm.fp8_mm(a, b, torch.float32, scaled_mm=blocker is None)
    ref = _emulated(a, b, torch.float32)
    assert bool(((y.double() - ref.double()).abs() <= blocked.check_tolerance(a, b, ref)).all())
