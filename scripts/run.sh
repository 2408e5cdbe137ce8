#!/usr/bin/env bash
# The main job: set up, build the kernels, then train the default workload (a small GPT on
# generated text; --workload cnn|mlp, --size small|medium|large) under O0/O1/O2/O3 and print
# what each does to speed, memory and accuracy on this machine, then the verdict
# (+ out/report.html).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mpnb build-ext
# One thread: on a small shared CPU, OpenMP threads that wait for each other cost more than
# they win for these small models. Pass --threads N (or any `mpnb compare` flag) to change it.
# The report's folder is made here: mpnb compare refuses a path whose folder does not exist.
mkdir -p out
mpnb compare --threads 1 --out out/report.html "$@"
