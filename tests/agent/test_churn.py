"""Connections churn under load: 8 workers call each other for 10 s while every worker
closes its connections at random (either side, cleanly or broken) and the fault-injecting
ones fail and delay sends, with heartbeats every 0.1 s and calls that time out. No thread
of any worker may raise or log an error, no healthy worker may be timed out as silent,
no call may wait out its timeout for a request or reply that was lost, and the group must
still shut down gracefully.

``TORCHRPC_CHURN_SECONDS`` changes the 10 s.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable

import torchrpc.rpc as rpc
from torchrpc._agent.current import handle
from torchrpc._testing import faulty
from torchrpc.errors import ConnectionLostError

from ..support import robust as rh
from ..support.group import running_group
from ..support.thread_watch import WATCH_ENV, ThreadWatch

SECONDS = float(os.environ.get("TORCHRPC_CHURN_SECONDS", "10"))
WORLD = 8
OPTIONS = {"heartbeat_interval": 0.1, "heartbeat_timeout": 5.0}


def _retry(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """``call`` again when it meets the churn (the functions called are idempotent)."""
    for attempt in range(3):
        try:
            return call(*args, **kwargs)
        except ConnectionLostError:
            if attempt == 2:
                raise
            time.sleep(0.5)


def test_connection_churn_with_faults_kills_no_thread_and_loses_no_worker(tmp_path):
    watch = ThreadWatch().install()
    try:
        # Ranks 1-7 inject faults; rank 0 (here) is a plain agent.
        with running_group(WORLD, threads=4, timeout=60.0, backend=faulty.BACKEND_NAME,
                           self_backend="TENSORPIPE", options=OPTIONS,
                           extra_env={WATCH_ENV: str(tmp_path)}):
            names = [w.name for w in rpc.get_worker_infos()]
            start_at = time.time() + 2.0  # every drive is started before any churn
            for rank, name in list(enumerate(names))[1:]:
                assert _retry(rpc.rpc_sync, name, rh.start_churn, args=(start_at, SECONDS, rank))
            rh.start_churn(start_at, SECONDS, 0)
            results = [rh.churn_result(SECONDS + 60.0)]
            time.sleep(1.0)  # the others' churn ends about when this one's does
            results += [_retry(rpc.rpc_sync, name, rh.churn_result, args=(60.0,), timeout=90)
                        for name in names[1:]]
    finally:
        watch.uninstall()
    reports = {"worker0": {**watch.report(), "debug": handle.last_debug_info}}
    for name in names[1:]:
        with open(tmp_path / f"{name}.json") as f:
            reports[name] = json.load(f)
    summary = {r["worker"]: r["counts"] for r in results}
    print(f"churn for {SECONDS:g} s: {summary}")
    for r in results:
        assert not r["unexpected"], r["unexpected"][:5]
        assert r["counts"].get("ok", 0) >= 20, summary  # calls got through all along
        assert r["counts"].get("closed", 0) >= 20, summary
        assert r["heartbeat_timeouts"] == 0, r
        # A lost request fails with its connection; none may wait out its 10 s timeout.
        assert r["counts"].get("RpcTimeoutError", 0) == 0, summary
    assert sum(r["counts"].get("timed_out_on_purpose", 0) for r in results) > 0, summary
    for name, report in reports.items():
        assert not report["raised"], (name, report["raised"][:5])
        assert not report["errors"], (name, report["errors"][:5])
        assert report["debug"].get("agent.num_heartbeat_timeouts") == 0, (name, report["debug"])
