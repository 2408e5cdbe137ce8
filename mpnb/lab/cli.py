"""``mpnb compare``: the flags become one ``compare`` call; the table is printed, the report
written. ``mpnb/cli.py`` registers the subcommand through :func:`add_parser`.

``--keep-last 0,1,2,all`` makes it the keep-list sweep (:func:`mpnb.lab.sweep_kept`): each
configuration of ``--configs`` (default nvfp4) once per number of last blocks kept in fp32,
beside O0, in the same one ``compare``; the sweep's table (share kept, loss, gap to O0) follows
the rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys

from mpnb.lab._files import unwritable_reason
from mpnb.lab._rows import split_warnings

__all__ = ["add_parser", "run", "format_table", "format_sweep"]

_SHOW = (
    ("configuration", "config", "{}"),
    ("precision", "precision", "{}"),
    ("speed_label", "speed vs O0", "{}"),
    ("speedup_vs_O0", "x O0", "{:.2f}"),
    ("speedup_lo", "95% lo", "{:.2f}"),
    ("speedup_hi", "95% hi", "{:.2f}"),
    ("step_time_ms", "step ms", "{:.1f}"),
    ("samples_per_s", "samples/s", "{:.0f}"),
    ("peak_mem_mib", "peak MiB", "{:.1f}"),
    ("mem_saving_vs_O0", "mem saved", "{:+.0%}"),
    ("final_loss", "loss", "{:.4f}"),
    ("metric", "metric", "{:.4f}"),
    ("metric_vs_O0", "d metric", "{:+.4f}"),
    ("output_diff_vs_O0", "out diff", "{:.1e}"),
    ("skipped_steps", "skipped", "{:.0f}"),
    ("final_loss_scale", "scale", "{:g}"),
    ("host_syncs_per_step", "syncs", "{:.0f}"),
    ("compile_s", "compile s", "{:.1f}"),
    ("gpu_busy", "GPU busy", "{:.0%}"),
)
#: columns shown only when some row has a value (a compiling configuration; a CUDA run)
_WHEN_SET = ("compile_s", "gpu_busy")


def _csv(kind):
    what = "integers" if kind is int else "values"

    def parse(text: str):
        try:
            return tuple(kind(v.strip()) for v in text.split(",") if v.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated {what} (e.g. 16,32), got {text!r}"
            ) from None

    return parse


def _keep_counts(text: str) -> tuple:
    """``--keep-last``: comma-separated numbers of last blocks, or ``all``."""
    try:
        return tuple(v if v == "all" else int(v) for v in map(str.strip, text.split(",")) if v)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers of blocks or 'all' (e.g. 0,1,2,all), got {text!r}"
        ) from None


def _checked(parse, check):
    """An argparse type: ``parse`` the text, then apply the lab's own ``check`` to the value
    (its ValueError becomes the usage error, so the CLI refuses before anything runs)."""

    def typed(text: str):
        value = parse(text)
        try:
            check(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value

    typed.__name__ = getattr(parse, "__name__", "value")  # argparse's "invalid int value"
    return typed


def add_parser(sub) -> argparse.ArgumentParser:
    """Add the ``compare`` subcommand to ``sub`` (an argparse subparsers object)."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.core.precision_configs import COMPILE_BUDGET_S, DEFAULT_CONFIGS, config_names
    from mpnb.lab.config import (
        DEFAULT_OPTIMIZER,
        OPTIMIZERS,
        check_batch_sizes,
        check_lr,
        check_steps,
    )
    from mpnb.lab.workloads import GPU_SIZE, SIZES, names

    p = sub.add_parser(
        "compare",
        help="train a workload under O0-O3, FP8 recipes or pure bf16: speed, memory, accuracy "
        "on this hardware",
    )
    p.add_argument("--workload", default=names()[0], choices=names(), help=f"default: {names()[0]}")
    p.add_argument(
        "--size",
        default="auto",
        choices=("auto", *SIZES, GPU_SIZE),
        help=f"workload size (default auto: small on CPU; on CUDA {GPU_SIZE}, sized from the "
        "card so that the fp32 step keeps the GPU computing)",
    )
    p.add_argument(
        "--configs",
        "--opt-levels",  # the flag's former name, still accepted
        dest="configs",
        type=_csv(str),
        default=None,
        help=f"comma-separated precision configurations, default {','.join(DEFAULT_CONFIGS)} "
        f"(and tf32 on CUDA); any of {','.join(config_names())} (--opt-levels is the former "
        "name; torch-amp, tf32 and torch-amp+compile are PyTorch's own ways, as peers); the "
        "FP8, MX and four-bit ones take a keep-list after ':' (nvfp4:keep-last=2)",
    )
    p.add_argument(
        "--keep-last",
        type=_keep_counts,
        default=None,
        metavar="N,N,...",
        help="sweep the keep-list: run each of --configs (default nvfp4; FP8, MX or four-bit "
        "ones) once per number of last transformer blocks kept in fp32 (e.g. 0,1,2,all), "
        "beside O0, and print loss against the share of linear layers kept; a single "
        "configuration takes a keep-list in its name instead (nvfp4:keep-last=2, "
        "mxfp4:keep-first=1:keep-last=1, mxfp8:keep=head)",
    )
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="also run each opt level asked for with its whole step captured in a CUDA graph "
        "and replayed (O2 -> O2+graph; CUDA only)",
    )
    p.add_argument(
        "--compile-budget",
        type=float,
        default=None,
        metavar="S",
        help=f"seconds torch-amp+compile may take to compile (default {COMPILE_BUDGET_S:g}); "
        "its compile time is its own column, never in a step time",
    )
    p.add_argument(
        "--dtype",
        type=_csv(str),
        default=("auto",),
        help="bf16, fp16, auto (bf16 on CPU, fp16 on CUDA) or bf16,fp16",
    )
    p.add_argument(
        "--batch-sizes",
        type=_checked(_csv(int), check_batch_sizes),
        default=None,
        help="comma-separated (default: the workload's)",
    )
    p.add_argument(
        "--steps",
        type=_checked(int, check_steps),
        default=None,
        help="at least 2; default: the workload's",
    )
    p.add_argument(
        "--optimizer",
        default=None,  # compare's own default: the one-process and the distributed ones differ
        choices=OPTIMIZERS,
        help=f"default {DEFAULT_OPTIMIZER} (mpnb's FusedAdam: a fused step, as torch-amp's "
        "AdamW(fused=True); with --ranks, adam: FSDP2 shards into DTensors); a configuration "
        "that needs an optimizer option (bf16-pure+sr, bf16-pure+kahan) runs mpnb's fused "
        "optimizer of the same rule",
    )
    p.add_argument("--lr", type=_checked(float, check_lr), default=None)
    p.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: torch's; 1 is often faster on a busy CPU)",
    )
    p.add_argument("--isolate", action="store_true", help="each configuration in a subprocess")
    p.add_argument(
        "--out",
        default=None,
        help="HTML report path (default report.html; '' for none); with --ranks, a .csv or "
        ".json file for the rows (default none)",
    )
    p.add_argument(
        "--json",
        action="store_true",
        help="print only JSON on stdout (hardware, load, verdict, rows); messages go to stderr",
    )
    p.add_argument("--no-progress", action="store_true")
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.lab.distributed._cli import add_arguments

    add_arguments(p, standalone=False)  # --ranks, --strategy, --timeout
    p.set_defaults(func=run)
    return p


def _cell(value, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def _fixed_width(df, show) -> list[str]:
    """The rows of ``df`` in the ``(column, header, format)`` columns ``show``, right-aligned,
    under a header and a rule."""
    head = [h for _, h, _ in show]
    rows = [[_cell(r[c], f) for c, _, f in show] for _, r in df.iterrows()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=False)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    return [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]


def format_table(df) -> str:
    """The rows of ``df`` as a fixed-width text table, then errors (and the configurations this
    device cannot run), then one note per warning."""
    show = [
        (c, h, f) for c, h, f in _SHOW if c in df and (c not in _WHEN_SET or df[c].notna().any())
    ]
    out = _fixed_width(df, show)
    for _, r in df.iterrows():
        if r["error"]:
            kind = "NOT RUN" if r.get("status") == "unsupported" else "ERROR"
            out.append(f"{kind} {r['error']}")
    notes = {w for ws in df["warnings"] for w in split_warnings(ws)}
    out += [f"note: {w}" for w in sorted(notes)]
    return "\n".join(out)


#: the keep-list sweep's table: (column, header, format)
_SWEEP = (
    ("config", "config", "{}"),
    ("batch_size", "batch", "{}"),
    ("kept_last", "last N fp32", "{}"),
    ("kept_layers", "linear kept", "{}"),
    ("kept_share", "share kept", "{:.0%}"),
    ("final_loss", "loss", "{:.4f}"),
    ("loss_gap_vs_O0", "gap vs O0", "{:+.4f}"),
    ("loss_gap_rel", "gap %", "{:+.1%}"),
)


def format_sweep(sweep) -> str:
    """The keep-list sweep (:func:`mpnb.lab.sweep_kept`) as a fixed-width text table."""
    title = (
        f"keep-list sweep ({sweep.attrs.get('blocks', '?')} blocks): the last N blocks' linear "
        "layers kept in fp32"
    )
    return "\n".join([title, *_fixed_width(sweep, _SWEEP)])


def _json(df, sweep=None) -> str:
    doc = {
        "hardware": df.attrs["hardware"],
        "load": df.attrs["load"],
        "method": df.attrs["method"],
        "workload": df.attrs["workload"],
        "verdict": df.attrs["verdict"],
        "rows": json.loads(df.to_json(orient="records")),
    }
    if sweep is not None:
        doc["sweep"] = json.loads(sweep.to_json(orient="records"))
    return json.dumps(doc, indent=1)


def _with_graphs(args: argparse.Namespace, device: str):
    """The configurations asked for, with their CUDA-graph twins under ``--cuda-graphs``."""
    if not getattr(args, "cuda_graphs", False):
        return args.configs
    if not device.startswith("cuda"):
        raise ValueError(
            f"--cuda-graphs captures each step in a CUDA graph, which needs a CUDA GPU (the run "
            f"is on {device}); pass --device cuda, or drop --cuda-graphs."
        )
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.core.precision_configs import default_configs, with_cuda_graphs

    return with_cuda_graphs(args.configs or default_configs(device))


def run(args: argparse.Namespace) -> int:
    """Run ``mpnb compare`` with parsed ``args``; returns the exit code.

    With ``--json`` stdout carries exactly one JSON document; every message (progress,
    the emulation note, the report path) goes to stderr.
    """
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    import mpnb.lab
    from mpnb.lab.runner import emulation_note, resolve_device
    from mpnb.lab.workloads import get

    if getattr(args, "ranks", None) is not None:
        return _run_distributed(args)
    if getattr(args, "strategy", None):
        print("mpnb compare: --strategy needs --ranks N (N >= 2).", file=sys.stderr)
        return 2
    dtype = args.dtype[0] if len(args.dtype) == 1 else args.dtype
    msg = sys.stderr if args.json else sys.stdout
    if args.out is None:
        args.out = "report.html"
    why = unwritable_reason(args.out) if args.out else ""
    if why:
        print(
            f"mpnb compare: --out {args.out}: {why} (or --out '' for no report).", file=sys.stderr
        )
        return 2
    try:
        device = resolve_device(args.device)
        configs = _with_graphs(args, device)
        w = get(args.workload, args.size, device)
        sizes = ", ".join(map(str, args.batch_sizes or (w.batch_size,)))
        print(
            f"mpnb compare: {w.description} ({w.size}); batch {sizes}, "
            f"{args.steps or w.steps} steps",
            file=msg,
            flush=True,
        )
        keep_last = getattr(args, "keep_last", None)
        if keep_last is not None and not configs:
            configs = ("nvfp4",)
        note = emulation_note(w, dtype, args.device, configs)
        if note:
            print(note, file=msg, flush=True)
        kwargs = dict(
            half_dtype=dtype,
            batch_sizes=args.batch_sizes,
            steps=args.steps,
            optimizer=args.optimizer,
            lr=args.lr,
            device=args.device,
            progress=not args.no_progress,
            isolate=args.isolate,
            threads=args.threads,
            compile_budget=args.compile_budget,
        )
        sweep = None
        if keep_last is not None:
            sweep = mpnb.lab.sweep_kept(w, configs, keep_last, **kwargs)
            df = sweep.attrs["compare"]
        else:
            df = mpnb.lab.compare(w, configs=configs, **kwargs)
    except (ValueError, TypeError) as e:
        print(f"mpnb compare: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # before the first step: nothing measured, nothing to report
        print(f"mpnb compare: {_stopped(e)} before any step ran.", file=sys.stderr)
        return 143 if "SIGTERM" in _stopped(e) else 130
    if args.json:
        print(_json(df, sweep))
    else:
        hw = df.attrs["hardware"]
        print(
            f"{df.steps.iloc[0]} steps, {df.attrs['method']}\nhardware: {hw['summary']}\n"
            "speed vs O0: median over the steps of O0's step time / the configuration's, "
            "with its 95% interval\n",
            flush=True,
        )
        print(format_table(df))
        if sweep is not None:
            print("\n" + format_sweep(sweep))
        print("\n" + df.attrs["verdict"]["text"])
    code = 1 if df["status"].isin(("error", "unsupported")).all() else 0
    if args.out:
        try:
            path = mpnb.lab.report(df, args.out)
            print(f"\nreport: {path}", file=msg)
        except (OSError, ValueError) as e:  # ValueError: the path went bad during the run
            print(
                f"mpnb compare: the report was not written: {getattr(e, 'strerror', None) or e}",
                file=sys.stderr,
            )
            code = 1
    by = df.attrs.get("stopped_by")
    if by in ("Ctrl-C", "SIGTERM"):
        print(
            f"mpnb compare: {_stopped(by)}; the rows above keep the steps that finished.",
            file=sys.stderr,
        )
        return 130 if by == "Ctrl-C" else 143  # 128 + the signal's number, as a shell says
    return code


#: one-process flags the distributed comparison has no use for: (dest, flag, default)
_NOT_WITH_RANKS = (
    ("dtype", "--dtype", ("auto",)),
    ("isolate", "--isolate", False),
    ("cuda_graphs", "--cuda-graphs", False),
    ("compile_budget", "--compile-budget", None),
    ("keep_last", "--keep-last", None),
)


def _run_distributed(args: argparse.Namespace) -> int:
    """``mpnb compare --ranks N``: the distributed comparison's table, and its rows in ``--out``
    (.csv or .json); the flags it cannot use are refused before anything runs."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    import mpnb.lab
    from mpnb.lab.distributed._cli import check_out, show

    given = [
        flag for dest, flag, default in _NOT_WITH_RANKS if getattr(args, dest, default) != default
    ]
    if given:
        print(
            f"mpnb compare: {', '.join(given)} apply to the one-process comparison, not to "
            "--ranks (each distributed policy names its own dtypes: see --configs); drop "
            f"{'them' if len(given) > 1 else 'it'}, or drop --ranks.",
            file=sys.stderr,
        )
        return 2
    try:
        check_out(args.out)
        df = mpnb.lab.compare(
            args.workload,
            size=args.size,
            configs=args.configs,  # None: the strategy's policies
            batch_sizes=args.batch_sizes,
            steps=args.steps,
            optimizer=args.optimizer,
            lr=args.lr,
            device=args.device,
            threads=args.threads,
            ranks=args.ranks,
            strategy=args.strategy,
            timeout=args.timeout,
        )
    except (ValueError, TypeError) as e:
        print(f"mpnb compare: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # before the ranks started: nothing measured
        print(f"mpnb compare: {_stopped(e)} before any step ran.", file=sys.stderr)
        return 143 if "SIGTERM" in _stopped(e) else 130
    return show(df, args.json, args.out or "", prog="mpnb compare")


def _stopped(what) -> str:
    """``"interrupted (Ctrl-C)"`` or ``"terminated (SIGTERM)"`` for a label or an exception."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.lab._isolate import stop_label

    label = stop_label(what) if isinstance(what, BaseException) else what
    return "terminated (SIGTERM)" if label == "SIGTERM" else "interrupted (Ctrl-C)"
