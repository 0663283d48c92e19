#!/usr/bin/env bash
# Install everything the tests need into .venv (torch pinned to 2.13.0, the CPU build
# on this machine) and run the test suite. The README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install -q "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -m pip install -q -e ".[test]" 2>&1 | grep -v "^WARNING: Location" || true
.venv/bin/python -c "import torch, torchrpc, sklearn; print('torch', torch.__version__)"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
