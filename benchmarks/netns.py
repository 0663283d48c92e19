"""Two network namespaces joined by a veth pair: two "hosts" on one machine.

Each end of the link lives in its own namespace, with its own address in a private /30
(``10.213.x.y``), so that traffic between a process in one and a process in the other
crosses a network device, as between hosts: no loopback, no Unix socket of the other's,
no shared abstract socket names. Names carry the creating process's id (and a counter), so
that runs side by side never share a namespace.

Making them needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` tool;
:func:`unavailable` says why a run cannot have them. :class:`HostPair` removes what it made
on every way out: its ``with`` block, an exception, Ctrl-C, SIGTERM (turned into
``SystemExit`` by :func:`exit_on_sigterm`) and interpreter exit (``atexit``).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from typing import Any

__all__ = ["HostPair", "exit_on_sigterm", "list_namespaces", "unavailable"]

_COUNTER = itertools.count()
_IP_TIMEOUT_S = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=_IP_TIMEOUT_S)


def list_namespaces() -> set[str]:
    """The names of the machine's named network namespaces (``ip netns list``)."""
    out = _ip("netns", "list").stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


def unavailable() -> str | None:
    """Why two namespaces cannot be made here, or None if they can be tried."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "needs root (network namespaces and a veth pair); run it as root"
    if shutil.which("ip") is None:
        return "needs the 'ip' tool (iproute2) to make network namespaces"
    return None


class HostPair:
    """Namespaces ``a`` and ``b``, joined by veth devices ``dev_a`` (in ``a``, at
    ``addr_a``) and ``dev_b`` (in ``b``, at ``addr_b``).

    :meth:`create` makes them; :meth:`destroy` (idempotent, also run at exit) deletes the
    namespaces, which takes the veth pair with them, and the pair itself if it was left in
    the root namespace by a failed setup. Processes still running in a namespace must be
    ended by whoever started them: deleting the name does not stop them.
    """

    def __init__(self, tag: str = "trpc") -> None:
        n = next(_COUNTER)
        pid = os.getpid()
        self.a = f"{tag}-{pid}-{n}-a"
        self.b = f"{tag}-{pid}-{n}-b"
        # Interface names: at most 15 characters.
        self.dev_a = f"tv{pid % 10**7}x{n % 100}a"
        self.dev_b = f"tv{pid % 10**7}x{n % 100}b"
        # A /30 of 10.213.0.0/16 per pair; the two namespaces see no other network, so the
        # address only has to differ between the pairs of this process.
        base = ((pid * 8 + n) % 16384) * 4
        self.addr_a = f"10.213.{base >> 8}.{(base & 255) + 1}"
        self.addr_b = f"10.213.{base >> 8}.{(base & 255) + 2}"
        self._made: list[str] = []
        self._veth = False

    def __repr__(self) -> str:
        return (f"HostPair({self.a} {self.dev_a} {self.addr_a} <-> "
                f"{self.b} {self.dev_b} {self.addr_b})")

    def create(self) -> None:
        """Make both namespaces and the link; on any failure remove what was made and raise
        ``RuntimeError`` with ``ip``'s message."""
        atexit.register(self.destroy)
        try:
            for name in (self.a, self.b):
                _ip("netns", "add", name)
                self._made.append(name)
            _ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
            self._veth = True
            for ns, dev, addr in ((self.a, self.dev_a, self.addr_a),
                                  (self.b, self.dev_b, self.addr_b)):
                _ip("link", "set", dev, "netns", ns)
                _ip("-n", ns, "addr", "add", f"{addr}/30", "dev", dev)
                _ip("-n", ns, "link", "set", dev, "up")
                _ip("-n", ns, "link", "set", "lo", "up")
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as exc:
            detail = getattr(exc, "stderr", None) or str(exc)
            self.destroy()
            raise RuntimeError(f"could not make two network namespaces: "
                               f"{str(detail).strip()}") from exc

    def destroy(self) -> None:
        """Delete the namespaces (and the veth pair); safe to call again."""
        while self._made:
            _ip("netns", "del", self._made.pop(), check=False)
        if self._veth:
            # Gone with its namespace, unless setup failed before moving it there.
            _ip("link", "del", self.dev_a, check=False)
            self._veth = False
        with contextlib.suppress(Exception):
            atexit.unregister(self.destroy)

    def __enter__(self) -> HostPair:
        self.create()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.destroy()

    def command(self, side: str, argv: list[str]) -> list[str]:
        """``argv`` run inside namespace ``side`` (``"a"`` or ``"b"``)."""
        return ["ip", "netns", "exec", self.a if side == "a" else self.b, *argv]


@contextlib.contextmanager
def exit_on_sigterm() -> Iterator[None]:
    """While inside, SIGTERM raises ``SystemExit`` (in the main thread), so ``finally``
    blocks and ``atexit`` run as they do for Ctrl-C."""
    def handler(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
