"""The stated config sets of the layer kernels (norms, softmax) and their ``triton.autotune``.

Each kernel is tuned over two to four configs, keyed on the row width (and the dtypes, which
Triton adds to every key), so a GPU compiles a handful of variants per width and then runs the
fastest. The sets:

``ROW_CONFIGS`` (rows held in one block, several rows per program for narrow rows): the
program holds ``TILE`` elements, that is ``rows_per(TILE, BLOCK)`` rows of the padded width
``BLOCK`` (one row when ``BLOCK >= TILE``)::

    TILE=4096 num_warps=8 | TILE=2048 num_warps=4 | TILE=8192 num_warps=16

``LOOP_CONFIGS`` (rows longer than a block, one row per program, walked in steps of
``BLOCK``)::

    BLOCK=1024 num_warps=4 | BLOCK=2048 num_warps=8 | BLOCK=4096 num_warps=8

The first config of each set is the one the kernels ran before tuning. Under Triton's
interpreter (``TRITON_INTERPRET=1``, the CPU tests) there is nothing worth timing, so a kernel
decorated there keeps only its first config; the tests run the others by hand. A warm-up
launch (``kernel.run(..., warmup=True)``, compile without running) has nothing to time either
and compiles the first config; ``Autotuner.warmup`` compiles them all.
"""

from __future__ import annotations

import triton
from triton.runtime.interpreter import InterpretedFunction

__all__ = ["ROW_CONFIGS", "LOOP_CONFIGS", "tuned", "rows_per", "configs_of"]

#: one-block rows: ``TILE`` elements per program (``rows_per(TILE, BLOCK)`` rows)
ROW_CONFIGS = (
    triton.Config({"TILE": 4096}, num_warps=8),
    triton.Config({"TILE": 2048}, num_warps=4),
    triton.Config({"TILE": 8192}, num_warps=16),
)
#: long rows: one row per program, walked in steps of ``BLOCK``
LOOP_CONFIGS = (
    triton.Config({"BLOCK": 1024}, num_warps=4),
    triton.Config({"BLOCK": 2048}, num_warps=8),
    triton.Config({"BLOCK": 4096}, num_warps=8),
)


def rows_per(tile: int, block: int) -> int:
    """Rows a program of ``tile`` elements holds at the padded width ``block`` (powers of two):
    the host's side of the kernels' ``ROWS: tl.constexpr = (TILE + BLOCK - 1) // BLOCK``."""
    return max(1, tile // block)


def _prune(configs, named_args, **kwargs):
    # A warm-up launch compiles without running: there is nothing to time.
    return list(configs[:1]) if kwargs.get("warmup") else list(configs)


def tuned(configs, key: list[str]):
    """``triton.autotune`` over ``configs`` keyed on ``key``; an interpreted kernel keeps only
    the first config (module docstring).

    Example::

        >>> @tuned(ROW_CONFIGS, key=["cols"])
        ... @triton.jit
        ... def _kernel(x_ptr, rows, cols, BLOCK: tl.constexpr, TILE: tl.constexpr): ...
    """

    def decorate(fn):
        chosen = list(configs[:1]) if isinstance(fn, InterpretedFunction) else list(configs)
        return triton.autotune(
            configs=chosen, key=key, prune_configs_by={"early_config_prune": _prune}
        )(fn)

    return decorate


def configs_of(configs) -> list[tuple[dict, int]]:
    """``(meta-parameters, num_warps)`` of each config of a set, or of a tuned kernel's
    ``configs`` (the ones it may choose from)."""
    return [(dict(c.kwargs), c.num_warps) for c in configs]
