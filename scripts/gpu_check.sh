#!/usr/bin/env bash
# The GPU checks of issue 18, for a machine with a CUDA device (the device tool's
# machines have a CUDA build of torch in their python3, and no network): the CUDA tests
# and the device-map tests, with their output under $OUT when that is set.
#   bash scripts/gpu_check.sh
# On a machine without a GPU the CUDA tests report themselves skipped, so the script can
# be dry-run anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
"$PY" - <<'PYEOF' | tee "$out/gpu_env.txt"
import torch
print("torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PYEOF
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" "$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/rpc/test_cuda.py tests/rpc/test_device_maps.py 2>&1 | tee "$out/gpu_tests.txt"
