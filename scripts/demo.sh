#!/usr/bin/env bash
# Install torchrpc with the examples' dependencies into .venv and run the showcase:
# a parameter server and two trainers training on scikit-learn's digits over RPC.
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
install_torch "torch==2.13.0"
pip_install -e ".[examples]"
exec .venv/bin/python -m torchrpc.examples.parameter_server "$@"
