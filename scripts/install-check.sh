#!/usr/bin/env bash
# A user's install, checked: build the sdist from this checkout and the wheel from that sdist
# (as `python -m build` does), install each, non-editable, into a fresh venv in a directory
# outside the checkout (torch==2.13.0 first: pip takes the CPU wheel on disk), and from there
# run `mpnb --version`, `mpnb doctor` (the C++ kernels must build from the installed sources
# into the per-user cache and load; no op may fall back) and a short `mpnb compare`.
#
# Both venvs live at the same path, one after the other: the kernel cache is keyed by torch's
# include path, so the wheel's run compiles the kernels and the sdist's run loads that build
# (after checking that its installed sources hash the same). Prints the time of each part.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD_PY=${BUILD_PY:-$ROOT/.venv/bin/python}  # has setuptools>=77 (scripts/setup.sh)
BASE_PY=${PYTHON:-python3}
WORK=$(mktemp -d "${TMPDIR:-/tmp}/mpnb-install-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
T0=$SECONDS
say() { echo "install-check [$((SECONDS - T0)) s]: $*"; }
# --no-compile: no .pyc for all of torch up front (Python compiles what it imports)
pip_install() {
  "$WORK/venv/bin/python" -m pip install -q --no-compile --disable-pip-version-check "$@" \
    >"$WORK/pip.log" 2>&1 ||
    { grep -v "is ignored" "$WORK/pip.log"; echo "install-check: pip install $* failed" >&2; exit 1; }
}

# -- build: the sdist from the checkout, the wheel from the unpacked sdist ---------------------
mkdir -p "$WORK/dist" "$WORK/src"
(cd "$ROOT" && "$BUILD_PY" -c "import sys; from setuptools import build_meta as b; \
print(b.build_sdist(sys.argv[1]))" "$WORK/dist" >/dev/null)
SDIST=$(ls "$WORK"/dist/mpnb-*.tar.gz)
tar -xzf "$SDIST" -C "$WORK/src"
(cd "$WORK"/src/mpnb-* && "$BUILD_PY" -c "import sys; from setuptools import build_meta as b; \
print(b.build_wheel(sys.argv[1]))" "$WORK/dist" >/dev/null)
WHEEL=$(ls "$WORK"/dist/mpnb-*.whl)
say "built $(basename "$SDIST") and, from it, $(basename "$WHEEL")"

# -- install each into a fresh venv, run from a directory that holds no checkout --------------
mkdir -p "$WORK/run"
export XDG_CACHE_HOME="$WORK/cache" OMP_NUM_THREADS=1
unset PYTHONPATH MPNB_CACHE_DIR MPNB_DISABLE_EXT
for artifact in "$WHEEL" "$SDIST"; do
  name=$(basename "$artifact")
  rm -rf "$WORK/venv"
  "$BASE_PY" -m venv "$WORK/venv"
  pip_install "torch==2.13.0"
  pip_install "$artifact"
  say "$name installed into a fresh venv"
  (
    cd "$WORK/run"
    PATH="$WORK/venv/bin:$PATH"
    mpnb --version
    mpnb doctor >"$WORK/doctor.txt" 2>&1 || { cat "$WORK/doctor.txt"; exit 1; }
    say "$name: mpnb doctor ran"
    mpnb compare --workload mlp --opt-levels O0,O1 --steps 2 --threads 1 --no-progress \
      --out "" --json >"$WORK/compare.json" 2>"$WORK/compare.err" ||
      { cat "$WORK/compare.err"; exit 1; }
    say "$name: mpnb compare ran"
    python - "$WORK" "$name" "$ROOT" <"$ROOT/scripts/install_check.py"
  )
done
say "passed (the wheel and the sdist install, build and load their kernels outside the checkout)"
