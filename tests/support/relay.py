"""A TCP relay between two workers, and the functions the relay tests run on workers.

:class:`Relay` forwards every connection made to it to one worker's listener; ``alter``
may change the dialer's bytes on the way (a party on the path). A worker reaches a peer
through it when its table names the relay's address for that peer (:func:`call_through`),
as a forged rendezvous record would make it; the peer's handshake passes only where it
publishes the relay's address as its own (:func:`publish_address`, a port-forward).
"""

from __future__ import annotations

import itertools
import logging
import socket
import threading
import time
from typing import Any, Callable, List, Optional, Tuple

import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._agent.current import current_agent
from torchrpc._transport import handshake

Alter = Callable[[bytes], bytes]

PATTERN = 0x5A  # the value of every byte of the tensors a tampering relay looks for


class Relay:
    """Listens on ``host`` and forwards each connection to ``target`` both ways; the
    dialer's bytes go through ``make_alter()`` (one per connection) when given."""

    def __init__(self, target: Tuple[str, int],
                 make_alter: Optional[Callable[[], Alter]] = None,
                 host: str = "127.0.0.1") -> None:
        self.listener = socket.create_server((host, 0))
        self.address: Tuple[str, int] = self.listener.getsockname()[:2]
        self.connections = 0
        self._target = target
        self._make_alter = make_alter
        self._sockets: List[socket.socket] = []
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                server = socket.create_connection(self._target, timeout=5)
            except OSError:
                client.close()
                continue
            server.settimeout(None)
            with self._lock:
                self.connections += 1
                self._sockets += [client, server]
            alter = self._make_alter() if self._make_alter else None
            threading.Thread(target=self._pump, args=(client, server, alter),
                             daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None),
                             daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, alter: Optional[Alter]) -> None:
        try:
            while True:
                chunk = src.recv(1 << 16)
                if not chunk:
                    break
                dst.sendall(alter(chunk) if alter else chunk)
        except OSError:
            pass
        for s in (src, dst):  # one side ended: so does the other
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self) -> None:
        self.listener.close()
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for s in sockets:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()


RUN = 4096  # the run of PATTERN bytes that flip_one_tensor_byte takes for a tensor


def flip_one_tensor_byte() -> Alter:
    """An alteration that flips one bit of the last byte of the first run of :data:`RUN`
    :data:`PATTERN` bytes it sees (inside a tensor made of them), once, after the
    handshake. The last byte, not the first: the bytes just before a frame's buffers (its
    tag, random) may end in PATTERN too, and a run found there starts before the tensor."""
    state = {"seen": 0, "done": False}
    run = bytes([PATTERN]) * RUN

    def alter(chunk: bytes) -> bytes:
        state["seen"] += len(chunk)
        if state["done"] or state["seen"] <= handshake.HELLO.size + handshake.PROOF.size:
            return chunk
        i = chunk.find(run)
        if i < 0:
            return chunk
        state["done"] = True
        i += RUN - 1
        return chunk[:i] + bytes([PATTERN ^ 1]) + chunk[i + 1:]
    return alter


def flip_at(offset: int, flipped: list, nth: Optional[int] = None) -> Callable[[], Alter]:
    """An alteration factory (for :class:`Relay`) that flips one bit of the dialer's byte
    at ``offset`` on the stream, counted from the first byte after the handshake, and
    records the offset in ``flipped``; with ``nth``, only on the relay's ``nth``
    connection (0: the first), else on each."""
    made = itertools.count()

    def make() -> Alter:
        seen = [-(handshake.HELLO.size + handshake.PROOF.size)]
        if nth is not None and next(made) != nth:
            seen[0] = -(1 << 62)  # never reaches the offset

        def alter(chunk: bytes) -> bytes:
            start = seen[0]
            seen[0] += len(chunk)
            i = offset - start
            if 0 <= i < len(chunk):
                flipped.append(offset)
                return chunk[:i] + bytes([chunk[i] ^ 1]) + chunk[i + 1:]
            return chunk
        return alter
    return make


def first_tensor_byte(at: int, trailer: bool = True) -> int:
    """Where byte ``at`` of the one tensor of a connection's first frame (with a 1-byte
    envelope) lies on the dialer's stream, counted as :func:`flip_at` counts: after the
    header, one length, the envelope, the seal's bytes in front of the buffers (fewer when
    the seal trails them) and the frame's tag."""
    front = handshake.SEAL_NUMBER_SIZE if trailer else handshake.SEAL_SIZE
    return _wire.HEADER_SIZE + 8 + 1 + front + handshake.FRAME_MAC_SIZE + at


def pattern_tensor(n: int) -> torch.Tensor:
    return torch.full((n,), PATTERN, dtype=torch.uint8)


# -- run on workers ----------------------------------------------------------------------------

def publish_address(address: Optional[Tuple[str, int]]) -> Tuple[str, int]:
    """Make this worker's handshakes prove ``address`` as its own (None: its listener's),
    as a worker behind a port-forward that published the forwarder's address would."""
    transport = current_agent()._transport
    transport._links.address = tuple(address) if address else transport.address
    return transport._links.address


_real: dict = {}  # rank -> the address this worker's table had for it before point_at


def point_at(to: str, address: Optional[Tuple[str, int]]) -> int:
    """Make this worker's table name ``address`` for worker ``to`` (None: the address it
    had), as a forged rendezvous record would, and close its connections to ``to`` so
    the next call dials again; how many it closed."""
    agent = current_agent()
    rank = agent.registry.by_name[to].id
    if rank not in _real:
        _real[rank] = agent.registry.addresses[rank]
    agent.registry.addresses[rank] = tuple(address) if address else _real.pop(rank)
    conns = [c for c in agent._transport.connections() if c.peer_rank == rank]
    for c in conns:
        c.close()
    return len(conns)


def call(to: str, value: Any) -> Tuple[str, Any]:
    """Echo ``value`` off worker ``to``: ("ok", what came back) or (the error's type, its
    text). Returns once this worker is done checking whether ``to`` is still reachable
    (a connection that broke makes it try)."""
    agent = current_agent()
    rank = agent.registry.by_name[to].id
    try:
        got: Tuple[str, Any] = ("ok", rpc.rpc_sync(to, echo, args=(value,), timeout=20))
    except Exception as exc:  # noqa: BLE001 - the test reads what it was
        got = (type(exc).__name__, str(exc))
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        time.sleep(0.1)
        open_ = any(c.peer_rank == rank and not c.closed for c in agent._transport.connections())
        if open_ and rank not in agent.liveness._confirming:
            break
    return got


def offer_tensor_mac(on: bool) -> None:
    """Offer MACs over tensor bytes in this worker's next handshakes or not, as the
    ``tensor_mac`` option does from ``init_rpc`` on."""
    links = current_agent()._transport._links
    if on:
        links.features |= handshake.FEATURE_TENSOR_MAC
    else:
        links.features &= ~handshake.FEATURE_TENSOR_MAC


def offers_tensor_mac() -> bool:
    """Whether this worker's transport offers MACs over tensor bytes (the option)."""
    return bool(current_agent()._transport._links.features & handshake.FEATURE_TENSOR_MAC)


def echo(x: Any) -> Any:
    return x


def on(to: str, fn: Callable[..., Any], args: Tuple[Any, ...] = ()) -> Any:
    """``fn(*args)`` on worker ``to``, called from this worker."""
    return rpc.rpc_sync(to, fn, args=args)



class _Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: List[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


_recorder = _Recorder()


def warnings_logged(clear: bool = False) -> List[str]:
    """The warnings this worker's torchrpc loggers logged since the first call."""
    logger = logging.getLogger("torchrpc")
    if _recorder not in logger.handlers:
        logger.addHandler(_recorder)
    messages = list(_recorder.messages)
    if clear:
        _recorder.messages.clear()
    return messages
