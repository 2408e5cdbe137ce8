#!/usr/bin/env bash
# The main job: set up, then say what this machine supports and benchmark the kernels.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mpnb build-ext
mpnb doctor
mpnb bench multi-tensor --quick "$@"
