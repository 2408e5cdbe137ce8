"""The output cache of the C++ layer kernels (csrc/cpu/output_cache.h): large outputs reuse
memory that earlier outputs gave back, never leak its old contents, stay within the limit,
and behave as ordinary tensors.

Large fresh outputs (new blocks) of the layer kernels are faulted in as transparent huge pages.

The kernels advise MADV_HUGEPAGE on outputs of 16 MiB or more (``advise_huge_pages`` in
csrc/cpu/fast_math.h): a fresh 64 MiB buffer then takes 32 faults of 2 MiB instead of 16384 of
4 KiB, the difference between the kernel and its fresh-output floor in ``mpnb bench layers``.
Checked by the process's ``AnonHugePages`` before and after one call, where the kernel's THP
mode lets a process ask (``madvise`` or ``always``). Outputs of 16 MiB or more come from the
output cache (csrc/cpu/output_cache.h), whose new blocks get the same advice; the test empties
it first so that each output is a new block.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from mpnb.core import ops
from mpnb.core.ops import output_cache
from mpnb.core.ops._output_cache import CACHE_MIN_BYTES, env_problem

pytestmark = pytest.mark.skipif(not ops.ensure_kernels(), reason="needs the C++ kernels")

ROWS, COLS = 4096, 1024  # 16 MiB of fp32: the smallest cached size


def _x(dtype=torch.float32, rows=ROWS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, COLS, generator=g).to(dtype)


def _rope_args(layout_t):
    g = torch.Generator().manual_seed(1)
    t = torch.randn(1024, 4, 16, 64, generator=g)  # [s, b, h, d]: 16 MiB
    ang = torch.randn(1024, 64, generator=g)
    return layout_t(t), ang.cos(), ang.sin()


# Each case: the op's large output (the tensor the cache serves), computed from fixed inputs.
CASES = {
    "layer_norm_fwd": lambda: ops.layer_norm_fwd(_x(), (COLS,), _x(rows=1, seed=2)[0], None)[0],
    "layer_norm_bwd": lambda: ops.layer_norm_bwd(
        _x(seed=1), _x(), torch.zeros(ROWS), torch.ones(ROWS), (COLS,)
    )[0],
    "rms_norm_fwd bf16": lambda: ops.rms_norm_fwd(
        _x(torch.bfloat16, 2 * ROWS), (COLS,), _x(torch.bfloat16, 1, seed=2)[0]
    )[0],
    "rms_norm_bwd": lambda: ops.rms_norm_bwd(_x(seed=1), _x(), torch.ones(ROWS), (COLS,))[0],
    "scaled_softmax_fwd": lambda: ops.scaled_softmax_fwd(_x().view(4, 4, 256, COLS), 0.5),
    "causal softmax fwd": lambda: ops.scaled_upper_triang_masked_softmax_fwd(
        _x().view(16, 256, 1024)[:, :, :256].contiguous().repeat(1, 4, 4), 0.5
    ),
    "scaled_softmax_bwd": lambda: ops.scaled_softmax_bwd(_x(seed=1), _x().softmax(-1), 0.5),
    "rope sbhd": lambda: ops.rope(*_rope_args(lambda t: t), 64),
    "rope bhsd view": lambda: ops.rope(
        *_rope_args(lambda t: t.permute(1, 2, 0, 3).contiguous().permute(2, 0, 1, 3)), 64
    ),
    "rope transpose_output": lambda: ops.rope(*_rope_args(lambda t: t), 64, True),
}


@pytest.fixture(autouse=True)
def _fresh_cache():
    before = output_cache()["limit_mib"]
    output_cache(1024, empty=True)
    yield
    output_cache(before, empty=True)


@pytest.mark.parametrize("case", list(CASES))
def test_a_reused_block_never_shows_its_old_contents(case):
    first = CASES[case]()
    assert first.untyped_storage().nbytes() >= CACHE_MIN_BYTES
    expected, ptr, strides = first.clone(), first.data_ptr(), first.stride()
    first.fill_(float("nan"))  # what the block holds when it goes back
    del first
    hits = output_cache()["hits"]
    again = CASES[case]()
    assert output_cache()["hits"] == hits + 1 and again.data_ptr() == ptr
    assert again.stride() == strides
    assert torch.equal(again, expected)


def test_python_states_the_kernels_threshold():
    assert output_cache()["min_mib"] * (1 << 20) == CACHE_MIN_BYTES


def test_small_outputs_are_not_cached():
    before = output_cache()
    y = ops.rms_norm_fwd(_x(rows=ROWS // 2), (COLS,))[0]  # 8 MiB
    del y
    c = output_cache()
    assert c["held_blocks"] == 0
    assert (c["hits"], c["misses"]) == (before["hits"], before["misses"])


def test_limit_bounds_what_is_held_and_evicts_the_oldest():
    output_cache(40)  # room for one 32 MiB block, not two
    a = ops.rms_norm_fwd(_x(rows=2 * ROWS), (COLS,))[0]
    b = ops.rms_norm_fwd(_x(rows=2 * ROWS, seed=3), (COLS,))[0]
    pa, pb = a.data_ptr(), b.data_ptr()
    del a
    assert output_cache()["held_blocks"] == 1
    del b  # the newer one stays, the older goes back to the OS
    c = output_cache()
    assert c["held_blocks"] == 1 and c["held_mib"] == 32
    assert ops.rms_norm_fwd(_x(rows=2 * ROWS), (COLS,))[0].data_ptr() == pb != pa


def test_off_and_empty_return_every_block():
    y = ops.rms_norm_fwd(_x(), (COLS,))[0]
    del y
    assert output_cache()["held_mib"] == 16
    assert output_cache(empty=True)["held_mib"] == 0
    output_cache(0)
    y = ops.rms_norm_fwd(_x(), (COLS,))[0]
    assert output_cache()["in_use_mib"] == 0  # not from the cache
    del y
    assert output_cache()["held_blocks"] == 0
    with pytest.raises(ValueError, match="limit_mib must be >= 0"):
        output_cache(-1)


def test_cached_outputs_are_ordinary_tensors(tmp_path):
    y = ops.rms_norm_fwd(_x(), (COLS,))[0]
    assert output_cache()["in_use_mib"] == 16
    head = y[:8].clone()
    y.resize_(2 * ROWS, COLS)  # the storage grows through the same allocator
    assert torch.equal(y[:8], head)
    torch.save(y[:8], tmp_path / "y.pt")
    assert torch.equal(torch.load(tmp_path / "y.pt"), head)
    z = y.clone().share_memory_()
    assert z.is_shared() and torch.equal(z[:8], head)
    del y, z
    assert output_cache()["in_use_mib"] == 0


def test_autograd_through_the_modules_reuses_blocks():
    from mpnb.core.normalization import FusedRMSNorm

    norm = FusedRMSNorm(COLS)
    x = _x().requires_grad_()
    grads = []
    for _ in range(3):
        norm(x).square().sum().backward()
        grads.append(x.grad.clone())
        x.grad = None
    assert output_cache()["hits"] >= 2
    assert all(torch.equal(g, grads[0]) for g in grads)


def test_threads_share_the_cache_safely():
    expected = ops.rms_norm_fwd(_x(), (COLS,))[0].clone()
    bad = []

    def work():
        for _ in range(6):
            if not torch.equal(ops.rms_norm_fwd(_x(), (COLS,))[0], expected):
                bad.append(1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    c = output_cache()
    assert not bad and c["in_use_mib"] == 0 and c["held_mib"] <= 4 * 16


def _child(q):
    torch.set_num_threads(1)  # OpenMP's pool does not survive a fork (as in DataLoader workers)
    y = ops.rms_norm_fwd(_x(), (COLS,))[0]
    q.put(float(y.float().square().mean()))


def test_a_forked_child_uses_the_cache():
    y = ops.rms_norm_fwd(_x(), (COLS,))[0]
    expected = float(y.float().square().mean())
    del y  # the parent holds a free block when it forks
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child, args=(q,))
    p.start()
    p.join(60)
    assert p.exitcode == 0 and q.get(timeout=5) == pytest.approx(expected)


def test_the_limit_comes_from_the_environment():
    code = "from mpnb.core.ops import output_cache; print(output_cache()['limit_mib'])"
    env = os.environ | {"MPNB_CPU_OUTPUT_CACHE_MB": "48"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "48.0", out.stderr


def test_a_bad_environment_value_is_named(monkeypatch):
    monkeypatch.setenv("MPNB_CPU_OUTPUT_CACHE_MB", "1GB")
    assert "'1GB' is not a whole number of MiB" in env_problem()
    monkeypatch.setenv("MPNB_CPU_OUTPUT_CACHE_MB", "256")
    assert env_problem() == ""


@pytest.mark.parametrize("value", ["1GB", " 512", "+64", "-1"])
def test_the_kernels_ignore_what_env_problem_names(value, monkeypatch):
    """C++ and Python read the variable by one rule: a value env_problem names is ignored."""
    monkeypatch.setenv("MPNB_CPU_OUTPUT_CACHE_MB", value)
    assert env_problem()
    code = "from mpnb.core.ops import output_cache; print(output_cache()['limit_mib'])"
    env = os.environ | {"MPNB_CPU_OUTPUT_CACHE_MB": value}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip().splitlines()[-1] == "1024.0", out.stderr


@pytest.mark.parametrize("layout", ["sbhd", "bshd", "bhsd"])
def test_a_cached_rope_output_keeps_the_input_layout(layout):
    """From the cache as from the allocator: torch.empty_like's strides, also for a slice of a
    fused QKV tensor (not dense: dense in the input's memory order)."""
    perm = {"sbhd": (0, 1, 2, 3), "bshd": (1, 0, 2, 3), "bhsd": (1, 2, 0, 3)}[layout]
    g = torch.Generator().manual_seed(4)
    qkv = torch.randn(1024, 4, 16, 3 * 64, generator=g).permute(perm)
    q = qkv[..., :64]  # 16 MiB, not dense
    ang = torch.randn(1024, 64, generator=g)
    for t in (q, q.contiguous()):
        y = ops.rope(t, ang.cos(), ang.sin(), 64, layout=layout)
        assert y.untyped_storage().nbytes() >= CACHE_MIN_BYTES
        assert y.stride() == torch.empty_like(t).stride()
        with ops.use_reference(["rope"]):
            assert torch.equal(y, ops.rope(t, ang.cos(), ang.sin(), 64, layout=layout))


# ---- transparent huge pages for new blocks ---------------------------------------------------

M = torch.ops.mpnb
_THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _huge_kib() -> int:
    for line in Path("/proc/self/smaps_rollup").read_text().splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    raise AssertionError("no AnonHugePages line in /proc/self/smaps_rollup")


@pytest.fixture
def thp(kernels):
    if not kernels:
        pytest.skip("the advice is given by the compiled kernels")
    if not _THP.exists() or not Path("/proc/self/smaps_rollup").exists():
        pytest.skip("no transparent huge pages on this system")
    if "[never]" in _THP.read_text():
        pytest.skip("transparent huge pages are off ([never]) on this system")


def _rope(t, layout):
    s, d = t.shape[layout.index("s")], t.shape[-1]
    f = torch.outer(torch.arange(s, dtype=torch.float32), torch.ones(d))
    return M.rope(t, f.cos(), f.sin(), d, layout=layout)


HUGE_CASES = {
    "layer_norm_fwd": lambda x: M.layer_norm_fwd(x, [x.shape[-1]], None, None, 1e-5)[0],
    "scaled_softmax_fwd": lambda x: M.scaled_softmax_fwd(x.view(1, 1, *x.shape), 0.5),
    "rope sbhd": lambda x: _rope(x.view(512, 4, 8, 1024), "sbhd"),
    "rope bhsd view": lambda x: _rope(x.view(4, 512, 8, 1024).transpose(1, 2), "bhsd"),
}


@pytest.mark.parametrize("name", list(HUGE_CASES))
def test_a_fresh_64_mib_output_is_backed_by_huge_pages(thp, name):
    x = torch.randn(16384, 1024)  # 64 MiB of fp32
    gc.collect()
    output_cache(empty=True)  # a fresh block (the output cache would reuse an earlier one)
    before = _huge_kib()
    y = HUGE_CASES[name](x)
    grown = _huge_kib() - before
    assert y.numel() == x.numel()
    # 64 MiB in whole 2 MiB pages, less the unaligned ends; the kernel may find fewer free
    # huge pages under memory pressure, so at least half of them
    assert grown >= 32 * 1024, f"{name}: AnonHugePages grew by {grown} KiB for a 64 MiB output"


_RECYCLED = """
import gc, torch
from mpnb.core import ops as M
from mpnb.core.ops import output_cache
def huge():
    for line in open("/proc/self/smaps_rollup"):
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
x = torch.randn(16384, 1024)
M.layer_norm_fwd(x[:4], [1024], None, None, 1e-5)  # the kernels loaded
scratch = torch.ones(48 << 20)  # 192 MiB of the heap, written, then free in malloc's bins
del scratch
gc.collect()
output_cache(empty=True)
before = huge()
y = M.layer_norm_fwd(x, [1024], None, None, 1e-5)[0]
print(huge() - before)
"""


def test_a_new_cache_block_is_never_memory_malloc_recycled(thp):
    # With malloc serving large requests from its heap (a raised mmap threshold, as a long
    # process's history can leave it), a block taken from malloc would be heap pages already
    # written in small pages, which the huge-page advice does not replace; the cache maps its
    # blocks itself (posix_memalign gave 0 KiB of huge pages here)
    env = os.environ | {
        "MALLOC_MMAP_THRESHOLD_": str(1 << 30),
        "MALLOC_TRIM_THRESHOLD_": str(1 << 32),
    }
    out = subprocess.run(
        [sys.executable, "-c", _RECYCLED], env=env, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    assert grown >= 32 * 1024, f"AnonHugePages grew by {grown} KiB for a 64 MiB output"
