"""Host reads and CUDA synchronizations per steady-state training step, amp beside torch.amp.

Each of :data:`STEPS` trains a small MLP (the same seed, data and learning rate) the way a user
writes it: mpnb's amp O1/O2 with ``FusedAdam``, amp O2 with ``torch.optim.AdamW(fused=True)``,
amp O2 with the Python-loop ``AdamW`` (one read per step is expected there, as in torch.amp),
and torch.amp (``autocast`` + ``GradScaler`` + ``AdamW(fused=True)``). Steps
:data:`WARMUP` .. are counted two ways:

* ``host_reads``: :class:`~mpnb.lab.host_reads.HostReads` (on any device; the count a CPU run
  reports in the lab's ``host_syncs_per_step`` column);
* ``cuda_syncs``: on CUDA, the synchronizations PyTorch itself reports under
  ``torch.cuda.set_sync_debug_mode("warn")`` (the ground truth the first count stands for).

Run it as ``python -m mpnb.lab.sync_count [--device cuda] [--steps N] [--json]``; the GPU check
does, on the GPU.

Example::

    >>> rows = count_syncs("cpu")
    >>> rows[0]["name"], rows[0]["host_reads"]
    ('mpnb O1 fp16 + FusedAdam', 0.0)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import warnings
from collections.abc import Callable, Iterator

import torch

from mpnb import amp
from mpnb.lab.host_reads import HostReads

__all__ = ["STEPS", "WARMUP", "count_syncs", "cuda_sync_warnings", "main", "parser"]

WARMUP = 5  #: steps before the counted ones (lazy state, the first masters' check)


@contextlib.contextmanager
def cuda_sync_warnings(device: torch.device) -> Iterator[list]:
    """Collect the warnings of ``torch.cuda.set_sync_debug_mode("warn")`` raised inside the
    block (one per synchronizing CUDA call); an empty list on a CPU. The mode is put back on
    exit, also when the block raises."""
    caught: list = []
    if device.type != "cuda":
        yield caught
        return
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield caught
        finally:
            torch.cuda.set_sync_debug_mode(before)
            caught += [w for w in got if "synchroniz" in str(w.message)]


def _model(device):
    torch.manual_seed(0)
    layers = [torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256)]
    return torch.nn.Sequential(*layers, torch.nn.LayerNorm(256)).to(device)


def _amp_step(level: str, half: torch.dtype, make_opt: Callable, device) -> Callable[[], None]:
    model = _model(device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, opt = amp.initialize(
            model, make_opt(model.parameters()), opt_level=level, half_dtype=half,
            loss_scale="dynamic", verbosity=0,
        )  # fmt: skip
    x = torch.randn(64, 256, device=device)
    x = x if level == "O1" else x.to(half)

    def step():
        opt.zero_grad(set_to_none=True)
        with amp.scale_loss(model(x).float().pow(2).mean(), opt) as scaled:
            scaled.backward()
        opt.step()

    step.release = lambda: amp.current_handle().remove_hooks()
    return step


def _torch_amp_step(half: torch.dtype, device) -> Callable[[], None]:
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scaler = torch.amp.GradScaler(torch.device(device).type, enabled=half == torch.float16)
    x = torch.randn(64, 256, device=device)

    def step():
        opt.zero_grad(set_to_none=True)
        with torch.autocast(torch.device(device).type, dtype=half):
            loss = model(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    step.release = lambda: None
    return step


def _fused_adam(params):
    # the optimizers when the fused step is counted: +105 ms to importing this
    from mpnb.optimizers import FusedAdam

    return FusedAdam(params, lr=1e-3, weight_decay=0.01)


def _adamw(fused: bool):
    return lambda params: torch.optim.AdamW(params, lr=1e-3, fused=fused)


#: ``name -> (half dtype, builder(device) -> step)`` of every counted way to train
STEPS: dict[str, tuple] = {}
for _h, _n in ((torch.float16, "fp16"), (torch.bfloat16, "bf16")):
    STEPS[f"mpnb O1 {_n} + FusedAdam"] = (_h, lambda d, h=_h: _amp_step("O1", h, _fused_adam, d))
    STEPS[f"mpnb O2 {_n} + FusedAdam"] = (_h, lambda d, h=_h: _amp_step("O2", h, _fused_adam, d))
    STEPS[f"mpnb O2 {_n} + AdamW(fused=True)"] = (
        _h,
        lambda d, h=_h: _amp_step("O2", h, _adamw(True), d),
    )
    STEPS[f"mpnb O2 {_n} + AdamW (Python loop)"] = (
        _h,
        lambda d, h=_h: _amp_step("O2", h, _adamw(False), d),
    )
    STEPS[f"torch.amp {_n} + AdamW(fused=True)"] = (_h, lambda d, h=_h: _torch_amp_step(h, d))


def count_syncs(device="cpu", steps: int = 6, names=None) -> list[dict]:
    """One row per way to train of :data:`STEPS` (or ``names``): host reads and CUDA syncs per
    counted step (the mean over ``steps`` steps after :data:`WARMUP`), or an ``error``.

    Args:
        device: ``"cpu"`` or ``"cuda[:i]"``.
        steps: how many steady-state steps to count.
        names: a subset of :data:`STEPS` (default: all).
    """
    dev = torch.device(device)
    rows = []
    for name in names or STEPS:
        half, build = STEPS[name]
        row = dict(name=name, device=str(dev), host_reads=float("nan"), cuda_syncs=float("nan"))
        try:
            step = build(dev)
            try:
                for _ in range(WARMUP):
                    step()
                if dev.type == "cuda":
                    torch.cuda.synchronize(dev)
                with HostReads() as reads, cuda_sync_warnings(dev) as syncs:
                    for _ in range(steps):
                        step()
                row["host_reads"] = reads.count / steps
                row["cuda_syncs"] = len(syncs) / steps if dev.type == "cuda" else float("nan")
                row["where"] = sorted(set(reads.where))[:3]
            finally:
                step.release()
        except Exception as e:  # noqa: BLE001 - one way that fails is one row that says why
            row["error"] = f"{type(e).__name__}: {e}"
        rows.append(row)
    return rows


def parser() -> argparse.ArgumentParser:
    """The command line of ``python -m mpnb.lab.sync_count``."""
    p = argparse.ArgumentParser(prog="python -m mpnb.lab.sync_count", description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--steps", type=int, default=6, help="steady-state steps counted (default 6)")
    p.add_argument("--json", action="store_true", help="print the rows as one JSON document")
    return p


def main(argv: list[str] | None = None) -> int:
    """``python -m mpnb.lab.sync_count [--device D] [--steps N] [--json]``."""
    p = parser()
    args = p.parse_args(argv)
    if args.steps < 1:
        p.error(f"--steps {args.steps}: count at least one step.")
    rows = count_syncs(args.device, args.steps)
    if args.json:
        json.dump(dict(rows=rows), sys.stdout, indent=1)
        print()
    else:
        print(f"{'way to train':<40} {'host reads/step':>16} {'CUDA syncs/step':>16}")
        for r in rows:
            extra = f"  ERROR {r['error']}" if "error" in r else ""
            print(f"{r['name']:<40} {r['host_reads']:>16.2f} {r['cuda_syncs']:>16.2f}{extra}")
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
