"""The assertions of scripts/install-check.sh, run by the fresh venv's python from a directory
outside the checkout (fed on stdin, so that no checkout directory is put on ``sys.path``).

Usage: python - WORK ARTIFACT CHECKOUT < scripts/install_check.py
"""

import json
import sys
from pathlib import Path

import mpnb

work, artifact, checkout = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]).resolve()
venv, cache = work / "venv", work / "cache" / "mpnb"


def check(ok: bool, what: str) -> None:
    if not ok:
        sys.exit(f"install-check: {artifact}: {what}")


where = Path(mpnb.__file__).resolve()
check(venv in where.parents, f"mpnb was imported from {where}, not from the fresh venv")
inside = [p for p in sys.path if p and checkout in (Path(p).resolve(), *Path(p).resolve().parents)]
check(not inside, f"the checkout is on sys.path: {inside}")

doctor = (work / "doctor.txt").read_text()
lines = {ln.split(":", 1)[0].strip(): ln for ln in doctor.splitlines() if ":" in ln}
src = lines.get("C++ sources", "")
check(
    f"{venv}/lib/" in src and src.rstrip().endswith("site-packages/mpnb/_csrc"),
    f"doctor does not build from the installed sources: {src!r}",
)
loaded = lines.get("CPU kernels", "")
check(f"loaded from {cache}/" in loaded, f"the kernels did not load from the cache: {loaded!r}")
check("FELL BACK" not in doctor, "ops fell back:\n" + doctor)
check("bf16 on CPU: " in doctor, "doctor printed no bf16 status")

report = json.loads((work / "compare.json").read_text())
for row in report["rows"]:
    check(not row["error"], f"{row['configuration']} failed: {row['error']}")
    check("C++ kernels:" not in (row["warnings"] or ""), f"fell back: {row['warnings']}")
library = loaded.split("loaded from ")[1].split()[0]
rows = ", ".join(f"{r['configuration']} {r['precision']}" for r in report["rows"])
print(f"install-check: {artifact}: mpnb {mpnb.__version__} from {where.parent}")
print(f"install-check: {artifact}: kernels {library}; compare rows: {rows}")
