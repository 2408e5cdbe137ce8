#!/usr/bin/env bash
# The whole test suite: set up, build the kernels (a failed build fails here, loudly), run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
mpnb build-ext
set +e
python -m pytest -q -p no:cacheprovider --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "scripts/test.sh: pytest collected no tests; that is a failure, not a pass." >&2
  exit 1
fi
exit "$rc"
