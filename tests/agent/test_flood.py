"""Floods of idle and trickling connections: a worker with few descriptors keeps serving
its peers, and accepts and authenticates new connections once the flood is over."""

from __future__ import annotations

import socket
import threading
import time

import pytest

import torchrpc.rpc as rpc
from torchrpc.rpc import api

from ..support import helpers
from ..support.group import running_group
from ..support.handshake import authenticate

NOFILE = 256


@pytest.fixture(scope="module")
def group():
    with running_group(2, threads=4, timeout=30.0,
                       extra_env={"TORCHRPC_TEST_NOFILE": str(NOFILE)}) as g:
        yield g


def _open(address, n):
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.settimeout(0.5)
        try:
            s.connect(address)
        except OSError:
            pass  # the backlog is full: the SYN waits in the kernel, which is also a flood
        socks.append(s)
    return socks


def test_flood_of_idle_and_trickling_connections(group):
    address = api.current_agent().registry.addresses[1]
    assert rpc.rpc_sync("worker1", helpers.add, args=(1, 2)) == 3
    idle = _open(address, 300)  # more than the worker has descriptors
    trickling = _open(address, 50)
    stop = threading.Event()

    def trickle():
        while not stop.wait(1.0):
            for s in trickling:
                try:
                    s.send(b"\x00")
                except OSError:
                    pass
    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        for i in range(20):  # the established connection keeps working meanwhile
            assert rpc.rpc_sync("worker1", helpers.add, args=(i, 1)) == i + 1
            time.sleep(0.2)
    finally:
        stop.set()
        t.join()
        for s in idle + trickling:
            s.close()
    # Once the flood is gone, a new peer is accepted and authenticated within 10 s.
    secret = api.current_agent()._transport._secret
    start = time.monotonic()
    while True:
        try:
            authenticate(*address, secret, claim_rank=0, server_rank=1, timeout=2.0).close()
            break
        except (OSError, AssertionError, ConnectionError):
            assert time.monotonic() - start < 10.0, "no new connection accepted after the flood"
            time.sleep(0.2)
    assert time.monotonic() - start < 10.0
    assert rpc.rpc_sync("worker1", helpers.add, args=(40, 2)) == 42
