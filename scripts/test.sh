#!/usr/bin/env bash
# Install into .venv (idempotent) and run the CPU test tiers: tests/unit and tests/e2e.
# GPU tests (tests/gpu) skip without CUDA; Slurm tests need scripts/slurm-local.sh first.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRAS=test bash scripts/setup-env.sh
. .venv/bin/activate
python -m pytest tests/unit tests/e2e tests/gpu -q -m "not slurm" -p no:cacheprovider "$@"
