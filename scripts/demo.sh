#!/usr/bin/env bash
# Install torchrpc with the examples' dependencies into .venv and run the showcase:
# a parameter server and two trainers training on scikit-learn's digits over RPC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[examples]" 2>&1 | grep -v "^WARNING: Location" || true
exec .venv/bin/python -m torchrpc.examples.parameter_server "$@"
