"""The precision configurations mpnb compares, defined once: each one object that knows itself.

====================  ========================================================================
name                  what it is
====================  ========================================================================
``O0``..``O3``        Apex's opt levels through :func:`mpnb.amp.initialize`
``O0+graph``..        an opt level with the whole step captured in a CUDA graph (CUDA only)
``torch-amp``         peer: ``torch.autocast`` + ``torch.amp.GradScaler`` + fused ``AdamW``
``tf32``              peer: fp32 with TF32 matmuls and convolutions (CUDA, Ampere and newer)
``torch-amp+compile`` peer: ``torch-amp`` through ``torch.compile`` (compile time apart)
``fp8-tensorwise``    FP8 linear layers, per-tensor current scaling (:mod:`mpnb.fp8`)
``fp8-delayed``       FP8 linear layers, per-tensor scales from an amax history
``fp8-rowwise``       FP8 linear layers, one scale per row
``mxfp8``             FP8 linear layers, 32-element blocks, E8M0 scales rounded up (RCEIL)
``bf16-pure``         every weight, grad and activation bf16, no fp32 masters (= O3 in bf16)
``bf16-pure+sr``      bf16-pure, the optimizer rounds updates stochastically to bf16
``bf16-pure+kahan``   bf16-pure, the optimizer keeps a Kahan compensation buffer
====================  ========================================================================

The FP8, MX and four-bit configurations take a keep-list after their name, options joined by
``:`` (:class:`mpnb.core.fp8.keep.KeepList`): ``"nvfp4:keep-last=2"`` (the last two blocks'
linear layers stay float32), ``"mxfp4:keep-first=1:keep-last=1"``, ``"mxfp8:keep=head"``,
``"fp8-delayed:keep=blocks.*.mlp.*+head"``, ``"nvfp4:keep-last=15%:keep-head"``,
``"nvfp4:keep-none"``; a keep-list given so replaces the configuration's own. The NVFP4
configurations keep ``keep-last=15%:keep-head`` by default (:data:`NVFP4_KEEP`); the others
keep nothing.

Each is a :class:`PrecisionConfig` (:class:`AmpConfig`, :class:`Float8Config`,
:class:`PureHalfConfig`; the peers, what a user would pick instead of mpnb, are
:class:`TorchAmpConfig`, :class:`TF32Config`, :class:`TorchAmpCompileConfig`, with ``peer``
True). Callers ask it, never test its class or name: how to set a model and
optimizer up (:meth:`~PrecisionConfig.apply`, :meth:`~PrecisionConfig.setup`,
:meth:`~PrecisionConfig.make_optimizer`) and train them (:meth:`~PrecisionConfig.train_step`,
a :class:`TrainStep`: one loop trains every configuration), the lines a user writes to train
that way (:meth:`~PrecisionConfig.snippet`), which dtypes its runs use
(:meth:`~PrecisionConfig.halves`, :meth:`~PrecisionConfig.half_dtype`), where each tensor is
stored (``weights``, ``grads``, ``optimizer_state``: dtype names, ``"half"`` meaning the
run's half dtype; ``stores``: the extra state the memory tracker counts), whether a device
emulates it (:meth:`~PrecisionConfig.status`, from doctor's facts), its label and its row's
precision text. The FP8 configurations keep every other op in float32.

The distributed policies (DDP with fp32 or compressed gradients, mpnb amp O2 with mpnb's DDP,
FSDP2 with a ``MixedPrecisionPolicy``) are :class:`DistributedConfig` objects in
:data:`DISTRIBUTED_CONFIGS`, asked the same way (:meth:`~DistributedConfig.wrap`,
:meth:`~DistributedConfig.backward`, :meth:`~DistributedConfig.unavailable`, their dtypes,
label and tolerance); :func:`mpnb.lab.compare` with ``ranks=N`` compares them.

Adding a configuration is one entry in :data:`PRECISION_CONFIGS` (and one class when no
existing one fits); the lab, the CLI and the widgets offer it from the table.

Example::

    >>> cfg = PRECISION_CONFIGS["fp8-delayed"]
    >>> model, opt = cfg.apply(model, opt)
    >>> cfg.dtypes(torch.bfloat16)["weights"]
    (torch.float32,)
"""

from __future__ import annotations

import types

from mpnb.core.amp import FSDP2_DTYPES
from mpnb.core.opt_levels import OPT_LEVEL_DESCRIPTIONS, check_names
from mpnb.core.precision_configs._amp import AmpConfig
from mpnb.core.precision_configs._base import PrecisionConfig, StoredRole
from mpnb.core.precision_configs._distributed import STRATEGIES, DistributedConfig
from mpnb.core.precision_configs._float8 import FP8_SCALES, Float8Config, keep_sentence
from mpnb.core.precision_configs._graphed import GraphedAmpConfig
from mpnb.core.precision_configs._optimizers import DEFAULT_OPTIMIZER, OPTIMIZERS, make_optimizer
from mpnb.core.precision_configs._peer_steps import tf32_enabled
from mpnb.core.precision_configs._peers import (
    COMPILE_BUDGET_S,
    TF32Config,
    TorchAmpCompileConfig,
    TorchAmpConfig,
)
from mpnb.core.precision_configs._pure_half import KAHAN_BUFFERS, PureHalfConfig
from mpnb.core.precision_configs._step import AmpStep, TrainStep

__all__ = [
    "PrecisionConfig",
    "AmpConfig",
    "GraphedAmpConfig",
    "Float8Config",
    "PureHalfConfig",
    "TorchAmpConfig",
    "TF32Config",
    "TorchAmpCompileConfig",
    "TrainStep",
    "AmpStep",
    "COMPILE_BUDGET_S",
    "tf32_enabled",
    "default_configs",
    "with_cuda_graphs",
    "StoredRole",
    "DistributedConfig",
    "DISTRIBUTED_CONFIGS",
    "STRATEGIES",
    "distributed_names",
    "get_distributed_config",
    "fsdp2_instead_of",
    "PRECISION_CONFIGS",
    "BASELINE",
    "DEFAULT_CONFIGS",
    "OPTIMIZERS",
    "DEFAULT_OPTIMIZER",
    "STORED_ROLES",
    "config_names",
    "get_config",
    "check_config_names",
    "KEEP_CONFIGS",
    "NVFP4_KEEP",
    "make_optimizer",
]

_F32 = ("float32",)
_AUTOCAST = "half (autocast's lower-precision list), float32 (its fp32 list)"
_FP8 = "float8_e4m3fn / float8_e5m2 GEMMs in nn.Linear, float32 elsewhere"


def _amp(name: str, weights: tuple, grads: tuple, state: tuple, compute: str) -> AmpConfig:
    return AmpConfig(name, OPT_LEVEL_DESCRIPTIONS[name], weights, grads, state, compute)


def _graphed(level: AmpConfig) -> GraphedAmpConfig:
    description = f"{level.name} with the whole step captured in a CUDA graph and replayed (CUDA)."
    return GraphedAmpConfig(
        f"{level.name}+graph", description, level.weights, level.grads, level.optimizer_state,
        level.compute, level=level.name,
    )  # fmt: skip


_LEVELS = (
    _amp("O0", _F32, _F32, _F32, "float32"),
    _amp("O1", _F32, _F32, _F32, _AUTOCAST),
    _amp("O2", ("half", "float32"), ("half", "float32"), _F32, "half"),
    _amp("O3", ("half",), ("half",), ("half",), "half"),
)


def _fp8(name: str, description: str, recipe: str, extra: str = "", **kw) -> Float8Config:
    return Float8Config(
        name, description, _F32, _F32, _F32, _FP8, extra, (FP8_SCALES,), recipe, **kw
    )


_FP4 = "E2M1 GEMMs in nn.Linear (emulated, two scale levels), float32 elsewhere"

#: The keep-list of the NVFP4 configurations: the fewest last blocks that make at least 15% of
#: the blocks (``ceil(0.15 * blocks)``), and the output head, stay float32 (the run's high
#: precision: the "BF16 layers" of a bf16 run). Source: NVIDIA's NVFP4 pretraining report
#: (arXiv 2509.25149), as read in a summary of its recommendations (not in the report's own
#: text): keep a few sensitive linear layers in higher precision, about 15% of the network and
#: mostly at its end, since training diverged with every linear layer in FP4 and the last
#: layers showed the largest weight-gradient quantization errors; the output projection head
#: and the embeddings are never quantized. Rounding up (a 2-block model keeps its last block)
#: is mpnb's reading for shallow models. The head is kept because the report's recipe never
#: runs it in FP4 while mpnb's swap would (it is an nn.Linear): keeping it is what makes a run
#: the report's recipe. A model without a block list keeps nothing by this rule (no blocks,
#: no head after them).
NVFP4_KEEP = "keep-last=15%:keep-head"


def _fp4(name: str, description: str, recipe: str, keep: str = "", **options) -> Float8Config:
    return Float8Config(
        name,
        description,
        _F32,
        _F32,
        _F32,
        _FP4,
        "",
        (FP8_SCALES,),
        recipe,
        gemm_emulated=True,
        format_name=recipe,
        recipe_options=tuple(options.items()),
        keep=keep,
    )


def _nvfp4(name: str, description: str, **options) -> Float8Config:
    return _fp4(name, description + keep_sentence(NVFP4_KEEP), "nvfp4", NVFP4_KEEP, **options)


#: the four-bit recipes (TransformerEngine's NVFP4 and its switches, torchao's NVFP4, MXFP4)
_FP4_CONFIGS = (
    _nvfp4(
        "nvfp4",
        "NVFP4 linear layers as TransformerEngine: E2M1 in blocks of 16, E4M3 "
        "block scales, a float32 tensor scale; 16x16 weight blocks, RHT on Wgrad, stochastic "
        "rounding of gradients; emulated GEMM.",
    ),
    _nvfp4(
        "nvfp4-no-rht", "NVFP4 without the random Hadamard transform (TE disable_rht).", rht=False
    ),
    _nvfp4(
        "nvfp4-no-sr",
        "NVFP4 with gradients rounded to nearest (TE disable_stochastic_rounding).",
        stochastic_rounding=False,
    ),
    _nvfp4("nvfp4-1d", "NVFP4 with 1x16 weight blocks (TE disable_2d_quantization).", two_d=False),
    _nvfp4(
        "nvfp4-torchao",
        "torchao's NVFP4: block scales clamped at E4M3's smallest normal, "
        "nearest rounding, no RHT; emulated GEMM.",
        torchao=True,
        rht=False,
        stochastic_rounding=False,
    ),
    _fp4(
        "mxfp4",
        "MXFP4 linear layers: E2M1 in blocks of 32, E8M0 scales rounded up (RCEIL); emulated GEMM.",
        "mxfp4",
    ),
    _fp4(
        "mxfp4+sr+rht",
        "MXFP4 with stochastic rounding of gradients and the RHT on Wgrad (Tseng et al. 2025).",
        "mxfp4",
        rht=True,
        stochastic_rounding=True,
    ),
)


def _pure(name, description, state: tuple, extra="", stores=(), option=None, half="bfloat16"):
    own = (half,)
    return PureHalfConfig(name, description, own, own, state, half, extra, stores, half, option)


PRECISION_CONFIGS = types.MappingProxyType(
    {
        c.name: c
        for c in (
            *_LEVELS,
            *map(_graphed, _LEVELS),
            TorchAmpConfig(
                "torch-amp",
                "PyTorch's AMP: torch.autocast, torch.amp.GradScaler (fp16; off for bf16), "
                "torch.optim.AdamW(fused=True); fp32 weights.",
                _F32,
                _F32,
                _F32,
                _AUTOCAST,
            ),
            TF32Config(
                "tf32",
                "fp32 with TF32 matmuls and convolutions (10-bit mantissa on tensor cores; "
                "CUDA, compute capability 8.0+).",
                _F32,
                _F32,
                _F32,
                "tf32 (fp32 GEMMs on tensor cores)",
            ),
            TorchAmpCompileConfig(
                "torch-amp+compile",
                "torch-amp with torch.compile(model); the compile time is its own column.",
                _F32,
                _F32,
                _F32,
                _AUTOCAST,
            ),
            _fp8(
                "fp8-tensorwise",
                "FP8 linear layers, per-tensor current scaling (scale from each tensor's amax).",
                "tensorwise",
            ),
            _fp8(
                "fp8-delayed",
                "FP8 linear layers, per-tensor scales from a 1024-step amax history (TE).",
                "delayed",
                "fp8_amax_history (1024 x 3 float32) and fp8_scale (3) per linear layer",
            ),
            _fp8(
                "fp8-rowwise",
                "FP8 (E4M3) linear layers, one power-of-two scale per row of each operand.",
                "rowwise",
            ),
            _fp8(
                "mxfp8",
                "MXFP8 linear layers: E4M3 values, one E8M0 scale per 32 rounded up (RCEIL, "
                "as TransformerEngine); emulated GEMM.",
                "mxfp8",
                gemm_emulated=True,
            ),
            *_FP4_CONFIGS,
            _pure(
                "bf16-pure",
                "Pure bf16: weights, grads, activations bf16, no masters, no loss scaling.",
                ("bfloat16",),
            ),
            _pure(
                "bf16-pure+sr",
                "Pure bf16; needs FusedAdam(stochastic_rounding=True): fp32 update, "
                "stochastically rounded to bf16.",
                _F32,
                option="stochastic_rounding",
            ),
            _pure(
                "bf16-pure+kahan",
                "Pure bf16; needs FusedAdam(kahan_summation=True): a bf16 compensation buffer.",
                _F32,
                "a bf16 Kahan compensation buffer per parameter (2 bytes/param, optimizer "
                "state['compensation'])",
                (KAHAN_BUFFERS,),
                "kahan_summation",
            ),
        )
    }
)

#: the configuration every row is compared with (``speedup_vs_O0``, ``mem_saving_vs_O0``)
BASELINE = "O0"


def with_cuda_graphs(names) -> tuple[str, ...]:
    """``names`` followed by the CUDA-graph twin of each one that has one (``O2`` ->
    ``O2+graph``), as ``mpnb compare --cuda-graphs`` runs them.

    Example::

        >>> with_cuda_graphs(("O0", "O2", "torch-amp"))
        ('O0', 'O2', 'torch-amp', 'O0+graph', 'O2+graph')
    """
    names = tuple(c.name if isinstance(c, PrecisionConfig) else c for c in names)
    twins = {c.captures: n for n, c in PRECISION_CONFIGS.items() if c.captures}
    return names + tuple(twins[n] for n in names if n in twins and twins[n] not in names)


def default_configs(device: str = "cpu") -> tuple[str, ...]:
    """What a comparison on ``device`` runs when no configuration is named: the
    configurations that say they run by default there (Apex's four levels and ``torch-amp``
    everywhere, ``tf32`` on CUDA), in table order.

    Example::

        >>> default_configs("cuda")[-2:]
        ('torch-amp', 'tf32')
    """
    kind = str(device).split(":")[0]
    return tuple(n for n, c in PRECISION_CONFIGS.items() if c.runs_by_default(kind))


#: what compare and the widgets run on a CPU when no configuration is named (on CUDA:
#: :func:`default_configs`, which adds ``tf32``)
DEFAULT_CONFIGS = default_configs("cpu")

#: the extra state every configuration stores, once each, in table order (the memory roles
#: beyond params, grads, master weights and optimizer state)
STORED_ROLES: tuple[StoredRole, ...] = tuple(
    dict.fromkeys(r for c in PRECISION_CONFIGS.values() for r in c.stores)
)


def config_names() -> tuple[str, ...]:
    """The configuration names, in table order."""
    return tuple(PRECISION_CONFIGS)


#: the configurations that take a keep-list after their name (``"nvfp4:keep-last=2"``)
KEEP_CONFIGS = tuple(n for n, c in PRECISION_CONFIGS.items() if isinstance(c, Float8Config))


def _check_bases(values: list, what: str) -> None:
    """Refuse the values whose name (before any ``:``) is no configuration, in one ValueError;
    a keep option split off its configuration by a comma is told how to join it."""
    bases = [v.partition(":")[0] if isinstance(v, str) else v for v in values]
    try:
        check_names(bases, config_names(), what)
    except ValueError as e:
        stray = [v for v in values if isinstance(v, str) and v.startswith(("keep", "blocks="))]
        if not stray:
            raise
        raise ValueError(
            f"{e} {', '.join(map(repr, stray))}: keep options join their configuration with "
            "':' (nvfp4:keep-first=1:keep-last=1), not ','."
        ) from None


def check_config_names(values, what: str = "unknown precision config") -> None:
    """Refuse every value that names no configuration, in one ValueError (``what`` starts
    it), then check each keep-list a name carries (``"nvfp4:keep-last=2"``).

    Raises:
        ValueError: naming the valid choices ("the letter O, not zero" for ``"02"``; for a
            keep option split off its configuration by a comma, how to join it).
    """
    values = list(values)
    _check_bases(values, what)
    for v in values:
        if ":" in v:
            get_config(v)


def get_config(name: str | PrecisionConfig) -> PrecisionConfig:
    """The configuration called ``name`` (a :class:`PrecisionConfig` is returned as is);
    a name of :data:`KEEP_CONFIGS` may carry a keep-list after ``:``
    (:meth:`Float8Config.with_keep`).

    Raises:
        ValueError: naming the valid choices (and "the letter O, not zero" for ``"02"``); a
            keep-list on a configuration that takes none, or a bad one, naming the fix.

    Example::

        >>> get_config("O2").weights
        ('half', 'float32')
        >>> get_config("nvfp4:keep-last=2").name
        'nvfp4:keep-last=2'
    """
    if isinstance(name, PrecisionConfig):
        return name
    _check_bases([name], "unknown precision config")
    base, sep, spec = name.partition(":")
    if not sep:
        return PRECISION_CONFIGS[base]
    if base not in KEEP_CONFIGS:
        raise ValueError(
            f"precision config {name!r}: {base} takes no keep-list (it keeps every layer in "
            f"its own precision); keep-lists go with {', '.join(KEEP_CONFIGS)}."
        )
    return PRECISION_CONFIGS[base].with_keep(spec)


# ---- distributed policies (mpnb.lab.compare(..., ranks=N)) ---------------------------------

_BF16_TOL = 2e-2  # a bf16 rounding of grads or params: see DistributedConfig.tolerance


def _dist(name, description, strategy, param, reduce, tol=1e-4, **kw) -> DistributedConfig:
    return DistributedConfig(name, description, strategy, param, reduce, tolerance=tol, **kw)


#: The distributed precision policies, by name: DDP (PyTorch's, its compression hooks; mpnb
#: amp O2 with mpnb's DDP, Apex's way) and FSDP2 (``fully_shard`` with a
#: ``MixedPrecisionPolicy``). :func:`mpnb.lab.compare` with ``ranks=N`` offers them as rows.
DISTRIBUTED_CONFIGS = types.MappingProxyType(
    {
        c.name: c
        for c in (
            _dist(
                "ddp-fp32",
                "PyTorch DDP: fp32 parameters, fp32 gradient all-reduce.",
                "ddp",
                "float32",
                "float32",
            ),
            _dist(
                "ddp-bf16-compress",
                "PyTorch DDP with bf16_compress_hook: fp32 parameters, gradients all-reduced "
                "in bf16.",
                "ddp",
                "float32",
                "bfloat16",
                _BF16_TOL,
                compress="bfloat16",
            ),
            _dist(
                "ddp-fp16-compress",
                "PyTorch DDP with fp16_compress_hook: fp32 parameters, gradients all-reduced "
                "in fp16.",
                "ddp",
                "float32",
                "float16",
                _BF16_TOL,
                compress="float16",
            ),
            _dist(
                "ddp-mpnb-O2",
                "mpnb amp O2 (bf16 model, fp32 master weights) with mpnb's DDP (Apex's way): "
                "bf16 gradients all-reduced.",
                "ddp",
                "bfloat16",
                "bfloat16",
                _BF16_TOL,
                amp_level="O2",
            ),
            _dist(
                "fsdp2-fp32",
                "PyTorch FSDP2 (fully_shard): fp32 parameters and reduce-scatter, 1/N per rank.",
                "fsdp2",
                "float32",
                "float32",
            ),
            _dist(
                "fsdp2-bf16-param-fp32-reduce",
                "FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32): bf16 "
                "all-gather and compute, fp32 gradient reduce-scatter.",
                "fsdp2",
                "bfloat16",
                "float32",
                _BF16_TOL,
            ),
            _dist(
                "fsdp2-bf16-reduce",
                "FSDP2, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16): bf16 "
                "all-gather, compute and reduce-scatter.",
                "fsdp2",
                "bfloat16",
                "bfloat16",
                _BF16_TOL,
            ),
        )
    }
)


def distributed_names(strategy: str | None = None) -> tuple[str, ...]:
    """The distributed policies' names of ``strategy`` (``"ddp"``, ``"fsdp2"``; None or
    ``"both"``: all), in table order.

    Raises:
        ValueError: an unknown strategy, naming the valid ones.
    """
    if strategy in (None, "both"):
        return tuple(DISTRIBUTED_CONFIGS)
    if strategy not in STRATEGIES:
        raise ValueError(
            f"strategy={strategy!r} is unknown; use one of {', '.join(STRATEGIES)} or 'both'."
        )
    return tuple(n for n, c in DISTRIBUTED_CONFIGS.items() if c.strategy == strategy)


def get_distributed_config(name: str | DistributedConfig) -> DistributedConfig:
    """The distributed policy called ``name`` (a :class:`DistributedConfig` is returned as is).

    Raises:
        ValueError: naming the valid choices.
    """
    if isinstance(name, DistributedConfig):
        return name
    if name not in DISTRIBUTED_CONFIGS:
        raise ValueError(
            f"unknown distributed policy {name!r}; choose from {', '.join(DISTRIBUTED_CONFIGS)}"
            + (
                " (the single-process configurations run with ranks=None)"
                if name in PRECISION_CONFIGS
                else ""
            )
            + "."
        )
    return DISTRIBUTED_CONFIGS[name]


def fsdp2_instead_of(opt_level: str) -> DistributedConfig:
    """The FSDP2 policy that does on a sharded model what amp ``opt_level`` (O1-O3) does on a
    whole one: bf16 compute, fp32 gradient reduction (O3's pure half: bf16 reduction).

    amp owns that rule (:data:`mpnb.core.amp.FSDP2_DTYPES`); this picks the FSDP2 row with
    those dtypes, e.g. to reword a :class:`mpnb.core.amp.ShardedModelError` with its name.
    """
    if opt_level not in FSDP2_DTYPES:
        raise ValueError(
            f"fsdp2_instead_of({opt_level!r}): only O1-O3 have an FSDP2 policy instead; "
            f"pass one of {sorted(FSDP2_DTYPES)} (O0 runs on a sharded model as it is)."
        )
    param, reduce = FSDP2_DTYPES[opt_level]
    (config,) = (
        c
        for c in DISTRIBUTED_CONFIGS.values()
        if c.strategy == "fsdp2" and tuple(c.dtypes().values()) == (param, reduce)
    )
    return config
