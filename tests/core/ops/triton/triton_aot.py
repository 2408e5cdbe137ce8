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
    c, p32 = [t(9, dtype=bf16)], [t(9)]
    flags = dict(inv_scale=one, found_inf=one)
    sr, kahan = (dict(rounding=r, seed=1, rng_step=1) for r in ("stochastic", "kahan"))
    # One kernel serves an op and its pure-bf16 twin (ROUNDING): each op with every option,
    # stochastic rounding with every option, Kahan with none; then the ops on fp32 params
    # without masters, unscale or overflow flag (the other branches).
    adam = dict(grads=g, exp_avgs=m, exp_avg_sqs=v, steps=s, lr=1e-3, beta1=0.9, beta2=0.999)
    adam |= dict(eps=1e-8, weight_decay=0.1, adam_w_mode=True, bias_correction=True)
    plain = dict(adam_w_mode=False, bias_correction=False)
    op("fused_adam_")(params=p, masters=w, **adam, **flags)
    op("fused_adam_bf16_")(params=p, compensations=[], **adam, **sr, **flags)
    bare = adam | plain | dict(grads=w, weight_decay=0.0)
    op("fused_adam_bf16_")(params=p, compensations=c, **bare, **kahan)
    sgd = dict(grads=g, lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=True)
    sgd |= dict(wd_after_momentum=False, momentum_buffers=m, first_run=[True])
    op("fused_sgd_")(params=p, masters=w, **sgd, **flags)
    op("fused_sgd_bf16_")(params=p, compensations=[], **sgd, **sr, **flags)
    bare = sgd | dict(momentum=0.0, weight_decay=0.0, nesterov=False, momentum_buffers=[])
    bare |= dict(first_run=[False])
    op("fused_sgd_bf16_")(params=p, compensations=c, **bare, **kahan)
    lamb = dict(grads=g, exp_avgs=m, exp_avg_sqs=v, steps=s, global_grad_norm=one, lr=1e-2)
    lamb |= dict(beta1=0.9, beta2=0.999, eps=1e-6, weight_decay=0.01, adam_w_mode=True)
    lamb |= dict(bias_correction=True, grad_averaging=True, max_grad_norm=1.0, use_nvlamb=False)
    op("fused_lamb_")(params=p, masters=w, **lamb, **flags)
    op("fused_lamb_bf16_")(params=p, compensations=[], **lamb, **sr, **flags)
    lamb_bare = lamb | dict(weight_decay=0.0, adam_w_mode=False, bias_correction=False)
    lamb_bare |= dict(grad_averaging=False, max_grad_norm=0.0, use_nvlamb=True)
    op("fused_lamb_bf16_")(params=p, compensations=c, **lamb_bare, **kahan)
    op("fused_adam_")(params=p32, masters=[], **(adam | plain))
    op("fused_sgd_")(params=p32, masters=[], **bare)
    op("fused_lamb_")(params=p32, masters=[], **lamb_bare)
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
        if hasattr(module, "launch_kw"):  # OpKernel's launch: arguments as a tuple and a dict
            module.launch_kw = lambda kernel, grid, args, kwargs: _warm_up(
                kernel, grid, *args, **kwargs
            )
    _cases()
    return 0


if __name__ == "__main__":
    sys.exit(main())
