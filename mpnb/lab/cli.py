"""``mpnb compare``: the flags become one ``compare`` call; the table is printed, the report
written. ``mpnb/cli.py`` registers the subcommand through :func:`add_parser`.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

__all__ = ["add_parser", "run", "format_table"]

_SHOW = (
    ("configuration", "config", "{}"),
    ("precision", "precision", "{}"),
    ("step_time_ms", "step ms", "{:.2f}"),
    ("step_time_iqr_ms", "IQR ms", "{:.2f}"),
    ("samples_per_s", "samples/s", "{:.0f}"),
    ("speedup_vs_O0", "vs O0", "{:.2f}x"),
    ("peak_mem_mib", "peak MiB", "{:.3f}"),
    ("mem_saving_vs_O0", "mem saved", "{:+.0%}"),
    ("final_loss", "loss", "{:.4f}"),
    ("metric", "metric", "{:.4f}"),
    ("metric_vs_O0", "d metric", "{:+.4f}"),
    ("output_diff_vs_O0", "out diff", "{:.1e}"),
    ("skipped_steps", "skipped", "{:.0f}"),
    ("final_loss_scale", "scale", "{:g}"),
)


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected a comma-separated list, got {text!r}"
            ) from None

    return parse


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to ``sub`` (an argparse subparsers object)."""
    from mpnb.lab.workloads import names

    p = sub.add_parser(
        "compare",
        help="train a workload under O0/O1/O2/O3: speed, memory, accuracy on this hardware",
    )
    p.add_argument("--workload", default="mlp", choices=names(), help="default: mlp")
    p.add_argument(
        "--opt-levels",
        type=_csv(str),
        default=("O0", "O1", "O2", "O3"),
        help="comma-separated, default O0,O1,O2,O3",
    )
    p.add_argument(
        "--dtype",
        type=_csv(str),
        default=("auto",),
        help="bf16, fp16, auto (bf16 on CPU, fp16 on CUDA) or bf16,fp16",
    )
    p.add_argument(
        "--batch-sizes",
        type=_csv(int),
        default=None,
        help="comma-separated (default: the workload's)",
    )
    p.add_argument("--steps", type=int, default=None, help="default: the workload's")
    p.add_argument(
        "--optimizer", default="adam", choices=("adam", "adamw", "sgd", "fused_adam", "fused_sgd")
    )
    p.add_argument("--lr", type=float, default=None)
    p.add_argument("--device", default="auto")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's; 1 is often faster on a busy CPU)",
    )
    p.add_argument("--isolate", action="store_true", help="each configuration in a subprocess")
    p.add_argument("--out", default="report.html", help="HTML report path ('' for none)")
    p.add_argument("--json", action="store_true", help="print the rows as JSON, not a table")
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=run)
    return p


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_table(df) -> str:
    """The rows of ``df`` as a fixed-width text table, then warnings and errors by config."""
    head = [h for _, h, _ in _SHOW]
    rows = [[_cell(r[c], f) for c, _, f in _SHOW] for _, r in df.iterrows()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=False)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    for _, r in df.iterrows():
        if r["error"]:
            out.append(f"ERROR {r['configuration']}: {r['error']}")
    notes = {w for ws in df["warnings"] for w in str(ws).split("; ") if w}
    out += [f"note: {w}" for w in sorted(notes)]
    return "\n".join(out)


def run(args: argparse.Namespace) -> int:
    """Run ``mpnb compare`` with parsed ``args``; returns the exit code."""
    import mpnb.lab

    dtype = args.dtype[0] if len(args.dtype) == 1 else args.dtype
    try:
        df = mpnb.lab.compare(
            args.workload,
            args.opt_levels,
            dtype,
            args.batch_sizes,
            args.steps,
            args.optimizer,
            args.lr,
            device=args.device,
            progress=not args.no_progress,
            isolate=args.isolate,
            threads=args.threads,
        )
    except (ValueError, TypeError) as e:
        print(f"mpnb compare: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(
            json.dumps(
                {
                    "hardware": df.attrs["hardware"],
                    "method": df.attrs["method"],
                    "rows": json.loads(df.to_json(orient="records")),
                },
                indent=1,
            )
        )
    else:
        hw = df.attrs["hardware"]
        print(
            f"mpnb compare: workload {args.workload}, {df.steps.iloc[0]} steps, "
            f"{df.attrs['method']}\nhardware: {hw['summary']}\n"
        )
        print(format_table(df))
    if args.out:
        path = mpnb.lab.report(df, args.out)
        print(f"\nreport: {path}", file=sys.stderr if args.json else sys.stdout)
    return 1 if (df["error"] != "").all() else 0
