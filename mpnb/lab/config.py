"""One frozen object per configuration: what the runner turns into one row.

A request (``mpnb.lab.compare(...)``, CLI flags, a widget click) is validated here, once, and
expanded into :class:`RunConfig` objects; nothing downstream re-reads the user's arguments.

Example::

    >>> from mpnb.lab.config import expand
    >>> [c.label for c in expand("mlp", ("O0", "O2", "fp8-delayed"), "bf16", (64,), steps=50)]
    ['O0 fp32 b64', 'O2 bf16 b64', 'fp8-delayed b64']

The configurations are :data:`mpnb.core.precision.PRECISION_CONFIGS` (one list, defined in
core): the O levels run once per half dtype asked for, every other configuration fixes its own
precision (``"fp8"`` for the FP8 recipes, ``"bf16"`` for the pure-bf16 family) and runs once.
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
)
from mpnb.core.precision import AmpConfig, Float8Config, config_names, get_config

__all__ = ["RunConfig", "expand", "resolve_device", "half_name", "LossScaleRule"]

OPTIMIZERS = ("adam", "adamw", "sgd", "fused_adam", "fused_sgd")


@dataclass(frozen=True)
class RunConfig:
    """One configuration of a comparison: one row of the DataFrame.

    Args:
        workload: the workload's name (built-in or custom).
        opt_level: a configuration name of :data:`mpnb.core.precision.PRECISION_CONFIGS`
            (``"O0"`` .. ``"O3"``, ``"fp8-delayed"``, ``"bf16-pure+sr"``...).
        half_dtype: ``"bf16"`` or ``"fp16"`` for O1-O3, ``"fp32"`` for O0, ``"fp8"`` for the
            FP8 recipes, ``"bf16"`` for the pure-bf16 family.
        batch_size: samples per step.
        steps: optimizer steps (the first ``warmup`` steps and the memory-tracked step
            :attr:`memory_step` are not timed).
        optimizer: ``"adam"``, ``"adamw"``, ``"sgd"``, ``"fused_adam"`` or ``"fused_sgd"``.
        lr: learning rate (None: the workload's default).
        loss_scale: None (the opt level's default) or a :class:`~mpnb.core.amp.LossScaleRule`
            (static or dynamic; parsed once by :func:`expand`, passed as it is to
            ``amp.initialize``; O1-O3 only: the FP8 recipes scale per tensor, pure bf16
            needs no loss scale).
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
    loss_scale: LossScaleRule | None = None
    device: str = "cpu"
    seed: int = 0
    warmup: int = 3

    @property
    def label(self) -> str:
        """A short name: ``"O2 bf16 b64"``, ``"fp8-delayed b64"`` (the name says the dtype)."""
        if not self.is_opt_level:
            return f"{self.opt_level} b{self.batch_size}"
        return f"{self.opt_level} {self.half_dtype} b{self.batch_size}"

    @property
    def precision_config(self):
        """The :class:`~mpnb.core.precision.PrecisionConfig` this run applies."""
        return get_config(self.opt_level)

    @property
    def is_opt_level(self) -> bool:
        """True for Apex's O0-O3 (applied by ``amp.initialize`` with the half dtype)."""
        return isinstance(self.precision_config, AmpConfig)

    @property
    def is_fp8(self) -> bool:
        """True for the FP8 recipes (``fp8-*``, ``mxfp8``)."""
        return isinstance(self.precision_config, Float8Config)

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
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(
            f"device={device!r} is not a device; use 'cpu', 'cuda' (or 'cuda:N') or 'auto'."
        ) from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but no CUDA GPU is visible; use device='cpu'.")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'cpu', 'cuda' or 'auto'.")
    return str(dev)


def half_name(half_dtype, device: str) -> str:
    """``"bf16"`` or ``"fp16"`` for any half-dtype name or dtype (None/"auto": the device's)."""
    return half_dtype_name(parse_half_dtype(half_dtype, device))


def check_steps(steps) -> None:
    """Refuse a step count the lab cannot time: at least 2 (timed steps plus one memory-tracked
    step). Raises ValueError naming the value; the CLI and :func:`expand` share this rule."""
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 2:
        raise ValueError(
            f"steps={steps!r}: need at least 2 steps (timed steps plus one memory-tracked step)."
        )


def _twice(values) -> list:
    """The values that ``values`` lists more than once, in order."""
    seen, twice = set(), []
    for v in values:
        if v in seen and v not in twice:
            twice.append(v)
        seen.add(v)
    return twice


def check_batch_sizes(batch_sizes) -> None:
    """Refuse an empty list, a batch size that is not a positive int, or one given twice (it
    would run again under the same label). Raises ValueError naming the value."""
    if not batch_sizes or any(not isinstance(b, int) or b < 1 for b in batch_sizes):
        raise ValueError(
            f"batch_sizes={tuple(batch_sizes)!r}: expected positive batch sizes (e.g. 16,64)."
        )
    twice = _twice(batch_sizes)
    if twice:
        once = ",".join(map(str, dict.fromkeys(batch_sizes)))
        raise ValueError(
            f"batch_sizes={tuple(batch_sizes)!r} lists {', '.join(map(str, twice))} more than "
            f"once; give each batch size once (e.g. {once})."
        )


def check_opt_levels(opt_levels) -> None:
    """Refuse an empty list, an unknown configuration name, or one given twice (it would run
    again under the same label). Raises ValueError naming the value and the valid choices."""
    names = config_names()
    bad = [lvl for lvl in opt_levels if lvl not in names]
    if bad or not opt_levels:
        hint = " (use the letter O, not zero)" if any(str(b).startswith("0") for b in bad) else ""
        raise ValueError(
            f"opt_levels={tuple(opt_levels)!r}: {bad or 'none given'} invalid{hint}; "
            f"choose from {names}."
        )
    twice = _twice(opt_levels)
    if twice:
        raise ValueError(
            f"opt_levels={tuple(opt_levels)!r} lists {', '.join(twice)} more than once; give "
            f"each configuration once (e.g. {','.join(dict.fromkeys(opt_levels))})."
        )


def _check(opt_levels, batch_sizes, steps, optimizer) -> None:
    check_opt_levels(opt_levels)
    check_batch_sizes(batch_sizes)
    check_steps(steps)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; choose from {OPTIMIZERS}.")


def _halves(name: str, names: list[str]) -> list[str]:
    cfg = get_config(name)
    if name == "O0":
        return ["fp32"]
    if isinstance(cfg, AmpConfig):
        return names
    return ["fp8" if isinstance(cfg, Float8Config) else "bf16"]


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
    runs once per dtype; O0 and the configurations that fix their precision (FP8, pure bf16)
    run once per batch size. Raises ValueError naming the bad value
    and the valid choices before anything runs.
    """
    levels = tuple(opt_levels)
    _check(levels, tuple(batch_sizes), steps, optimizer)
    dev = resolve_device(device)
    halves = half_dtype if isinstance(half_dtype, (list, tuple)) else (half_dtype,)
    names = list(dict.fromkeys(half_name(h, dev) for h in halves))
    # The one parse of the loss scale, before a run rather than in every row.
    scale = LossScaleRule.parse(loss_scale, owner="mpnb.lab.compare")
    wu = min(3, max(0, (steps - 2) // 4)) if warmup is None else int(warmup)
    if not 0 <= wu <= steps - 2:
        raise ValueError(f"warmup={warmup!r}: need 0 <= warmup <= steps - 2 ({steps - 2}).")
    out = []
    for b in batch_sizes:
        for lvl in levels:
            for h in _halves(lvl, names):
                out.append(
                    RunConfig(workload, lvl, h, b, steps, optimizer, lr, scale, dev, seed, wu)
                )
    return out
