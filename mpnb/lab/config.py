"""One frozen object per configuration: what the runner turns into one row.

A request (``mpnb.lab.compare(...)``, CLI flags, a widget click) is validated here, once, and
expanded into :class:`RunConfig` objects; nothing downstream re-reads the user's arguments.

Example::

    >>> from mpnb.lab.config import expand
    >>> [c.label for c in expand("mlp", ("O0", "O2"), "bf16", (64,), steps=50)]
    ['O0 fp32 b64', 'O2 bf16 b64']
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpnb.core.amp import (
    HALF_DTYPES,
    OPT_LEVELS,
    LossScaleRule,
    half_dtype_name,
    parse_half_dtype,
    parse_loss_scale,
)

__all__ = ["RunConfig", "expand", "resolve_device", "half_name", "LossScaleRule"]

OPTIMIZERS = ("adam", "adamw", "sgd", "fused_adam", "fused_sgd")


@dataclass(frozen=True)
class RunConfig:
    """One configuration of a comparison: one row of the DataFrame.

    Args:
        workload: the workload's name (built-in or custom).
        opt_level: ``"O0"`` .. ``"O3"``.
        half_dtype: ``"bf16"`` or ``"fp16"`` (``"fp32"`` for O0, which uses no half dtype).
        batch_size: samples per step.
        steps: optimizer steps (the first ``warmup`` steps and the memory-tracked step
            :attr:`memory_step` are not timed).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"fused_adam"`` or ``"fused_sgd"``.
        lr: learning rate (None: the workload's default).
        loss_scale: None (the opt level's default), a static number, or a
            :class:`~mpnb.core.amp.LossScaleRule` (passed to ``amp.initialize``).
        device: ``"cpu"`` or ``"cuda[:i]"`` (already resolved, never ``"auto"``).
        seed: model initialization and data order; the same for every configuration.
        warmup: untimed steps at the start.
    """

    workload: str
    opt_level: str
    half_dtype: str
    batch_size: int
    steps: int
    optimizer: str = "adam"
    lr: float | None = None
    loss_scale: float | LossScaleRule | None = None
    device: str = "cpu"
    seed: int = 0
    warmup: int = 3

    @property
    def label(self) -> str:
        """A short name: ``"O2 bf16 b64"``."""
        return f"{self.opt_level} {self.half_dtype} b{self.batch_size}"

    @property
    def memory_step(self) -> int:
        """The step run under the memory tracker (the first after warm-up; never step 0,
        when the optimizer state does not exist yet)."""
        return max(1, self.warmup)

    @property
    def dtype(self) -> torch.dtype | None:
        """The half dtype as a torch dtype (None for O0)."""
        return HALF_DTYPES.get(self.half_dtype)


def resolve_device(device: str | torch.device = "auto") -> str:
    """``"auto"`` -> ``"cuda"`` when a GPU is present, else ``"cpu"``; checks the rest."""
    if str(device) == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is visible; use device='cpu'.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'cpu', 'cuda' or 'auto'.")
    return str(dev)


def half_name(half_dtype, device: str) -> str:
    """``"bf16"`` or ``"fp16"`` for any half-dtype name or dtype (None/"auto": the device's)."""
    return half_dtype_name(parse_half_dtype(half_dtype, device))


def _check(opt_levels, batch_sizes, steps, optimizer) -> None:
    bad = [lvl for lvl in opt_levels if lvl not in OPT_LEVELS]
    if bad or not opt_levels:
        raise ValueError(
            f"opt_levels={tuple(opt_levels)!r}: {bad or 'none given'} invalid; "
            f"choose from {tuple(OPT_LEVELS)}."
        )
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(f"batch_sizes={tuple(batch_sizes)!r}: need positive ints.")
    if not isinstance(steps, int) or steps < 2:
        raise ValueError(
            f"steps={steps!r}: need an int >= 2 (timed steps plus one memory-tracked step)."
        )
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; choose from {OPTIMIZERS}.")


def expand(
    workload: str,
    opt_levels: Sequence[str] = tuple(OPT_LEVELS),
    half_dtype="auto",
    batch_sizes: Sequence[int] = (64,),
    steps: int = 100,
    optimizer: str = "adam",
    lr: float | None = None,
    loss_scale=None,
    device="auto",
    seed: int = 0,
    warmup: int | None = None,
) -> list[RunConfig]:
    """Validate a request and expand it into one :class:`RunConfig` per configuration.

    ``half_dtype`` may be one dtype or a sequence (``("bf16", "fp16")``): each half opt level
    runs once per dtype; O0 runs once per batch size. Raises ValueError naming the bad value
    and the valid choices before anything runs.
    """
    levels = tuple(opt_levels)
    _check(levels, tuple(batch_sizes), steps, optimizer)
    dev = resolve_device(device)
    halves = half_dtype if isinstance(half_dtype, (list, tuple)) else (half_dtype,)
    names = list(dict.fromkeys(half_name(h, dev) for h in halves))
    scale = parse_loss_scale(loss_scale)
    wu = min(3, max(0, (steps - 2) // 4)) if warmup is None else int(warmup)
    if not 0 <= wu <= steps - 2:
        raise ValueError(f"warmup={warmup!r}: need 0 <= warmup <= steps - 2 ({steps - 2}).")
    out = []
    for b in batch_sizes:
        for lvl in levels:
            for h in ["fp32"] if lvl == "O0" else names:
                out.append(
                    RunConfig(workload, lvl, h, b, steps, optimizer, lr, scale, dev, seed, wu)
                )
    return out
