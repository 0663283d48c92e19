#!/usr/bin/env bash
# Run PyTorch's own RPC test suites (from the installed torch wheel) against torchrpc.
#   bash scripts/conformance.sh --sample     the fixed sample CI runs (tests/conformance/sample.txt)
#   bash scripts/conformance.sh --full       every generic suite (about 40 minutes on 2 cores)
#   bash scripts/conformance.sh --all        also the TensorPipe-specific and faulty-agent suites
#   bash scripts/conformance.sh -k EXPR      tests whose Suite.test_name contains EXPR
# Further flags go to python -m tests.conformance.run (see its --help).
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/_venv.sh
install_torch "torch==2.13.0"
pip_install -e ".[test]"
.venv/bin/python -c "import torch, torchrpc, expecttest"
exec .venv/bin/python -m tests.conformance.run "$@"
