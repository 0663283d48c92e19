"""The transport: listens for authenticated peers and connects to them.

One :class:`~torchrpc._transport.connection.Connection` per socket (sending in
``connection.py``, reading in ``reader.py``). The transport knows no message meanings:
it hands whole frames to the ``on_frame`` callback and reports a closed connection to
``on_close``, with the exception when the connection broke rather than closed.

Its parts: ``accept.py`` listens and serves the server side of the handshake,
``dial.py`` runs the client side, and ``links.py`` keeps the table of connections and
the sockets and threads on the way to them.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Tuple

from .. import _wire
from .._threads import Fatal
from . import handshake, shm, tls
from .accept import Acceptor
from .connection import Connection
from .dial import dial
from .links import Links
from .reader import CloseCallback, FrameCallback


class Transport:
    """Listens for authenticated peers and opens connections to them.

    ``on_connect(conn)`` is called for every authenticated connection, inbound or
    outbound, before its first frame is delivered.

    With ``FEATURE_SHM`` in ``features``, a connection whose peer offered it too
    accepts buffers in shared memory, and sends its own buffers of at least
    ``shm_threshold`` bytes that way when ``same_host(peer_rank)`` says the peer
    shares this machine and ``same_pids(peer_rank)`` that it sees this process's pids.

    Frames on plain TCP carry MACs; with ``tensor_mac`` (on a connection where both sides
    offer it) they cover the out-of-band buffers too.

    With ``stripe_threshold`` (bytes, 0: none), a connection over TCP whose peer offers it
    too gets a second socket, which frames with at least that many buffer bytes share
    (``stripe.py``).
    """

    def __init__(self, rank: int, secret: bytes, limits: _wire.Limits,
                 on_connect: Callable[[Connection], None], on_frame: FrameCallback,
                 on_close: CloseCallback, host: str, port: int = 0, features: int = 0,
                 tls_contexts: Optional[tls.TlsContexts] = None, shm_threshold: int = 0,
                 same_host: Optional[Callable[[int], bool]] = None,
                 local_socket: bool = False, on_fatal: Optional[Fatal] = None,
                 same_pids: Optional[Callable[[int], bool]] = None,
                 send_timeout: float = 0.0, max_outbox: int = 0,
                 max_private: int = 0, incarnation: int = 0,
                 admit: Optional[Callable[[int, int], Optional[str]]] = None,
                 connection_type: Callable[..., Connection] = Connection,
                 tensor_mac: bool = True, stripe_threshold: int = 0) -> None:
        self.rank = rank
        self.incarnation = incarnation  # sent in every HELLO (see handshake.py)
        self._secret = secret
        if features & handshake.FEATURE_SHM and shm_threshold < 1:
            raise ValueError(f"shm_threshold must be at least 1 byte, got {shm_threshold}; "
                             f"to keep buffers off shared memory, set enable_shm=False")
        if features & handshake.FEATURE_SHM and not shm.available():
            features &= ~handshake.FEATURE_SHM  # no memfds: no shared memory (see shm.py)
        features |= handshake.FEATURE_PRIVATE | handshake.FEATURE_FRAME_MAC
        if tensor_mac:
            features |= handshake.FEATURE_TENSOR_MAC | handshake.FEATURE_SEAL_TRAILER
        if stripe_threshold > 0:
            features |= handshake.FEATURE_STRIPE
        self._links = Links(rank, secret, limits, features, on_connect, on_frame, on_close,
                            tls_contexts=tls_contexts, shm_threshold=shm_threshold,
                            same_host=same_host, same_pids=same_pids,
                            send_timeout=send_timeout, max_outbox=max_outbox,
                            max_private=max_private, incarnation=incarnation,
                            on_fatal=on_fatal, connection_type=connection_type,
                            stripe_threshold=stripe_threshold)
        self._acceptor = Acceptor(self._links, host, port, local_socket, admit)
        self.address: Tuple[str, int] = self._acceptor.address
        self.secure = tls_contexts is not None  # whether every link runs over TLS
        # rank -> the most tensor bytes a message to it carries inside its envelope, where
        # not _wire.INLINE_MAX (peers whose frames carry MACs).
        self.inline_max: Dict[int, int] = self._links.inline_max

    def connect(self, peer_rank: int, host: str, port: int, timeout: float,
                local: bool = False, private: bool = False,
                incarnation: int = 0) -> Connection:
        """Open, authenticate and start a connection to ``peer_rank`` at ``host:port``;
        with ``local`` (the peer shares this host), through its Unix socket if it has one.
        The peer must prove it is process ``incarnation`` of that rank (0 in a static
        group) listening at ``host:port`` as it published it, or the connection fails.

        A ``private`` connection gets no reader: whoever sends a request on it reads
        the reply with :meth:`Connection.read_frame`.
        """
        return dial(self._links, peer_rank, host, port, timeout,
                    local=local and self._acceptor.local is not None, private=private,
                    incarnation=incarnation)


    def connections(self) -> List[Connection]:
        """Every open connection, shared and private (for counters and tests)."""
        return self._links.connections()

    def debug_info(self) -> Dict[str, Any]:
        """Shared-memory counters (``transport.shm_*``)."""
        return self._links.debug_info()

    def housekeeping(self) -> None:
        """Let shared-memory segments that nobody used for a while go (call now and then)."""
        self._links.housekeeping()

    def close(self, timeout: float = 10.0) -> List[str]:
        """Stop listening, close every socket and join every thread the transport started,
        waiting ``timeout`` seconds at most for all of them together; the names of the
        threads still running."""
        return self._links.close(self._acceptor.listeners, timeout)
