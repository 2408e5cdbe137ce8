"""Compile the Triton kernels for a GPU target on a machine without a GPU (run as a script).

Triton's interpreter checks what a kernel computes, not that it compiles: it accepts Python
that the compiler refuses (a module constant read in a kernel, a float scalar's ``.to``...).
This script compiles one specialization of every kernel for ``sm_<ARCH>`` down to a cubin
(Triton's bundled ``ptxas``), launching nothing: a stand-in driver answers the device queries
and every launch becomes a warm-up. Usage: ``python triton_aot.py [ARCH] [--memory]`` (default
90); prints one line per kernel and exits non-zero on the first compile error. With
``--memory`` it also prints, for each kernel not autotuned, a ``memory`` line: the global loads
and stores in its PTX, by kind (:func:`memory_ops`).
"""

from __future__ import annotations

import importlib
import os
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime import driver  # noqa: E402

_ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
ARCH = int(_ARGS[0]) if _ARGS else 90
MEMORY = "--memory" in sys.argv[1:]
MODULES = (
    "_chunks",
    "_optim",
    "scale",
    "l2norm",
    "check_finite",
    "adam",
    "sgd",
    "lamb",
    "_norm",
    "softmax",
    "rotary",
)


class _CompileOnlyDriver:
    """Answers the queries Triton makes before compiling; there is no device behind it."""

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return GPUTarget("cuda", ARCH, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


def memory_ops(ptx: str) -> dict[str, int]:
    """Global loads and stores in ``ptx``, by kind: ``ld.v``/``st.v`` (vector), ``ld``/``st``."""
    ops = re.findall(r"\b(ld|st)\.global(?:\.[a-z0-9]+)*?(\.v[248])?\.[a-z]+[0-9]+\b", ptx)
    out = {"ld.v": 0, "ld": 0, "st.v": 0, "st": 0}
    for kind, vec in ops:
        out[kind + (".v" if vec else "")] += 1
    return out


def _warm_up(kernel, grid, *args, **kwargs):
    start = time.perf_counter()
    from triton.runtime.autotuner import Autotuner

    if isinstance(kernel, Autotuner):  # compile every config of the tuned set, not the first
        kernel.warmup(*args, grid=grid, enable_fp_fusion=False, **kwargs)
    else:
        compiled = kernel.run(*args, grid=grid, warmup=True, enable_fp_fusion=False, **kwargs)
        if MEMORY:
            print(f"memory {kernel.fn.__name__} {memory_ops(compiled.asm['ptx'])}")
    flags = {k: v for k, v in kwargs.items() if k.isupper()}
    print(f"sm_{ARCH} {kernel.fn.__name__:22s} {time.perf_counter() - start:5.2f}s {flags}")


def _cases():
    from mpnb.core.ops.triton import launcher as op

    f32, bf16, f64 = torch.float32, torch.bfloat16, torch.float64
    one, flag = torch.ones(1), torch.zeros(1, dtype=torch.int32)

    def t(*shape, dtype=f32):
        return torch.ones(*shape, dtype=dtype)

    op("multi_tensor_scale")(flag, [t(9, dtype=bf16)], [t(9)], 0.5, one)
    op("multi_tensor_scale")(flag, [t(9, dtype=f64)], [t(9, dtype=f64)], 0.5)
    op("multi_tensor_l2norm")(flag, [t(9, dtype=bf16)], True, one)
    op("multi_tensor_l2norm")(flag, [t(9, dtype=f64)], False)
    op("multi_tensor_check_finite")(flag, [t(9, dtype=bf16)])
    op("multi_tensor_check_finite")(flag, [t(9, dtype=f64)])
    p, g, w, m, v, s = [t(9, dtype=bf16)], [t(9, dtype=bf16)], [t(9)], [t(9)], [t(9)], [t(1)]
    op("fused_adam_")(p, g, m, v, w, s, 1e-3, 0.9, 0.999, 1e-8, 0.1, True, True, one, one)
    op("fused_sgd_")(p, g, m, w, [True], 0.1, 0.9, 0.0, 0.01, True, False, one, one)
    lamb = (1e-2, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False)
    op("fused_lamb_")(p, g, m, v, w, s, one, *lamb, one, one)
    # pure bf16: stochastic rounding with every option, Kahan with none
    adam = (1e-3, 0.9, 0.999, 1e-8)
    op("fused_adam_bf16_")(p, g, m, v, [], s, *adam, 0.1, True, True, "stochastic", 1, 1, one, one)
    c = [t(9, dtype=bf16)]
    op("fused_adam_bf16_")(p, w, m, v, c, s, *adam, 0.0, False, False, "kahan", 1, 1, None, None)
    sgd = (0.1, 0.9, 0.0, 0.01, True, False)
    op("fused_sgd_bf16_")(p, g, m, [], [True], *sgd, "stochastic", 1, 1, one, one)
    sgd = (0.1, 0.0, 0.0, 0.0, False, False)
    op("fused_sgd_bf16_")(p, g, [], c, [False], *sgd, "kahan", 1, 1, None, None)
    lamb = (1e-2, 0.9, 0.999, 1e-6, 0.01, True, True, True, 1.0, False)
    op("fused_lamb_bf16_")(p, g, m, v, [], s, one, *lamb, "stochastic", 1, 1, one, one)
    lamb = (1e-2, 0.9, 0.999, 1e-6, 0.0, False, False, False, 0.0, True)
    op("fused_lamb_bf16_")(p, g, m, v, c, s, one, *lamb, "kahan", 1, 1, None, None)
    # fp32 params, no masters, no unscale, no overflow flag, the other branches
    p32 = [t(9)]
    op("fused_adam_")(p32, g, m, v, [], s, 1e-3, 0.9, 0.999, 1e-8, 0.1, False, False, None, None)
    op("fused_sgd_")(p32, g, [], [], [False], 0.1, 0.0, 0.0, 0.0, False, False, None, None)
    lamb = (1e-2, 0.9, 0.999, 1e-6, 0.0, False, False, False, 0.0, True)
    op("fused_lamb_")(p32, g, m, v, [], s, one, *lamb, None, None)
    for cols in (33, 9000):  # rows in one block, and rows walked in blocks
        x, wt = t(3, cols, dtype=bf16), t(cols)
        y, mean, rstd = op("layer_norm_fwd")(x, [cols], wt, wt, 1e-5)
        op("layer_norm_bwd")(x, y, mean, rstd, [cols], wt, wt, True)
        op("rms_norm_fwd")(t(2, cols, dtype=f64), [cols], None, 1e-5)
    for k in (9, 9000):
        x = t(2, 2, 9 if k == 9 else 1, k, dtype=bf16)
        mask = torch.zeros(2, 1, x.shape[2], k, dtype=torch.bool)
        op("scaled_masked_softmax_fwd")(x, mask, 0.5)
        op("scaled_softmax_bwd")(x, x, 0.5)
    op("scaled_upper_triang_masked_softmax_fwd")(t(2, 9, 9, dtype=f64), 0.5)
    op("scaled_softmax_fwd")(t(3, 70), 0.5)
    op("rms_norm_bwd")(t(2, 40, dtype=bf16), t(2, 40, dtype=bf16), t(2), [40], None, False)
    op("rope")(t(3, 2, 2, 10, dtype=bf16), t(3, 8), t(3, 8), 4, True, True)


def main() -> int:
    driver.set_active(_CompileOnlyDriver())
    for name in MODULES:
        module = importlib.import_module(f"mpnb.core.ops.triton.{name}")
        if hasattr(module, "launch"):
            module.launch = _warm_up
    _cases()
    return 0


if __name__ == "__main__":
    sys.exit(main())
