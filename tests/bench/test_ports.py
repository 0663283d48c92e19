"""The rendezvous port of a worker group: chosen where a ``bind`` to port 0 never lands."""

from __future__ import annotations

import socket

from benchmarks import ports


def test_ports_lie_below_the_ephemeral_range_and_are_handed_out_once() -> None:
    start = ports._ephemeral_start()
    with open("/proc/sys/net/ipv4/ip_local_port_range", encoding="ascii") as f:
        assert start == int(f.read().split()[0])
    chosen = [ports.free_port() for _ in range(200)]
    assert len(set(chosen)) == len(chosen)
    if start - ports._LOWEST >= 1000:
        assert all(ports._LOWEST <= p < start for p in chosen), chosen
    # What the launchers' sessions bind meanwhile (stores, listeners) gets none of them.
    held = []
    try:
        for _ in range(200):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            held.append(sock)
            sock.bind(("127.0.0.1", 0))
        assert not {s.getsockname()[1] for s in held} & set(chosen)
    finally:
        for sock in held:
            sock.close()
    # And each is free: rank 0 can listen on it.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", chosen[-1]))
        sock.listen()
