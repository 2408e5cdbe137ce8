"""fp8: one Linear's training step under each FP8 recipe vs bf16 autocast, size by size.

Where does FP8 start to pay on this device? For each Linear shape of a stated list (``M``
tokens of ``K`` features to ``N``; square ``M = N = K`` and transformer-like ``tokens x d ->
4d``), each candidate times one training step of a single ``nn.Linear(K, N)``: fresh grads
(set to None), the forward under ``torch.autocast(bfloat16)``, the loss the output's sum, the
backward through the weight, the bias and the input (three GEMMs: ``6 * M * N * K`` FLOPs).

* ``bf16 autocast``, the baseline: the plain ``nn.Linear`` (fp32 weights cast by autocast).
* one candidate per FP8 recipe of :data:`RECIPES`, set up as mpnb sets it up
  (``get_config(name).apply(linear)``: the Linear swapped for ``mpnb.fp8.Float8Linear``),
  run in the very same step; under autocast its forward output is bf16 like the baseline's,
  ``dx`` and ``dW`` come out in the input's and the weight's dtype (float32).

Every candidate starts from the same weights, bias and input (one seed). Rows: the median
time per step, the median of the per-round ratios ``bf16 time / recipe time`` with its 95%
interval, the achieved TFLOP/s, and ``note``: whether the recipe's GEMMs are native or
emulated here, as its configuration says (:meth:`PrecisionConfig.status`, from
:func:`mpnb.core.hardware.dtype_support`), ``partly emulated`` when a layer's GEMM fell back
all the same (its ``Float8FallbackWarning``, shown once, says why). The summary says, per
recipe, the smallest shape where it paid (the interval's lower end above 1) or that it
never did (:func:`summary`).

Rounds and time: a full run takes 15 rounds, each candidate about 20 ms per round (at least
one step), so a shape costs at least 5 x 15 x 20 ms = 1.5 s; ``--quick`` takes 5 rounds of
5 ms and fewer shapes (:data:`SHAPES`). Expected on an H100 (estimated from its rates, to be
checked by the GPU run): the largest steps, 8192^3 and 8192x4096->16384, are ``6 * 8192^3`` =
3.3 TFLOP each, ~5 ms in bf16 (~700 TFLOP/s), 3-4 ms in FP8 tensorwise, ~45 ms for rowwise
(its float32 ``dx``/``dW`` GEMMs fall back: CUDA's rowwise ``torch._scaled_mm`` writes only
bfloat16) and ~65 ms for MXFP8 (emulated: a float32 GEMM at ~50 TFLOP/s). A round of the
five is then ~0.17 s, 15 rounds ~2.6 s per large shape; the four smaller shapes ~1.5 s each:
~11 s timed, ~20 s with start-up (CUDA context, the dtype probe). ``--quick``: ~10 s, mostly
start-up. On a CPU, where the FP8 GEMMs are emulated, the shapes are small (``--quick``: a
few seconds on two cores).

Example::

    mpnb bench fp8 --device cuda --json fp8.json     # ~20 s on an H100
    mpnb bench fp8 --quick                           # a few seconds on a CPU
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from mpnb.core.fp8 import Float8FallbackWarning
from mpnb.core.hardware import dtype_support, status_of
from mpnb.core.precision_configs import get_config
from mpnb.lab.bench._harness import Candidate, Case, Options, Row

__all__ = [
    "BASELINE",
    "COLUMNS",
    "RECIPES",
    "SHAPES",
    "LinearStep",
    "Shape",
    "cases",
    "pays_from",
    "summary",
]

#: The FP8 recipes compared, by precision-configuration name (each set up by its object).
RECIPES = ("fp8-tensorwise", "fp8-delayed", "fp8-rowwise", "mxfp8")
#: The baseline candidate's name.
BASELINE = "bf16 autocast"
#: The table's columns (titles of :data:`mpnb.lab.bench._report.COLUMN_TITLES`).
COLUMNS = (
    "case",
    "candidate",
    "note",
    "median",
    "spread",
    "vs PyTorch",
    "95% CI",
    "TFLOP/s",
    "preempt",
)
_SEED = 0
_ALIGN = 32  # MXFP8 takes blocks of 32 along each GEMM's contraction dim: M, K and N


@dataclass(frozen=True)
class Shape:
    """A Linear's GEMM: ``m`` tokens of ``k`` features to ``n``.

    Example::

        >>> Shape(8192, 4096, 16384).label, Shape(1024, 1024, 1024).label
        ('8192x4096->16384', '1024^3')
    """

    m: int
    k: int
    n: int

    @property
    def label(self) -> str:
        """``"1024^3"`` for a square shape, else ``"tokens x d_in -> d_out"``."""
        if self.m == self.k == self.n:
            return f"{self.m}^3"
        return f"{self.m}x{self.k}->{self.n}"

    @property
    def flops(self) -> int:
        """A training step's FLOPs: forward, ``dx`` and ``dW``, ``2 * M * N * K`` each."""
        return 6 * self.m * self.k * self.n

    def scaled(self, scale: float) -> Shape:
        """Each dim times ``scale``, rounded to a multiple of 32 (at least 32)."""
        if scale == 1.0:
            return self

        def dim(d: int) -> int:
            return max(_ALIGN, round(d * scale / _ALIGN) * _ALIGN)

        return Shape(dim(self.m), dim(self.k), dim(self.n))


def _square(*sizes: int) -> tuple[Shape, ...]:
    return tuple(Shape(s, s, s) for s in sizes)


#: ``{device type: (full sweep, --quick sweep)}``. On a CPU the FP8 GEMMs are emulated and a
#: 2048^3 step takes about half a second on two cores, so the CPU's shapes stay small.
SHAPES = {
    "cuda": (
        (*_square(1024, 2048, 4096, 8192), Shape(4096, 1024, 4096), Shape(8192, 4096, 16384)),
        _square(2048, 4096, 8192),
    ),
    "cpu": (
        (*_square(128, 256, 512, 1024), Shape(256, 256, 1024), Shape(512, 512, 2048)),
        (*_square(128, 256, 512), Shape(256, 256, 1024)),
    ),
}


class LinearStep:
    """One training step of ``model`` on ``x``: grads set to None, the forward under
    ``torch.autocast(bfloat16)``, ``loss = y.sum()``, the backward (into ``x.grad`` too).

    Args:
        model: the layer (an ``nn.Linear``, or the module a recipe made of it).
        x: the input, ``requires_grad`` so that the step computes ``dx`` as a layer inside a
            network does.

    Example::

        >>> step = LinearStep(nn.Linear(64, 256), torch.randn(32, 64, requires_grad=True))
        >>> step()
        >>> step.x.grad.shape
        torch.Size([32, 64])
    """

    def __init__(self, model: nn.Module, x: torch.Tensor) -> None:
        self.model, self.x = model, x
        self.params = list(model.parameters())

    def __call__(self) -> None:
        for p in self.params:
            p.grad = None
        self.x.grad = None
        with torch.autocast(self.x.device.type, dtype=torch.bfloat16):
            loss = self.model(self.x).sum()
        loss.backward()


def _data(shape: Shape, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight, bias (``nn.Linear``'s default range) and input every candidate gets."""
    g = torch.Generator(device=device).manual_seed(_SEED)
    bound = shape.k**-0.5

    def uniform(*size: int) -> torch.Tensor:
        return (torch.rand(*size, generator=g, device=device) * 2 - 1) * bound

    x = torch.randn(shape.m, shape.k, generator=g, device=device)
    return uniform(shape.n, shape.k), uniform(shape.n), x.requires_grad_()


def _linear(weight: torch.Tensor, bias: torch.Tensor) -> nn.Linear:
    """A fresh ``nn.Linear`` holding copies of ``weight`` and ``bias``."""
    out_features, in_features = weight.shape
    lin = nn.utils.skip_init(nn.Linear, in_features, out_features, device=weight.device)
    with torch.no_grad():
        lin.weight.copy_(weight)
        lin.bias.copy_(bias)
    return lin


def _fallbacks(step: LinearStep, shown: set[str]) -> list[str]:
    """Run ``step`` once; the FP8 fallback warnings it raised. Each is warned again unless
    its text is in ``shown`` (then added), so that a run shows each reason once."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always", Float8FallbackWarning)
        step()
    fell = [str(w.message) for w in seen if issubclass(w.category, Float8FallbackWarning)]
    for text in fell:
        if text not in shown:
            shown.add(text)
            warnings.warn(text, Float8FallbackWarning, stacklevel=2)
    return fell


def _recipe_note(config, device: str, fell_back: bool) -> str:
    """``"fp8 (native)"``, ``"fp8 (emulated)"`` as the configuration says, or ``"fp8 (partly
    emulated)"`` where it says native but a GEMM fell back."""
    (half,) = config.halves(())
    status = config.status(half, device=device)
    if fell_back and status == "native":
        status = "partly emulated"
    return config.precision_text(half, status)


def _bf16_note(device: str) -> str:
    return f"bf16 ({status_of(dtype_support(device), 'bf16')})"


def _case(shape: Shape, device: str, shown: set[str]) -> Case:
    """The baseline and every recipe on ``shape``, each its own layer with the same weights
    (``shown``: the fallback warnings this run has shown)."""
    weight, bias, x = _data(shape, device)
    base = LinearStep(_linear(weight, bias), x)
    cands = [Candidate(BASELINE, base, flops=shape.flops, note=_bf16_note(device))]
    for name in RECIPES:
        config = get_config(name)
        model, _ = config.apply(_linear(weight, bias))
        step = LinearStep(model, x)
        note = _recipe_note(config, device, bool(_fallbacks(step, shown)))
        cands.append(Candidate(name, step, flops=shape.flops, note=note))
    return Case("Linear train step", shape.label, cands)


def cases(opts: Options) -> Iterator[Case]:
    """One case per shape of the device's sweep (:data:`SHAPES`), its tensors alive only
    while it runs."""
    full, quick = SHAPES[torch.device(opts.device).type]
    shown: set[str] = set()
    for shape in quick if opts.quick else full:
        yield _case(shape.scaled(opts.scale), opts.device, shown)


# ---- the summary ---------------------------------------------------------------------------


def _paid(row: Row) -> bool:
    return row.ratio is not None and row.ratio > 1 and (row.ratio_lo or 0.0) > 1


def pays_from(recipe: str, rows: Sequence[Row]) -> str:
    """The sentence for one recipe's rows, ordered smallest shape first: the first shape where
    it measured faster than bf16 with the interval's lower end above 1, or that none did.

    Args:
        recipe: the candidate's name.
        rows: its rows, one per shape, in increasing FLOPs.

    Example::

        >>> pays_from("fp8-tensorwise", rows)
        'fp8-tensorwise pays from 4096^3 on this device (1.41x, 95% CI 1.38-1.45)'
    """
    first = next((r for r in rows if _paid(r)), None)
    if first is None:
        best = max(rows, key=lambda r: r.ratio)
        text = (
            f"{recipe} never paid in this sweep ({len(rows)} shapes, up to "
            f"{rows[-1].workload}; best {best.ratio:.2f}x at {best.workload})"
        )
        if all(r.ratio_lo is None for r in rows):
            text += "; too few rounds for an interval: run with --rounds 3 or more"
        return text
    text = (
        f"{recipe} pays from {first.workload} on this device ({first.ratio:.2f}x, "
        f"95% CI {first.ratio_lo:.2f}-{first.ratio_hi:.2f})"
    )
    later = [r.workload for r in rows[rows.index(first) + 1 :] if not _paid(r)]
    return text + (f"; not at the larger {', '.join(later)}" if later else "")


def summary(rows: Sequence[Row]) -> list[str]:
    """Per recipe (candidate), in table order, the :func:`pays_from` sentence over its rows
    sorted by FLOPs; rows without a ratio (a failed candidate) are left out.

    Example::

        >>> summary(result.rows)[0]
        'fp8-tensorwise never paid in this sweep (4 shapes, up to 512^3; best 0.31x at 512^3)'
    """
    by_recipe: dict[str, list[Row]] = {}
    for r in rows:
        if r.role == "candidate" and r.ratio is not None:
            by_recipe.setdefault(r.candidate, []).append(r)
    return [pays_from(name, sorted(rs, key=lambda r: r.flops)) for name, rs in by_recipe.items()]
