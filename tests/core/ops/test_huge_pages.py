"""Large fresh outputs of the layer kernels are faulted in as transparent huge pages.

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
from pathlib import Path

import pytest
import torch

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


CASES = {
    "layer_norm_fwd": lambda x: M.layer_norm_fwd(x, [x.shape[-1]], None, None, 1e-5)[0],
    "scaled_softmax_fwd": lambda x: M.scaled_softmax_fwd(x.view(1, 1, *x.shape), 0.5),
    "rope sbhd": lambda x: _rope(x.view(512, 4, 8, 1024), "sbhd"),
    "rope bhsd view": lambda x: _rope(x.view(4, 512, 8, 1024).transpose(1, 2), "bhsd"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_a_fresh_64_mib_output_is_backed_by_huge_pages(thp, name):
    from mpnb.core.ops import output_cache

    x = torch.randn(16384, 1024)  # 64 MiB of fp32
    gc.collect()
    output_cache(empty=True)  # a fresh block (the output cache would reuse an earlier one)
    before = _huge_kib()
    y = CASES[name](x)
    grown = _huge_kib() - before
    assert y.numel() == x.numel()
    # 64 MiB in whole 2 MiB pages, less the unaligned ends; the kernel may find fewer free
    # huge pages under memory pressure, so at least half of them
    assert grown >= 32 * 1024, f"{name}: AnonHugePages grew by {grown} KiB for a 64 MiB output"
