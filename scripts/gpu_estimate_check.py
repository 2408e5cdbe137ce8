"""How close :mod:`mpnb.lab.gpu_estimate` comes to the speeds the H100 runs in ``docs/gpu``
measured: ``python scripts/gpu_estimate_check.py [CPU_JSON ...]``.

The FLOPs and the memory breakdown of the lab's GPT (medium, batch 32) come from CPU compares
(``mpnb compare --workload transformer --size medium --configs ... --steps 2 --device cpu
--json``; given as files, or run here, about two minutes on two cores): the model's FLOPs and
tensors are the same on either device, and ``docs/gpu`` gives no FLOPs. Two cases:

* ``cpu ops``: the rows as a CPU run gives them (what the GPU check estimates from), with the
  host syncs that ``docs/gpu`` reports: none for O0, one per step for O1-O3, unknown for FP8;
* ``cuda ops``: the same with the ops per step counted on the H100 (a466a83 run: O0 719, O1
  852, O2 777, O3 721). No CUDA count of the FP8 rows was written down: they keep their CPU
  count less the 368 ops by which the CPU's O0 exceeds CUDA's (torch.optim.Adam's
  per-parameter loop on the CPU), an inference.

It prints, per row, the estimated speed vs O0, the measured one (the three runs' range) and
estimate / measured at its worst; nothing here is a test, timings are never asserted.
"""

from __future__ import annotations

import json
import sys

import pandas as pd

from mpnb.lab.gpu_estimate import estimate_for_card

CARD = "NVIDIA H100 80GB HBM3"
#: speed vs O0 measured on the H100 (docs/gpu: a466a83, d32cc52, 35f3024 runs)
MEASURED = {
    "O1 fp16 b32": (0.64, 0.64, 0.63),
    "O1 bf16 b32": (0.65, 0.68, 0.66),
    "O2 fp16 b32": (0.60, 0.62, 0.61),
    "O2 bf16 b32": (0.60, 0.67, 0.64),
    "O3 bf16 b32": (0.60, 0.66, 0.63),
    "fp8-tensorwise b32": (0.41, 0.47, 0.44),
    "fp8-delayed b32": (0.27, 0.28, 0.26),
    "fp8-rowwise b32": (0.27, 0.26, 0.24),
    "mxfp8 b32": (0.20, 0.21, 0.19),
}
#: ops per step counted on the H100 (docs/gpu, a466a83 note); syncs per step as it reports them
CUDA_OPS = {"O0": 719.0, "O1": 852.0, "O2": 777.0, "O3": 721.0}
SYNCS = {"O0": 0.0, "O1": 1.0, "O2": 1.0, "O3": 1.0}
CONFIG_SETS = ("O0,O1,O2,O3", "O0,fp8-tensorwise,fp8-delayed,fp8-rowwise,mxfp8")


def _cpu_rows(paths: list[str]) -> pd.DataFrame:
    if paths:
        frames = [pd.DataFrame(json.load(open(p))["rows"]) for p in paths]
    else:  # run here: the lab's import stays inside, the files need none
        from mpnb.lab import compare

        kw = dict(workload="transformer", size="medium", steps=2, device="cpu", progress=False)
        frames = [compare(configs=c.split(","), half_dtype="bf16", **kw) for c in CONFIG_SETS]
    df = pd.concat(frames).drop_duplicates("configuration").reset_index(drop=True)
    df["host_syncs_per_step"] = df["opt_level"].map(SYNCS)  # FP8: NaN, unknown
    return df


def _cuda_ops(df: pd.DataFrame) -> pd.DataFrame:
    out = df.copy()
    cpu_extra = float(df.loc[df["opt_level"] == "O0", "ops_per_step"].iloc[0]) - CUDA_OPS["O0"]
    known = out["opt_level"].map(CUDA_OPS)
    out["ops_per_step"] = known.fillna(out["ops_per_step"] - cpu_extra)
    return out


def _table(est: pd.DataFrame, case: str) -> list[str]:
    by = est.set_index("configuration")
    lines = []
    for name, runs in MEASURED.items():
        twin = name.replace("fp16", "bf16")  # the CPU runs bf16; fp16 has the same peak here
        e = by.loc[twin]
        ratios = [e["est_speedup_vs_O0"] / m for m in runs]
        within = all(max(r, 1 / r) <= 1.5 for r in ratios)
        lines.append(
            f"| {case} | {name} | {e['est_host_ms']:.1f} | {e['est_gpu_ms']:.1f} | "
            f"{e['host_syncs_per_step']:g} | {e['est_step_ms']:.1f} | "
            f"{e['est_speedup_vs_O0']:.2f} | {min(runs):.2f}-{max(runs):.2f} | "
            f"{min(ratios):.2f}-{max(ratios):.2f}{'' if within else ' (beyond 1.5x)'} | "
            f"{e['bound']} |"
        )
    return lines


def main(argv: list[str]) -> None:
    cpu = _cpu_rows(argv)
    print(
        "| ops | configuration | host ms | GPU ms | syncs | est step ms | est speed | "
        "measured | est / measured | bound |\n|" + "---|" * 10
    )
    for case, df in (("cpu ops", cpu), ("cuda ops", _cuda_ops(cpu))):
        est = estimate_for_card(df, CARD)
        o0 = est[est["configuration"] == "O0 fp32 b32"].iloc[0]
        print(
            f"| {case} | O0 fp32 b32 | {o0['est_host_ms']:.1f} | {o0['est_gpu_ms']:.1f} | 0 | "
            f"{o0['est_step_ms']:.1f} | 1.00 | 1.00 | 1.00 | {o0['bound']} |"
        )
        print("\n".join(_table(est, case)))


if __name__ == "__main__":
    main(sys.argv[1:])
