"""Observability over real worker processes: loggers, debug info of any worker, per-peer
counters, debug info logged on a timeout, remote profiler events' durations."""

from __future__ import annotations

import importlib
import logging
import os
import pkgutil
import re
import time
import warnings

import pytest
import torch
from torch.autograd.profiler import record_function
from torch.autograd.profiler_legacy import profile as legacy_profile

import torchrpc
import torchrpc.rpc as rpc
from torchrpc._agent import stats
from torchrpc.errors import RpcTimeoutError

from ..support import helpers
from ..support.group import ROOT, running_group, wait_for

warnings.filterwarnings("ignore", message=".*profiler_legacy.profile.*deprecated")


@pytest.fixture(scope="module", autouse=True)
def group():
    # Only this process (worker0) logs debug info on timeouts; the others keep the default.
    with running_group(3, threads=4, timeout=30.0,
                       self_options={"log_debug_info_on_timeout": True,
                                     "profile_kineto": True}) as g:
        yield g


def sleeping_block(seconds: float) -> torch.Tensor:
    """A profiled block that lasts ``seconds`` on the callee."""
    with record_function("sleeping_block"):
        time.sleep(seconds)
        return torch.ones(2)


def _peer(info: dict, name: str) -> dict:
    return info["peers"][name]


# -- loggers ---------------------------------------------------------------------------------------

def test_each_module_logs_under_its_own_name():
    modules = [m.name for m in pkgutil.walk_packages(torchrpc.__path__, "torchrpc.")
               if ".examples" not in m.name]
    loggers = {}
    for name in modules:
        log = getattr(importlib.import_module(name), "log", None)
        if isinstance(log, logging.Logger):
            loggers[name] = log.name
    assert len(loggers) >= 10, loggers
    assert all(module == logger for module, logger in loggers.items()), loggers
    package = logging.getLogger("torchrpc")
    assert any(isinstance(h, logging.NullHandler) for h in package.handlers)


def test_no_message_repeats_the_package_name():
    pattern = re.compile(r"""(log\.[a-z]+|\.warn)\(\s*f?["']torchrpc:""")
    offenders = []
    for base, _, files in os.walk(os.path.join(ROOT, "torchrpc")):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(base, f)
                with open(path, encoding="utf-8") as fh:
                    if pattern.search(fh.read()):
                        offenders.append(os.path.relpath(path, ROOT))
    assert not offenders, offenders


def test_transport_logger_turns_up_alone(caplog):
    caplog.set_level(logging.DEBUG, logger="torchrpc._transport")
    assert logging.getLogger("torchrpc._transport.tcp").isEnabledFor(logging.DEBUG)
    assert not logging.getLogger("torchrpc._agent.agent").isEnabledFor(logging.DEBUG)


# -- debug info ------------------------------------------------------------------------------------

def test_get_debug_info_of_another_worker_by_name_rank_and_info():
    by_name = rpc.get_debug_info("worker1")
    by_rank = rpc.get_debug_info(2)
    by_info = rpc.get_debug_info(rpc.get_worker_info("worker1"), timeout=10)
    for info in (by_name, by_rank, by_info):
        assert info["agent.state"] == "running" and "num_owner_rrefs" in info
        assert "worker0" in info["peers"]  # the question came from here
    assert "worker1" not in by_name["peers"] and "worker2" not in by_rank["peers"]
    assert by_name["peers"]["worker0"]["calls_in"] >= 1


def test_torchs_debug_info_keeps_its_keys():
    assert "peers" not in rpc.api._get_debug_info()
    assert "peers" not in rpc.api._get_current_rpc_agent().get_debug_info()
    assert "peers" in rpc.get_debug_info()


def test_per_peer_counters_count_calls_bytes_and_latency():
    before = _peer(rpc.get_debug_info(), "worker2") if "worker2" in rpc.get_debug_info()["peers"] \
        else {"calls_out": 0, "bytes_out": 0, "bytes_in": 0, "replies": 0}
    x = torch.zeros(1 << 16)  # 256 KiB each way
    for _ in range(10):
        rpc.rpc_sync("worker2", helpers.echo, args=(x,))
    for f in [rpc.rpc_async("worker2", helpers.add, args=(i, 1)) for i in range(10)]:
        f.wait()
    after = _peer(rpc.get_debug_info(), "worker2")
    assert after["calls_out"] - before["calls_out"] == 20
    assert after["replies"] - before["replies"] == 20
    assert after["bytes_out"] - before["bytes_out"] >= 10 * x.nbytes
    assert after["bytes_in"] - before["bytes_in"] >= 10 * x.nbytes
    assert 0 < after["latency_p50_ms"] <= after["latency_p99_ms"] < 10_000
    callee = _peer(rpc.get_debug_info("worker2"), "worker0")
    assert callee["calls_in"] >= 20 and callee["bytes_out"] >= 10 * x.nbytes


def test_errors_are_counted_on_both_sides():
    mine = _peer(rpc.get_debug_info(), "worker1")["errors_out"] \
        if "worker1" in rpc.get_debug_info()["peers"] else 0
    theirs = _peer(rpc.get_debug_info("worker1"), "worker0")["errors_in"]
    with pytest.raises(ValueError, match="counted"):
        rpc.rpc_sync("worker1", helpers.raise_value_error, args=("counted",))
    assert _peer(rpc.get_debug_info(), "worker1")["errors_out"] == mine + 1
    assert _peer(rpc.get_debug_info("worker1"), "worker0")["errors_in"] == theirs + 1


def test_latency_ring_and_percentiles():
    s = stats.PeerStats()
    assert s.as_dict()["latency_p50_ms"] is None
    for i in range(1, 101):
        s.latency(i / 1000.0)
    d = s.as_dict()
    assert d["latency_p50_ms"] == 50.0 and d["latency_p99_ms"] == 99.0
    for _ in range(stats.RING):  # the ring keeps only the last RING latencies
        s.latency(0.002)
    d = s.as_dict()
    assert d["latency_p50_ms"] == d["latency_p99_ms"] == 2.0 and d["replies"] == 100 + stats.RING


# -- a timeout logs both sides' debug info -------------------------------------------------------

def test_timeout_logs_the_debug_info_of_caller_and_callee(caplog):
    caplog.set_level(logging.WARNING, logger="torchrpc")
    t0 = time.monotonic()
    with pytest.raises(RpcTimeoutError):
        rpc.rpc_sync("worker1", helpers.sleep_then, args=(3.0,), timeout=0.3)
    assert time.monotonic() - t0 < 2.0  # the report does not delay the timeout error
    wait_for("worker1's debug info logged",
             lambda: "debug info of worker1, whose call timed out" in caplog.text, 10,
             state=lambda: caplog.text)
    assert "debug info of worker0:" in caplog.text and "sleep_then" in caplog.text
    mine = next(r for r in caplog.records if "timed out after" in r.getMessage())
    assert mine.name == "torchrpc._agent.debug"
    assert _peer(rpc.get_debug_info(), "worker1")["timeouts"] >= 1


def test_option_is_validated():
    opts = rpc.TensorPipeRpcBackendOptions()
    assert opts.log_debug_info_on_timeout is False
    with pytest.raises(TypeError, match="log_debug_info_on_timeout must be a bool"):
        rpc.TensorPipeRpcBackendOptions(log_debug_info_on_timeout="yes")


# -- profiler --------------------------------------------------------------------------------------

def test_remote_event_of_a_sleeping_block_lasts_the_sleep():
    with legacy_profile() as prof:
        rpc.rpc_sync("worker2", sleeping_block, args=(0.25,))
    block = next(e for e in prof.function_events
                 if e.is_remote and e.name.endswith("#remote_op: sleeping_block"))
    assert block.node_id == 2
    assert 0.25e6 <= block.cpu_time_total < 2.0e6, block.cpu_time_total


def test_kineto_remote_events_carry_the_callee_durations():
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        rpc.rpc_sync("worker2", sleeping_block, args=(0.25,))
        local = torch.ones(3) * 2  # a local op right after: not a child of the remote event
    events = prof.events()
    block = next(e for e in events if e.name.endswith("#remote_op: sleeping_block"))
    assert block.is_remote and block.node_id == 2
    assert 0.25e6 <= block.cpu_time_total < 2.0e6, block.cpu_time_total
    mul = [e for e in events if e.name == "aten::mul" and not e.is_remote]
    assert mul and all(e.cpu_parent is None or not e.cpu_parent.is_remote for e in mul)
    assert local.sum().item() == 6
    averages = {a.key: a for a in prof.key_averages()}
    assert averages[block.name].cpu_time_total >= 0.25e6
