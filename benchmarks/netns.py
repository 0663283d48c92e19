"""Two network namespaces joined by a veth pair: two "hosts" on one machine.

Each end of the link lives in its own namespace, with its own address in a private /30
(``10.213.x.y``), so that traffic between a process in one and a process in the other
crosses a network device, as between hosts: no loopback, no Unix socket of the other's,
no shared abstract socket names. Names carry the creating process's id (and a counter), so
that runs side by side never share a namespace.

Making them needs root (CAP_NET_ADMIN and CAP_SYS_ADMIN) and the ``ip`` tool;
:func:`unavailable` says why a run cannot have them. :class:`HostPair` removes what it made
on every way out: its ``with`` block, an exception, Ctrl-C and SIGTERM (made to raise by
:func:`exit_on_signals`, even where the parent left SIGINT ignored) and interpreter exit
(``atexit``). Its removal kills what still runs in the namespaces, and is not cut short by
a second signal (:func:`signals_held`).
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Iterator
from typing import Any

__all__ = ["HostPair", "exit_on_signals", "list_namespaces", "signals_held", "unavailable"]

_COUNTER = itertools.count()
_IP_TIMEOUT_S = 20.0


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    # In a session of its own: a Ctrl-C at the terminal reaches the bench, which decides
    # what to stop, and never kills an ``ip`` half-way through making or removing a
    # namespace.
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=_IP_TIMEOUT_S, start_new_session=True)


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

    :meth:`create` makes them; :meth:`destroy` (idempotent, also run at exit) kills every
    process still in the namespaces (deleting a name alone would not stop them, and a worker
    started just as a signal came may have no owner left to end it), deletes the
    namespaces, which takes the veth pair with them, and the pair itself if it was left in
    the root namespace by a failed setup.
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
            # Each name is noted before it is asked for: an interrupt that comes while
            # ``ip`` runs leaves :meth:`destroy` to remove whatever ``ip`` got to make.
            for name in (self.a, self.b):
                self._made.append(name)
                _ip("netns", "add", name)
            self._veth = True
            _ip("link", "add", self.dev_a, "type", "veth", "peer", "name", self.dev_b)
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
        """Kill what runs in the namespaces and delete them (and the veth pair); safe to
        call again. SIGINT and SIGTERM wait until it is done (:func:`signals_held`)."""
        with signals_held():
            while self._made:
                name = self._made[-1]
                for pid in _pids(name):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                _ip("netns", "del", name, check=False)
                self._made.pop()  # only now: a cleanup cut short is finished at exit
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


def _pids(namespace: str) -> list[int]:
    """The processes in ``namespace`` (none if it does not exist)."""
    try:
        out = _ip("netns", "pids", namespace, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return [int(word) for word in out.split() if word.isdigit()]


_HELD = (signal.SIGINT, signal.SIGTERM)


def _restore(handlers: dict[int, Any]) -> None:
    for signum, handler in handlers.items():
        # None: the handler was set outside Python; the default is the nearest.
        signal.signal(signum, signal.SIG_DFL if handler is None else handler)


@contextlib.contextmanager
def exit_on_signals() -> Iterator[None]:
    """While inside, Ctrl-C (SIGINT) raises ``KeyboardInterrupt`` and SIGTERM raises
    ``SystemExit`` in the main thread, so ``finally`` blocks and ``atexit`` clean up.

    SIGINT gets its handler even when it was inherited as ignored (a background job of a
    non-interactive shell starts so): Python then installs none, and an interrupt sent to
    the bench would be lost while it holds namespaces and workers. Outside the main thread
    it changes nothing.
    """
    def terminate(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signal.SIGINT: signal.signal(signal.SIGINT, signal.default_int_handler),
                signal.SIGTERM: signal.signal(signal.SIGTERM, terminate)}
    try:
        yield
    finally:
        _restore(previous)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """While inside, SIGINT and SIGTERM are noted instead of handled; on the way out they
    are raised again, under the handlers from before. For a step that an exception must
    not cut in half: starting a worker and taking ownership of it, removing namespaces.
    Outside the main thread it changes nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    noted: list[int] = []

    def note(signum: int, frame: Any) -> None:
        if signum not in noted:
            noted.append(signum)

    previous = {signum: signal.signal(signum, note) for signum in _HELD}
    try:
        yield
    finally:
        _restore(previous)
        for signum in noted:
            signal.raise_signal(signum)
