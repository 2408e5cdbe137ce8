#!/usr/bin/env bash
# The whole kit on one CUDA GPU in at most 8 minutes, no network (scripts/gpu_check.py says
# what it runs): `bash scripts/gpu-check.sh [OUT]` on the GPU machine, where OUT receives the
# logs and a copy of the summary (the summary itself goes to docs/gpu/<date>-<card>.md).
# `bash scripts/gpu-check.sh --dry-run` on any machine lists the steps with their time budgets
# and checks that every command exists and parses.
# It uses the Python of the active venv, else .venv/bin/python, else python3 ($PYTHON wins).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=python
elif [ -x "$ROOT/.venv/bin/python" ]; then
  PY=$ROOT/.venv/bin/python
else
  PY=python3
fi
exec "$PY" "$ROOT/scripts/gpu_check.py" "$@"
