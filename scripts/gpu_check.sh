#!/usr/bin/env bash
# The GPU checks, for a machine with a CUDA device (the device tool's machines have a CUDA
# build of torch in their python3, and no network): the CUDA and device-map tests, the CUDA
# echo bench (benchmarks/cuda_echo.py, into $OUT/cuda_echo.json), then torch's CUDA
# conformance suites in GPU_CHECK_SHARDS runners side by side (default 6), with
# their output under $OUT when that is set.
#   bash scripts/gpu_check.sh
# On a machine without a GPU the CUDA tests report themselves skipped, so the script can
# be dry-run anywhere.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
out="${OUT:-$(mktemp -d)}"
shards="${GPU_CHECK_SHARDS:-6}"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$PY" - <<'PYEOF' | tee "$out/gpu_env.txt"
import platform, torch
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "devices", torch.cuda.device_count(),
      [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
PYEOF
status=0
"$PY" -m pytest -q -p no:cacheprovider -rs \
    tests/rpc/test_cuda.py tests/rpc/test_device_maps.py tests/rpc/test_device_map_checks.py \
    tests/agent/test_cuda_ipc.py tests/agent/test_cuda_release.py \
    tests/dist_autograd/test_placement.py \
    tests/agent/test_devices.py 2>&1 | tee "$out/gpu_tests.txt" \
    || status=1
# The CUDA echo, torch and torchrpc one after the other, before the suites share the GPU.
timeout 240 "$PY" -m benchmarks.cuda_echo --iters 6 --small-calls 200 \
    --json-out "$out/cuda_echo.json" \
    >"$out/cuda_echo.txt" 2>&1 || { status=1; tail -20 "$out/cuda_echo.txt"; }
# Every runner appends whole lines to one progress file; their failure reports are joined
# into one file once all have finished.
reports="$(mktemp -d)"
pids=()
for i in $(seq 1 "$shards"); do
    "$PY" -m tests.conformance.run --suites cuda --shard "$i/$shards" \
        --report "$reports/$i.txt" >>"$out/cuda_conformance.txt" 2>&1 &
    pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || status=1; done
cat "$reports"/*.txt >"$out/cuda_failures.txt"
grep "^conformance:" "$out/cuda_conformance.txt"
exit "$status"
