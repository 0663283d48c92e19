#!/usr/bin/env bash
# Install everything the tests need into .venv (torch pinned to 2.13.0; see _venv.sh for
# the variables that choose its build) and run the test suite. The README's test command.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
install_torch "torch==2.13.0"
pip_install -e ".[test]"
.venv/bin/python -c "import torch, torchrpc, sklearn; print('torch', torch.__version__)"
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
