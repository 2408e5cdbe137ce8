#!/usr/bin/env bash
# Create .venv (if needed) and install mpnb with its test extras. Safe to run again.
# A fresh machine has only Python, gcc and the torch wheel: torch==2.13.0 is installed first,
# so that mpnb's looser `torch>=2.4` never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
python -m pip install -q --upgrade pip setuptools wheel 2>&1 | grep -v "is ignored" || true
if ! python -c "import torch" 2>/dev/null; then
  python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "is ignored" || true
fi
python -W ignore -c "import torch; print('torch', torch.__version__)" 2>/dev/null
# Newer setuptools prints an information-only notice for every editable install (about folders
# named like the package shadowing it); it is not about mpnb, so it is dropped here. Anything
# else pip or setuptools prints still shows.
python -m pip install -q -e ".[${MPNB_EXTRAS:-dev}]" 2>&1 | grep -v "is ignored" |
  awk '/BuildBackendWarning: Editable installation/ {skip = 1} !skip {print} /with strategy, WheelFile/ {skip = 0}' || true
python -c "import mpnb, ninja; print('mpnb', mpnb.__version__, 'installed')"
# The docs' builder comes with the dev extra (mpnb[docs]); the test script builds the docs.
if [[ ",${MPNB_EXTRAS:-dev}," == *,dev,* ]]; then
  python -c "import mkdocs, mkdocstrings_handlers.python; print('mkdocs', mkdocs.__version__, 'installed')"
fi
