"""One frozen object per configuration: what the runner turns into one row.

A request (``mpnb.lab.compare(...)``, CLI flags, a widget click) is validated here, once, and
expanded into :class:`RunConfig` objects; nothing downstream re-reads the user's arguments.

Example::

    >>> from mpnb.lab.config import expand
    >>> [c.label for c in expand("mlp", ("O0", "O2", "fp8-delayed"), "bf16", (64,), steps=50)]
    ['O0 fp32 b64', 'O2 bf16 b64', 'fp8-delayed b64']

The configurations are :data:`mpnb.core.precision_configs.PRECISION_CONFIGS` (one list,
defined in core); each one says which dtypes its runs use (``halves``): the O levels run once
per half dtype asked for, every other configuration fixes its own precision (``"fp8"`` for the
FP8 recipes, ``"bf16"`` for the pure-bf16 family) and runs once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from mpnb.core._numbers import positive_finite
from mpnb.core.amp import LossScaleRule
from mpnb.core.dtype_names import HALF_DTYPES, half_dtype_name, parse_half_dtype
from mpnb.core.precision_configs import (
    DEFAULT_CONFIGS,
    DEFAULT_OPTIMIZER,
    OPTIMIZERS,
    PrecisionConfig,
    check_config_names,
    config_names,
    default_configs,
    get_config,
)

__all__ = [
    "RunConfig",
    "expand",
    "resolve_device",
    "half_name",
    "LossScaleRule",
    "OPTIMIZERS",
    "DEFAULT_OPTIMIZER",
]


@dataclass(frozen=True)
class RunConfig:
    """One configuration of a comparison: one row of the DataFrame.

    Args:
        workload: the workload's name (built-in or custom).
        config: the :class:`~mpnb.core.precision_configs.PrecisionConfig` this run applies
            (a name of :data:`~mpnb.core.precision_configs.PRECISION_CONFIGS` is looked up:
            ``"O0"`` .. ``"O3"``, ``"fp8-delayed"``, ``"bf16-pure+sr"``...).
        half_dtype: the short name of the dtype this run computes in, one of
            ``config.halves(...)``: ``"bf16"`` or ``"fp16"`` for O1-O3 and ``torch-amp``,
            ``"fp32"`` for O0, ``"fp8"`` for the FP8 recipes, ``"bf16"`` for the pure-bf16
            family, ``"tf32"`` for ``tf32``.
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
    config: PrecisionConfig
    half_dtype: str
    batch_size: int
    steps: int
    optimizer: str = DEFAULT_OPTIMIZER
    lr: float | None = None
    loss_scale: LossScaleRule | None = None
    device: str = "cpu"
    seed: int = 0
    warmup: int = 3

    def __post_init__(self) -> None:
        object.__setattr__(self, "config", get_config(self.config))

    @property
    def label(self) -> str:
        """A short name: ``"O2 bf16 b64"``, ``"fp8-delayed b64"`` (the name says the dtype)."""
        return f"{self.config.label(self.half_dtype)} b{self.batch_size}"

    @property
    def memory_step(self) -> int:
        """The step run under the memory tracker (the first after warm-up; never step 0,
        when the optimizer state does not exist yet)."""
        return max(1, self.warmup)

    @property
    def dtype(self) -> torch.dtype | None:
        """The half dtype as a torch dtype (None where the run has none: fp32, fp8)."""
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


def check_lr(lr) -> None:
    """Refuse a learning rate no optimizer takes: None (the workload's) or a finite number
    >= 0. Raises ValueError naming the value before any row runs (a row's optimizer would
    refuse it, once per row); the CLI, :func:`expand` and ``compare`` share this rule."""
    if lr is not None:
        positive_finite(
            lr,
            "lr",
            owner="mpnb.lab.compare",
            fix="pass lr= a finite number >= 0, or leave it out for the workload's",
            allow_zero=True,
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


def check_configs(configs) -> None:
    """Refuse an empty list, an unknown configuration name, or one given twice (it would run
    again under the same label). Raises ValueError naming the value and the valid choices."""
    given = tuple(configs)
    names = [c.name if isinstance(c, PrecisionConfig) else c for c in given]
    if not names:
        raise ValueError(
            f"configs=(): none given; choose from {', '.join(config_names())} (e.g. O0,O2)."
        )
    check_config_names(names, f"configs={given!r}: unknown configuration")
    twice = _twice(names)
    if twice:
        raise ValueError(
            f"configs={given!r} lists {', '.join(twice)} more than once; give each "
            f"configuration once (e.g. {','.join(dict.fromkeys(names))})."
        )


def configs_argument(configs, opt_levels=None, device: str | None = None) -> Sequence:
    """The configurations asked for by ``configs`` or by its former name ``opt_levels`` (at
    most one of the two; neither: :data:`~mpnb.core.precision_configs.DEFAULT_CONFIGS`, or
    with ``device`` given that device's :func:`~mpnb.core.precision_configs.default_configs`,
    which adds ``tf32`` on CUDA)."""
    if configs is not None and opt_levels is not None:
        raise TypeError(
            "give configs= or its former name opt_levels=, not both (they are one argument)."
        )
    chosen = configs if configs is not None else opt_levels
    if chosen is not None:
        return chosen
    return DEFAULT_CONFIGS if device is None else default_configs(resolve_device(device))


def _check(configs, batch_sizes, steps, optimizer, lr) -> None:
    check_configs(configs)
    check_batch_sizes(batch_sizes)
    check_steps(steps)
    check_lr(lr)
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r} is invalid; choose from {OPTIMIZERS}.")


def expand(
    workload: str,
    configs: Sequence[str | PrecisionConfig] = DEFAULT_CONFIGS,
    half_dtype="auto",
    batch_sizes: Sequence[int] = (64,),
    steps: int = 100,
    optimizer: str = DEFAULT_OPTIMIZER,
    lr: float | None = None,
    loss_scale=None,
    device="auto",
    seed: int = 0,
    warmup: int | None = None,
    compile_budget: float | None = None,
) -> list[RunConfig]:
    """Validate a request and expand it into one :class:`RunConfig` per configuration.

    ``configs`` are configuration names or :class:`~mpnb.core.precision_configs.PrecisionConfig`
    objects. ``half_dtype`` may be one dtype or a sequence (``("bf16", "fp16")``): each
    configuration runs once per dtype its ``halves`` gives (each half opt level and
    ``torch-amp`` once per dtype; O0 and the configurations that fix their precision, FP8, pure
    bf16 and ``tf32``, once) and batch size. ``compile_budget``: the seconds a compiling
    configuration (``torch-amp+compile``) may compile (None: its
    :data:`~mpnb.core.precision_configs.COMPILE_BUDGET_S`). Raises ValueError naming the bad
    value and the valid choices before anything runs.
    """
    given = tuple(configs)
    _check(given, tuple(batch_sizes), steps, optimizer, lr)
    cfgs = [get_config(c).with_options(compile_budget_s=compile_budget) for c in given]
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
        for pc in cfgs:
            for h in pc.halves(names):
                out.append(
                    RunConfig(workload, pc, h, b, steps, optimizer, lr, scale, dev, seed, wu)
                )
    return out
