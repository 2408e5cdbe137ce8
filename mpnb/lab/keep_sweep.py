"""``sweep_kept``: the loss against the share of linear layers kept in high precision.

One :func:`~mpnb.lab.runner.compare` call trains ``O0`` and each low-precision configuration
once per number N of last transformer blocks kept in the model's precision (the
configurations ``"nvfp4:keep-last=N"``, :class:`~mpnb.core.fp8.keep.KeepList`), round-robin
in one process, from the same seed; this module only names those configurations and reads
the rows back: one per (configuration, N), with the share of linear layers kept and the loss
gap to ``O0``, and a plotly figure of loss against the share kept. The kept layers run in the
model's own precision, float32 here (the "BF16 layers" of a bf16 run are the same idea).

Example::

    >>> df = mpnb.lab.sweep_kept("transformer", "nvfp4", last=(0, 1, 2), size="small")
    >>> df[["kept_last", "kept_share", "final_loss", "loss_gap_vs_O0"]]
    >>> df.attrs["figure"].show()
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import pandas as pd
import torch

from mpnb.core.fp8.keep import KeepList, find_blocks, linear_layers
from mpnb.core.precision_configs import BASELINE, KEEP_CONFIGS, PrecisionConfig, get_config
from mpnb.lab.config import resolve_device
from mpnb.lab.runner import _workload, compare

__all__ = ["sweep_kept", "SWEEP_COLUMNS"]

#: the columns of the frame :func:`sweep_kept` returns
SWEEP_COLUMNS = (
    "configuration",
    "config",
    "batch_size",
    "kept_last",
    "kept_layers",
    "linear_layers",
    "kept_share",
    "final_loss",
    "eval_loss",
    "metric",
    "loss_gap_vs_O0",
    "loss_gap_rel",
    "status",
    "error",
)


def _bases(config) -> list[str]:
    """The configurations to sweep, by their table names; refuses those without keep-lists."""
    given = [config] if isinstance(config, (str, PrecisionConfig)) else list(config)
    names = [get_config(c).name.partition(":")[0] for c in given]
    names = [n for n in names if n != BASELINE]  # the reference runs anyway
    bad = [n for n in names if n not in KEEP_CONFIGS]
    if bad or not names:
        raise ValueError(
            f"sweep_kept: config={config!r}: {', '.join(bad) or 'nothing'} to sweep; the sweep "
            f"varies the keep-list of a low-precision configuration: give one or more of "
            f"{', '.join(KEEP_CONFIGS)} (O0 runs as the reference)."
        )
    if len(set(names)) < len(names):
        raise ValueError(
            f"sweep_kept: config={config!r} names a configuration twice; give each once."
        )
    return names


def _counts(last, n_blocks: int) -> list[int]:
    """The numbers of last blocks to keep, each given once; ``"all"`` is every block (merged
    with a count that says the same)."""
    values = [last] if isinstance(last, (int, str)) else list(last)
    for v in values:
        if v != "all" and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise ValueError(
                f"sweep_kept: last={last!r}: {v!r} is not a number of blocks; give counts such "
                "as (0, 1, 2) or 'all'."
            )
    if not values or len(set(values)) < len(values):
        raise ValueError(
            f"sweep_kept: last={last!r}: give each number of last blocks once, at least one "
            "(e.g. (0, 1, 2, 'all'))."
        )
    return list(dict.fromkeys(n_blocks if v == "all" else v for v in values))


def _plan(w, bases: list[str], last, head: bool) -> tuple[list[dict], int]:
    """One entry per (configuration, N): its name, N and share kept, checked on one fresh model
    before anything trains (an N beyond the block count is refused here)."""

    model = w.model_fn()
    found = find_blocks(model)
    n_blocks = len(found[1]) if found else 0
    counts = _counts(last, n_blocks)
    total = len(linear_layers(model))
    plan = []
    for base in bases:
        for n in counts:
            keep = KeepList(last=n, head=head)
            kept = len(keep.kept(model))  # raises for an N the model has no blocks for
            name = get_config(f"{base}:{keep.spec()}").name
            plan.append(dict(name=name, config=base, kept_last=n, kept_layers=kept, total=total))
    return plan, n_blocks


def _rows(df: pd.DataFrame, plan: list[dict]) -> pd.DataFrame:
    """The sweep's frame: each planned configuration's rows of compare's ``df`` (one per batch
    size), with the share kept and the gap to O0's final loss at the same batch size."""
    rows = []
    for p in plan:
        for _, r in df[df["opt_level"] == p["name"]].iterrows():
            base = df[(df["opt_level"] == BASELINE) & (df["batch_size"] == r["batch_size"])]
            b = float(base["final_loss"].iloc[0]) if len(base) else math.nan
            loss = float(r["final_loss"])
            rows.append(
                dict(
                    configuration=r["configuration"],
                    config=p["config"],
                    batch_size=r["batch_size"],
                    kept_last=p["kept_last"],
                    kept_layers=p["kept_layers"],
                    linear_layers=p["total"],
                    kept_share=p["kept_layers"] / p["total"] if p["total"] else 0.0,
                    final_loss=loss,
                    eval_loss=r["eval_loss"],
                    metric=r["metric"],
                    loss_gap_vs_O0=loss - b,
                    loss_gap_rel=(loss - b) / b if b else math.nan,
                    status=r["status"],
                    error=r["error"],
                )
            )
    return pd.DataFrame(rows, columns=list(SWEEP_COLUMNS))


def _figure(sweep: pd.DataFrame, df: pd.DataFrame):
    """Final loss against the share of linear layers kept: one line per configuration (and
    batch size), O0's loss as a dashed line."""
    # optional: plotly comes with the notebook extra
    import plotly.graph_objects as go

    fig = go.Figure()
    for (cfg, b), g in sweep.groupby(["config", "batch_size"], sort=False):
        g = g.sort_values("kept_share")
        fig.add_trace(
            go.Scatter(
                x=g["kept_share"],
                y=g["final_loss"],
                mode="lines+markers+text",
                text=[f"last {n}" for n in g["kept_last"]],
                textposition="top center",
                name=f"{cfg} b{b}",
            )
        )
    for _, r in df[df["opt_level"] == BASELINE].iterrows():
        fig.add_hline(
            y=float(r["final_loss"]),
            line_dash="dash",
            annotation_text=f"O0 b{r['batch_size']}",
            annotation_position="bottom right",
        )
    fig.update_layout(
        title="Final loss against the share of linear layers kept in fp32 (the last N blocks)",
        xaxis=dict(title="share of linear layers kept in fp32", tickformat=".0%"),
        yaxis=dict(title="final training loss (mean of the last 10 steps)"),
        legend=dict(orientation="h", y=-0.2),
    )
    return fig


def sweep_kept(
    workload="transformer",
    config: str | PrecisionConfig | Sequence = "nvfp4",
    last: Sequence[int | str] = (0, 1, 2, "all"),
    *,
    head: bool = False,
    data=None,
    steps: int | None = None,
    size: str = "auto",
    device="auto",
    seed: int = 0,
    progress: bool = True,
    **compare_kwargs,
) -> pd.DataFrame:
    """Train ``config`` keeping the last N blocks in the model's precision, for each N of
    ``last``, beside ``O0``, in one :func:`~mpnb.lab.runner.compare`; one row per N.

    Args:
        workload: as for :func:`~mpnb.lab.runner.compare` (a built-in name, a Workload, or
            a model factory given with ``data``).
        config: a low-precision configuration (:data:`~mpnb.core.precision_configs.
            KEEP_CONFIGS`: the FP8, MX and four-bit ones), or several; a keep-list it
            carries is replaced by each N's.
        last: the numbers of last blocks kept (``"all"``: every block, once even where a
            count says the same: the small GPT's 2 blocks run 0, 1, 2); each at most the
            model's block count (the ``nn.ModuleList`` / ``nn.Sequential`` of repeated blocks,
            :func:`mpnb.core.fp8.keep.find_blocks`), checked before anything trains.
        head: also keep the output head (the linear layers after the blocks) in every row.
        data, steps, size, device, seed, progress: as for ``compare``; the other keyword
            arguments (``batch_sizes``, ``half_dtype``, ``optimizer``, ``lr``, ``threads``,
            ``isolate``...) go to ``compare`` as they are (``configs`` is this sweep's).

    Returns:
        A DataFrame with :data:`SWEEP_COLUMNS`, one row per (configuration, N, batch size):
        ``kept_last`` (N), ``kept_layers`` of ``linear_layers``, ``kept_share`` (0..1 of the
        linear layers), ``final_loss`` (the mean of the last 10 training losses, as
        compare's), ``loss_gap_vs_O0`` (minus O0's) and ``loss_gap_rel`` (divided by O0's).
        ``attrs``: ``figure`` (plotly: loss against the share kept), ``compare`` (compare's
        frame, O0's row included, with its verdict and history), ``blocks`` (the block count).

    Raises:
        ValueError: a configuration without keep-lists, an N beyond the block count or on a
            model without blocks, an N given twice; before anything trains.

    Example::

        >>> df = sweep_kept("transformer", ("nvfp4", "mxfp4"), last=(0, 1, "all"), steps=12)
        >>> df.attrs["figure"]
    """
    if "configs" in compare_kwargs or "opt_levels" in compare_kwargs:
        raise TypeError(
            "sweep_kept: the configurations are config= and last= (each N becomes "
            "'<config>:keep-last=N'); drop configs=."
        )
    dev = resolve_device(device)
    bases = _bases(config)
    loss_fn, metric_fn = compare_kwargs.pop("loss_fn", None), compare_kwargs.pop("metric_fn", None)
    eval_data = compare_kwargs.pop("eval_data", None)
    w = _workload(workload, data, loss_fn, metric_fn, eval_data, size, dev)
    with torch.random.fork_rng(devices=[]):  # counting blocks leaves the caller's RNG alone
        plan, n_blocks = _plan(w, bases, last, head)
    df = compare(
        w,
        configs=[BASELINE, *(p["name"] for p in plan)],
        steps=steps,
        device=dev,
        seed=seed,
        progress=progress,
        **compare_kwargs,
    )
    sweep = _rows(df, plan)
    sweep.attrs["figure"] = _figure(sweep, df)
    sweep.attrs["compare"] = df
    sweep.attrs["blocks"] = n_blocks
    return sweep
