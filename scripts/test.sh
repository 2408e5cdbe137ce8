#!/usr/bin/env bash
# The whole test suite: set up, build the kernels (a failed build fails here, loudly), lint,
# build the docs (warnings are errors), run pytest
# over tests/ (unit, multi-process, headless widget and browser tests), then every notebook in
# notebooks/ under nbval, then scripts/install-check.sh (the wheel and the sdist installed into
# fresh venvs outside the checkout). With arguments, only `pytest ARGS` runs.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/setup-browser.sh
. .venv/bin/activate
mpnb build-ext

# The format gate: lint and formatting of the whole tree (code, tests, notebooks).
echo "scripts/test.sh: ruff check + ruff format --check"
ruff check .
ruff format --check .

# The docs gate: the guides, and the reference pages generated from the code, built with every
# warning an error; the site goes to a temporary folder, so the checkout stays clean.
echo "scripts/test.sh: mkdocs build --strict"
docs_site=$(mktemp -d)
mkdocs build --strict -d "$docs_site"
rm -rf "$docs_site"

# The layers contract ([tool.importlinter] in pyproject.toml) and no import circle, through
# imports inside functions too (scripts/import_cycles.py; such an import carries its reason).
echo "scripts/test.sh: lint-imports + import cycles"
lint-imports --no-cache
python scripts/import_cycles.py

# pytest exit code 5 (nothing collected) is a failure, not a pass.
run_pytest() {
  set +e
  python -m pytest -q -p no:cacheprovider "$@"
  local rc=$?
  set -e
  if [ "$rc" -eq 5 ]; then
    echo "scripts/test.sh: pytest collected no tests from '$*'; that is a failure." >&2
    return 1
  fi
  return "$rc"
}

if [ "$#" -gt 0 ]; then
  run_pytest --durations=15 "$@"
  exit $?
fi
rc=0
run_pytest --durations=15 || rc=$?
echo "scripts/test.sh: notebooks (nbval)"
run_pytest --durations=10 --nbval-lax --nbval-current-env \
  --nbval-sanitize-with notebooks/sanitize.cfg notebooks/ || rc=$?

# The notebooks whose story depends on native vs emulated half precision, again with ATen and
# oneDNN limited to AVX2 (half precision emulated on any x86 CPU): each prints the other story,
# from doctor's facts and its own numbers, and asserts that the two agree. On a CPU without
# native bf16/fp16 this pass repeats the first.
EMULATED_HALF_NOTEBOOKS=(01_quick_start 02_number_formats 03_opt_levels 05_fused_kernels
  07_profiler 09_low_precision_frontier 12_four_bits)
echo "scripts/test.sh: notebooks (nbval) with half precision emulated" \
  "(ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2)"
(
  export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
  run_pytest --durations=10 --nbval-lax --nbval-current-env \
    --nbval-sanitize-with notebooks/sanitize.cfg \
    $(printf 'notebooks/%s.ipynb ' "${EMULATED_HALF_NOTEBOOKS[@]}")
) || rc=$?
echo "scripts/test.sh: a user's install (the wheel and the sdist, each in a fresh venv)"
bash scripts/install-check.sh || rc=$?
exit "$rc"
