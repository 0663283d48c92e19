"""A group member for tests: init_rpc, then serve until the group shuts down."""

import json
import os
import resource
import sys

import torch

import torchrpc.rpc as rpc
from tests.support.group import backend_and_options, exit_fast
from tests.support.thread_watch import WATCH_ENV, ThreadWatch

# Set: serve until helpers.stop_serving is called, then stop without meeting the group.
SERVE_ENV = "TORCHRPC_TEST_SERVE"
# The same for the ranks it lists (comma-separated); the others shut down as usual.
SERVE_RANKS_ENV = "TORCHRPC_TEST_SERVE_RANKS"


def main() -> None:
    name, rank, world_size, threads, timeout = sys.argv[1:6]
    nofile = os.environ.get("TORCHRPC_TEST_NOFILE")  # a descriptor limit to test floods
    if nofile:
        resource.setrlimit(resource.RLIMIT_NOFILE, (int(nofile), int(nofile)))
    torch.set_num_threads(1)
    watch_dir = os.environ.get(WATCH_ENV)
    watch = ThreadWatch().install() if watch_dir else None
    backend, opts = backend_and_options(int(threads), float(timeout), os.environ)
    rpc.init_rpc(name, backend=backend, rank=int(rank), world_size=int(world_size),
                 rpc_backend_options=opts)
    if os.environ.get(SERVE_ENV) or rank in os.environ.get(SERVE_RANKS_ENV, "").split(","):
        # Serve whatever happens to the others, until the test says stop.
        from tests.support.helpers import stopped_serving
        stopped_serving.wait()
        rpc.shutdown(graceful=False)
        return
    rpc.shutdown()
    if watch is not None:
        from torchrpc._agent.current import handle
        with open(os.path.join(watch_dir, f"{name}.json"), "w") as f:
            json.dump({**watch.report(), "debug": handle.last_debug_info}, f)
    report = os.environ.get("TORCHRPC_TEST_REPORT")
    if report:
        from torchrpc._agent.current import handle
        with open(os.path.join(report, f"{name}.json"), "w") as f:
            json.dump(handle.last_debug_info, f)


if __name__ == "__main__":
    main()
    exit_fast()
