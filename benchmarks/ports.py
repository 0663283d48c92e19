"""A port for a worker group's rendezvous, chosen where nothing else will take it.

A launcher picks the rendezvous port (``MASTER_PORT``, ``tcp://host:port``) and rank 0 binds
it seconds later, once it has imported torch. Meanwhile every ``bind`` to port 0 on the host
(another session's store or listener: the bench runs sessions side by side when they take
turns) takes a port from the kernel's ephemeral range, and may take that one: rank 0 then
fails with "address already in use". So the port is chosen below the ephemeral range
(``/proc/sys/net/ipv4/ip_local_port_range``), where the kernel hands out none by itself,
checked free by binding it, and handed out once per process.
"""

from __future__ import annotations

import random
import socket
import threading

__all__ = ["free_port"]

_RANGE_FILE = "/proc/sys/net/ipv4/ip_local_port_range"
_LOWEST = 10000  # below this lie the registered ports of common services
_TRIES = 200

_lock = threading.Lock()
_given: set[int] = set()


def _ephemeral_start() -> int:
    """The first port of the kernel's ephemeral range (Linux's default where unknown)."""
    try:
        with open(_RANGE_FILE, encoding="ascii") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def _bindable(port: int, host: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that is free now, lies outside the kernel's ephemeral range
    where it can, and was not handed out before by this process.

    Raises:
        RuntimeError: if no such port was found.
    """
    top = _ephemeral_start()
    with _lock:
        if top - _LOWEST >= 1000:
            for _ in range(_TRIES):
                port = random.randrange(_LOWEST, top)
                if port not in _given and _bindable(port, host):
                    _given.add(port)
                    return port
        # The ephemeral range starts too low to leave room below it: let the kernel choose.
        for _ in range(_TRIES):
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind((host, 0))
                port = sock.getsockname()[1]
            if port not in _given:
                _given.add(port)
                return port
    raise RuntimeError(f"found no free TCP port on {host} in {_TRIES} tries")
