#!/usr/bin/env bash
# Install into .venv (idempotent) and run the tests:
#   1. tests/unit, tests/e2e (CPU) and tests/gpu (skips without CUDA), with any arguments given,
#      but the tests marked slow; BATCHRUN_SLOW_TESTS=1 (CI) runs those after them;
#   2. tests/slurm, when a local Slurm is up (bash scripts/slurm-local.sh start), else skipped.
#      BATCHRUN_SLURM_TESTS=0 skips it; BATCHRUN_REQUIRE_SLURM=1 (CI) fails without a cluster.
set -euo pipefail
usage() {
  cat <<'EOF_USAGE'
usage: bash scripts/test.sh [PYTEST ARGS...]

Installs batchrun and its test dependencies into .venv (idempotent), then runs:
  1. tests/unit, tests/e2e and tests/gpu (skipped without CUDA), not the slow tests, with the
     PYTEST ARGS given (e.g. -x, -k NAME, -n 4 with pytest-xdist);
  2. the slow tests too with BATCHRUN_SLOW_TESTS=1 (CI sets it);
  3. tests/slurm when a local Slurm is up (bash scripts/slurm-local.sh start);
     BATCHRUN_SLURM_TESTS=0 skips it, BATCHRUN_REQUIRE_SLURM=1 fails without one.

pytest's own options: .venv/bin/python -P -m pytest --help
EOF_USAGE
}
for arg in "$@"; do
  case "$arg" in
    -h | --help) usage; exit 0 ;;
  esac
done
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup-env.sh
. .venv/bin/activate
# NOTE: `python -m pytest` would put the checkout on sys.path, and its kernels/ folder (installed
# as batchrun.kernels) would shadow the `kernels` distribution that transformers >= 5.25 imports:
# -P (Python 3.11+) keeps it off, for pytest's process only (the scripts that tests run import
# their neighbours from their own folder; Python children that import batchrun first are covered
# by batchrun/_checkout_path.py)
safe=$(python -c 'import sys; print("-P" if sys.version_info >= (3, 11) else "")')
start=$SECONDS
python $safe -m pytest tests/unit tests/e2e tests/gpu -q -m "not slurm and not slow" -p no:cacheprovider "$@"
echo "test.sh: unit + e2e + gpu tiers passed in $((SECONDS - start)) s"
if [ "${BATCHRUN_SLOW_TESTS:-0}" = 1 ]; then
  start=$SECONDS
  python $safe -m pytest tests/unit tests/e2e tests/gpu -q -m "slow and not slurm" -p no:cacheprovider "$@"
  echo "test.sh: slow tier passed in $((SECONDS - start)) s"
else
  echo "test.sh: slow tier skipped (BATCHRUN_SLOW_TESTS=1 runs it; CI does)"
fi

slurm_up() { command -v sinfo >/dev/null && sinfo -h -N -o %T 2>/dev/null | grep -Eq '^(idle|mixed|allocated)'; }
if [ "${BATCHRUN_SLURM_TESTS:-1}" = 0 ]; then
  echo "test.sh: slurm tier skipped (BATCHRUN_SLURM_TESTS=0)"
elif slurm_up || [ "${BATCHRUN_REQUIRE_SLURM:-0}" = 1 ]; then
  start=$SECONDS
  python $safe -m pytest tests/slurm -q -m slurm -p no:cacheprovider
  echo "test.sh: slurm tier passed in $((SECONDS - start)) s"
else
  echo "test.sh: slurm tier skipped (no local Slurm; bash scripts/slurm-local.sh start)"
fi
