"""The distributed comparison's command line: ``mpnb compare --ranks N`` and
``python -m mpnb.lab.distributed`` (the same flags; under torchrun too)."""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

__all__ = ["add_arguments", "run", "format_table", "torchrun_rows"]

_SHOW = (
    ("policy", "policy", "{}"),
    ("status", "status", "{}"),
    ("param_dtype", "params", "{}"),
    ("reduce_dtype", "reduce", "{}"),
    ("loss_final", "loss", "{:.4f}"),
    ("loss_vs_fp32", "|dloss| vs fp32", "{:.2e}"),
    ("tolerance", "tol", "{:.0e}"),
    ("step_ms", "ms/step", "{:.1f}"),
    ("step_ms_lo", "lo", "{:.1f}"),
    ("step_ms_hi", "hi", "{:.1f}"),
    ("comm_s", "comm ms", "{:.1f}"),
    ("bytes_sent_per_step", "sent B/step", "{:,.0f}"),
    ("mem_sharded_params_mib", "params MiB", "{:.2f}"),
    ("mem_unsharded_params_mib", "gathered MiB", "{:.2f}"),
    ("mem_grads_mib", "grads MiB", "{:.2f}"),
    ("mem_optimizer_mib", "optim MiB", "{:.2f}"),
    ("mem_activations_mib", "acts MiB", "{:.2f}"),
    ("mem_peak_mib", "peak MiB", "{:.2f}"),
)


def _cell(v, fmt: str, col: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if col == "comm_s":
        v = v * 1e3
    return fmt.format(v)


def format_table(df) -> str:
    """The rows as a fixed-width text table, then bytes by op, then the errors."""
    head = [h for _, h, _ in _SHOW]
    rows = [[_cell(r[c], f, c) for c, _, f in _SHOW] for _, r in df.iterrows()]
    widths = [max(len(x) for x in col) for col in zip(head, *rows, strict=False)]
    line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths, strict=True))
    out = [line(head), line(["-" * w for w in widths])] + [line(r) for r in rows]
    for _, r in df.iterrows():
        if isinstance(r["bytes_by_op"], dict) and r["bytes_by_op"]:
            ops = ", ".join(f"{k} {v:,}" for k, v in r["bytes_by_op"].items())
            out.append(f"bytes/step by op, {r['policy']}: {ops}")
    for _, r in df.iterrows():
        if r["error"]:
            out.append(f"{r['status'].upper()} {r['policy']}: {r['error']}")
    return "\n".join(out)


def add_arguments(p: argparse.ArgumentParser, standalone: bool) -> None:
    """The distributed flags (``standalone``: also the workload flags ``mpnb compare`` has)."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.core.precision_configs import DISTRIBUTED_CONFIGS, STRATEGIES

    if standalone:
        # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
        from mpnb.lab.workloads import names

        p.add_argument("--workload", default=names()[0], choices=names())
        p.add_argument(
            "--size", default="auto", choices=("auto", "small", "medium", "large", "gpu")
        )
        p.add_argument("--steps", type=int, default=None, help="default: the workload's")
        p.add_argument("--batch-size", type=int, default=None, help="the global batch")
        p.add_argument("--optimizer", default="adam")
        p.add_argument("--lr", type=float, default=None)
        p.add_argument(
            "--configs",
            type=lambda s: tuple(x for x in s.split(",") if x),
            default=None,
            help=f"comma-separated policies, any of {','.join(DISTRIBUTED_CONFIGS)}",
        )
        p.add_argument("--json", action="store_true", help="print only JSON rows on stdout")
        p.add_argument("--out", default="", help="write the rows to this .csv or .json file")
        p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--ranks",
        type=_rank_count,
        default=None,
        help="N >= 2: the distributed comparison on N local ranks (ignored under torchrun, "
        "which sets the world)",
    )
    p.add_argument(
        "--strategy",
        default=None,
        choices=(*STRATEGIES, "both"),
        help="with --ranks: the policies of this strategy (default both)",
    )
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=600.0,
        help="with --ranks: seconds for the whole distributed run (a hung rank ends it, and "
        "the report of where it hung fits in them)",
    )


def _rank_count(text: str) -> int:
    """argparse type of ``--ranks``: an integer N >= 2."""
    try:
        n = int(text)
    except ValueError:
        n = None
    if n is None or n < 2:
        raise argparse.ArgumentTypeError(
            f"--ranks {text}: give N >= 2 ranks for the distributed comparison, or leave "
            "--ranks out for the one-process comparison."
        )
    return n


def _seconds(text: str) -> float:
    """argparse type of ``--timeout``: a positive, finite number of seconds."""
    try:
        v = float(text)
    except ValueError:
        v = math.nan
    if not (math.isfinite(v) and v > 0):
        raise argparse.ArgumentTypeError(
            f"--timeout {text}: give the seconds the whole distributed run may take, a "
            "positive number such as --timeout 600."
        )
    return v


def check_out(path: str | None) -> None:
    """Refuse, before the run, an ``--out`` the rows cannot be written to: not .csv or .json
    (the HTML report draws one-process comparisons), or a path that cannot be written."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.lab._files import check_writable

    if not path:
        return
    check_writable(path, "--out", "rows.csv")
    if not path.endswith((".csv", ".json")):
        raise ValueError(
            f"--out {path}: the distributed comparison writes its rows as .csv or .json (the "
            "HTML report draws one-process comparisons); pass e.g. --out rows.csv."
        )


def _json(df) -> str:
    attrs = {k: v for k, v in df.attrs.items() if k in ("distributed", "workload")}
    rows = json.loads(df.to_json(orient="records"))
    return json.dumps({**attrs, "rows": rows}, indent=1, default=str)


def _write(df, path: str) -> None:
    """The rows to ``path`` (.json or .csv), whole or not at all (the previous file stays)."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.lab._files import write_atomic

    write_atomic(path, _json(df) if path.endswith(".json") else df.to_csv(index=False))


def torchrun_rows(args):
    """Under torchrun: every rank trains; rank 0 returns the rows, the others None."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    import torch

    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.core.parallel import launch
    from mpnb.lab import workloads
    from mpnb.lab.distributed._compare import launched, reference_run, resolve_policies, rows_of
    from mpnb.lab.machine import hardware_summary

    world = int(os.environ["WORLD_SIZE"])
    device = "cuda" if torch.cuda.is_available() else "cpu"
    w = workloads.get(args.workload, args.size, device)
    batch = args.batch_size or w.batch_size
    if batch % world:
        raise ValueError(
            f"the global batch {batch} does not split into {world} ranks; pass --batch-size "
            f"{batch - batch % world or world}."
        )
    policies, skipped = resolve_policies(args.configs, args.strategy, device)
    job = dict(
        steps=args.steps or w.steps,
        global_batch=batch,
        optimizer=args.optimizer,
        lr=args.lr,
        device=device,
        seed=args.seed,
        threads=None,
    )
    records = launch(
        launched, world, args=((w.name, w.size), policies, job, None), timeout=args.timeout
    )[0]
    if int(os.environ["RANK"]) != 0:
        return None
    ref = reference_run(w, job)
    df = rows_of(
        records, policies, skipped, None, ref, job, w, world, hardware_summary(device)["summary"]
    )
    df.attrs["distributed"] = dict(
        ranks=world,
        strategy=args.strategy or "both",
        global_batch=batch,
        reference=ref["losses"],
        reference_metric=ref["metric"],
        steps=job["steps"],
        launcher="torchrun",
        nodes=world // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world))),
    )
    df.attrs["workload"] = dict(name=w.name, size=w.size, description=w.description)
    return df


def show(df, as_json: bool, out: str = "", prog: str = "mpnb.lab.distributed") -> int:
    """Print the rows (a table, or JSON), write them to ``out``; the exit code (130 or 143
    when Ctrl-C or SIGTERM ended the run: the rows keep the steps that finished)."""
    if as_json:
        print(_json(df))
    else:
        d = df.attrs["distributed"]
        print(
            f"{d['ranks']} ranks, global batch {d['global_batch']}, {d['steps']} steps; "
            "per rank: memory max over ranks, bytes mean over ranks (ring, counted at the "
            "collectives), step time max over ranks (median and 95% interval)\n",
            flush=True,
        )
        print(format_table(df))
    code = 1 if (df["status"] != "ok").all() else 0
    if out:
        try:
            _write(df, out)
        except OSError as e:
            print(f"{prog}: --out: {e.strerror or e}", file=sys.stderr)
            code = 1
    by = df.attrs.get("stopped_by", "")
    if by:
        what = "terminated (SIGTERM)" if by == "SIGTERM" else "interrupted (Ctrl-C)"
        print(f"{prog}: {what}; the rows above keep the steps that finished.", file=sys.stderr)
        return 143 if by == "SIGTERM" else 130  # 128 + the signal's number, as a shell says
    return code


def run(args) -> int:
    """``python -m mpnb.lab.distributed``: under torchrun, or launching ``--ranks`` itself."""
    # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
    from mpnb.core.parallel import under_torchrun

    try:
        check_out(args.out)
        if under_torchrun():
            df = torchrun_rows(args)
            return 0 if df is None else show(df, args.json, args.out)
        # on use: the CLI's parser is built without torch or pandas (`mpnb --help`)
        import mpnb.lab

        df = mpnb.lab.compare(
            args.workload,
            size=args.size,
            steps=args.steps,
            batch_sizes=(args.batch_size,) if args.batch_size else None,
            optimizer=args.optimizer,
            lr=args.lr,
            configs=args.configs,
            ranks=args.ranks or 2,
            strategy=args.strategy,
            timeout=args.timeout,
            seed=args.seed,
        )
    except (ValueError, TypeError) as e:
        print(f"mpnb.lab.distributed: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # before the ranks started: nothing measured
        from mpnb.lab._isolate import stop_label

        by = stop_label(e)
        print(f"mpnb.lab.distributed: stopped ({by}) before any step ran.", file=sys.stderr)
        return 143 if by == "SIGTERM" else 130
    return show(df, args.json, args.out)
