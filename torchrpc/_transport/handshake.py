"""The connection handshake: mutual HMAC challenge-response, no pickling (sans I/O).

Theory of operation. A connection proves it belongs to the job before one byte of
it is unpickled. Both sides hold the per-job secret; neither ever sends it.

    client -> server   HELLO      magic b"TRPH", version, client rank, features_c, nonce_c,
                                  incarnation_c
    server -> client   CHALLENGE  server rank, features_s, nonce_s,
                                  HMAC(secret, "srv" | nonce_c | nonce_s | bound)
    client -> server   PROOF      HMAC(secret, "cli" | nonce_s | nonce_c | bound)
    client -> server   PARENT     nonce_s of the connection this socket is the stripe of,
                                  only after a HELLO with FEATURE_STRIPE_SOCKET (stripe.py)
    server -> client   ACCEPT     one byte, 1
    client -> server   READY      one byte, 1, only on a stripe: the client has it, and
                                  the server's frames may use it from now on (stripe.py)

    bound = ranks | version | features_c | features_s | incarnation_c | incarnation_s
            | address | binding

The client's incarnation tells a process apart from an earlier one under the same rank
(a dynamic group's member that was removed as lost, see ``_rendezvous.membership``); the
server refuses one that is not a member after checking the PROOF.

The responder proves it is the worker the dialer meant: the dialer computes the MACs
with the rank, the incarnation (0 in a static group) and the address (host and port, as
the worker published them) it dialed, the server with its own. The incarnation and the
address are never sent: a relay that forwards the bytes to the real worker, or another
process at an address a forged store record names, makes the two sides compute
different MACs, and the connection fails naming the worker that was meant.

The client checks the server's MAC (so it never talks to an impostor) and the
server checks the client's (so it never unpickles an outsider's bytes). Both MACs
cover the version and both feature sets, so a party on the path cannot change what
the two sides agree on. Under TLS, ``binding`` is the SHA-256 of the server's
certificate as each side sees it (RFC 5929's tls-server-end-point): a man in the
middle with any other certificate makes the two sides compute different MACs. Each
message has a fixed size, so a garbage peer can make the server read at most
``HELLO.size`` bytes before it is dropped. Every state has one transition; any
deviation is an :class:`~torchrpc.errors.AuthenticationError`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import itertools
import os
import struct
from typing import Any, Sequence, Tuple

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import AuthenticationError

MAGIC = b"TRPH"
# Workers of different versions refuse each other at the HELLO, with an error that says so.
VERSION = 3
NONCE = 16
# magic, version, client rank, features, nonce, incarnation
HELLO = struct.Struct("<4sBxxxiQ16sQ")
CHALLENGE = struct.Struct("<iQ16s32s")  # server rank, features, nonce, mac
PROOF = struct.Struct("<32s")
ACCEPT = b"\x01"
READY = b"\x01"

# Feature bits exchanged in the handshake.
FEATURE_SHM = 1
# In a HELLO: this connection is private to one calling thread of the client: it carries
# only the client's requests and the server's replies to them, which the calling thread
# reads itself. In a CHALLENGE: the server accepts private connections.
FEATURE_PRIVATE = 2
# Every frame on a plain TCP connection carries a MAC (see frame_keys); both sides offer it.
FEATURE_FRAME_MAC = 4
# The frames' MACs cover their out-of-band buffers too (see FrameMac); on when both offer it.
FEATURE_TENSOR_MAC = 8
# The seal of a frame's buffers follows them (see FrameMac), so both sides MAC the bytes
# while they are on the wire; on when both offer it and the buffers are sealed.
FEATURE_SEAL_TRAILER = 16
# Large frames may travel over two sockets (see stripe.py); on when both offer it. In a
# HELLO with FEATURE_STRIPE_SOCKET, the socket is not a connection but the stripe of one:
# right after its PROOF the client sends the server's nonce of that connection's handshake.
FEATURE_STRIPE = 32
FEATURE_STRIPE_SOCKET = 64
FRAME_MAC_SIZE = 16
SEAL_NUMBER_SIZE = 8
SEAL_DIGEST_SIZE = 16
SEAL_SIZE = SEAL_NUMBER_SIZE + SEAL_DIGEST_SIZE  # see FrameMac
PIECE = 1 << 30  # the most bytes of a buffer one GMAC of a seal covers (see Seal) ...
STREAM_PIECE = 1 << 18  # ... and of a seal that trails its buffers: small enough that
# a frame of a megabyte has pieces to MAC on one end while the wire and the other end
# carry and check the ones before (BENCHMARKS.md, "Two hosts")
# The index of the first piece of a striped frame's second part (see FrameMac.stripe_seal):
# above any index its first part reaches, so no two pieces of a frame share a nonce.
STRIPE_INDEX = 1 << 31


@dataclasses.dataclass(frozen=True)
class Hello:
    rank: int
    features: int
    nonce: bytes
    incarnation: int = 0


def _mac(secret: bytes, label: bytes, first: bytes, second: bytes, client_rank: int,
         server_rank: int, client_features: int, server_features: int, binding: bytes,
         client_incarnation: int = 0, server_incarnation: int = 0,
         server_address: Tuple[str, int] = ("", 0)) -> bytes:
    host = server_address[0].encode("utf-8", "surrogateescape")
    msg = b"".join((label, first, second,
                    struct.pack("<iiBQQQQII", client_rank, server_rank, VERSION, client_features,
                                server_features, client_incarnation, server_incarnation,
                                server_address[1], len(host)), host, binding))
    return hmac.new(secret, msg, hashlib.sha256).digest()


def make_hello(rank: int, features: int, incarnation: int = 0) -> tuple[bytes, bytes]:
    """Client: return (HELLO bytes, nonce to remember)."""
    nonce = os.urandom(NONCE)
    return HELLO.pack(MAGIC, VERSION, rank, features, nonce, incarnation), nonce


def parse_hello(data: bytes) -> Hello:
    """Server: validate a HELLO."""
    if len(data) != HELLO.size:
        raise AuthenticationError(f"short handshake: {len(data)} of {HELLO.size} bytes")
    magic, version, rank, features, nonce, incarnation = HELLO.unpack(data)
    if magic != MAGIC:
        raise AuthenticationError(f"not a torchrpc handshake (magic {magic!r})")
    if version != VERSION:
        raise AuthenticationError(f"handshake version {version}, this worker speaks {VERSION}")
    return Hello(rank, features, nonce, incarnation)


def make_challenge(secret: bytes, hello: Hello, server_rank: int, features: int,
                   binding: bytes = b"", server_incarnation: int = 0,
                   server_address: Tuple[str, int] = ("", 0)) -> tuple[bytes, bytes]:
    """Server: return (CHALLENGE bytes, server nonce to remember). ``server_incarnation``
    and ``server_address`` are this worker's own, as it published them."""
    nonce = os.urandom(NONCE)
    mac = _mac(secret, b"srv", hello.nonce, nonce, hello.rank, server_rank, hello.features,
               features, binding, hello.incarnation, server_incarnation, server_address)
    return CHALLENGE.pack(server_rank, features, nonce, mac), nonce


def answer_challenge(secret: bytes, data: bytes, client_rank: int, client_nonce: bytes,
                     expected_server_rank: int | None, client_features: int = 0,
                     binding: bytes = b"", client_incarnation: int = 0,
                     server_incarnation: int = 0,
                     server_address: Tuple[str, int] = ("", 0)) -> tuple[bytes, int, int]:
    """Client: check the server's MAC; return (PROOF bytes, server rank, server features).
    ``client_features`` are the features the HELLO offered; ``server_incarnation`` and
    ``server_address`` those of the worker the client meant to reach, the address as
    dialed."""
    if len(data) != CHALLENGE.size:
        raise AuthenticationError(f"short handshake reply: {len(data)} of {CHALLENGE.size} bytes")
    server_rank, features, nonce, mac = CHALLENGE.unpack(data)
    if expected_server_rank is not None and server_rank != expected_server_rank:
        raise AuthenticationError(
            f"connected to rank {server_rank}, expected rank {expected_server_rank}")
    want = _mac(secret, b"srv", client_nonce, nonce, client_rank, server_rank, client_features,
                features, binding, client_incarnation, server_incarnation, server_address)
    if not hmac.compare_digest(mac, want):
        host, port = server_address
        raise AuthenticationError(
            f"the server failed authentication as rank {server_rank} (incarnation "
            f"{server_incarnation}) listening at {host}:{port}: it holds another job secret, "
            f"or it is a relay or another process at that address (a forged or stale "
            f"address), or the handshake or TLS session was tampered with")
    proof = _mac(secret, b"cli", nonce, client_nonce, client_rank, server_rank, client_features,
                 features, binding, client_incarnation, server_incarnation, server_address)
    return PROOF.pack(proof), server_rank, features


def check_proof(secret: bytes, data: bytes, hello: Hello, server_nonce: bytes,
                server_rank: int, server_features: int = 0, binding: bytes = b"",
                server_incarnation: int = 0,
                server_address: Tuple[str, int] = ("", 0)) -> None:
    """Server: check the client's PROOF (``server_features`` as the CHALLENGE sent them;
    ``server_incarnation`` and ``server_address`` as :func:`make_challenge` had them)."""
    if len(data) != PROOF.size:
        raise AuthenticationError(f"short handshake proof: {len(data)} of {PROOF.size} bytes")
    want = _mac(secret, b"cli", server_nonce, hello.nonce, hello.rank, server_rank,
                hello.features, server_features, binding, hello.incarnation,
                server_incarnation, server_address)
    if not hmac.compare_digest(data, want):
        raise AuthenticationError(
            f"peer claiming rank {hello.rank} failed authentication: wrong job secret, or "
            f"the handshake or TLS session was tampered with")


def frame_keys(secret: bytes, client_nonce: bytes, server_nonce: bytes, client_rank: int,
               server_rank: int) -> tuple[bytes, bytes]:
    """The keys of the frames' MACs on one connection: (client to server, server to
    client), fresh for every connection since both nonces are."""
    def key(label: bytes) -> bytes:
        return _mac(secret, label, client_nonce, server_nonce, client_rank, server_rank, 0, 0,
                    b"")
    return key(b"frames c2s"), key(b"frames s2c")


class FrameMac:
    """The MACs of one direction of a connection.

    The frame's tag: keyed BLAKE2b over a sequence number, the frame's header (with its
    length table), its envelope and, where buffers are covered, the seal's number (and,
    without ``trailer``, its digest). The sequence number is implicit (both sides count),
    so a dropped, replayed or reordered frame fails too.

    With ``buffers`` (``FEATURE_TENSOR_MAC``), a frame with out-of-band buffers carries a
    seal of the bytes it sends as its buffers (:class:`Seal`): a number the sender draws
    (8 bytes, never the same twice on a direction), which keys the seal's GMACs, and a
    16-byte digest of the GMAC tags of those bytes. The frame's tag covers the number,
    so a seal cannot move to another frame.

    Where the seal lies is the ``trailer``'s choice (``FEATURE_SEAL_TRAILER``), made here
    once for the connection: without it, number and digest precede the tag, so the
    sender MACs every buffer before the first byte leaves (:meth:`seal`) and the receiver
    after the last one came; with it, the number precedes the tag and the digest follows
    the buffers, which are MAC'd in pieces of :data:`STREAM_PIECE` bytes as they go out
    and as they come in (:meth:`open_seal`), each piece while the network carries the
    one before it.
    """

    __slots__ = ("_keyed", "_seq", "_gmac", "_numbers", "buffers", "trailer", "front")

    def __init__(self, key: bytes, buffers: bool = False, trailer: bool = False) -> None:
        self._keyed = hashlib.blake2b(key=key, digest_size=FRAME_MAC_SIZE)  # copied per frame
        self._seq = 0
        self._gmac = AESGCM(hashlib.blake2b(key=key, digest_size=32,
                                            person=b"trpc buffers").digest())
        self._numbers = itertools.count()  # its next() is atomic: senders share it
        self.buffers = buffers
        self.trailer = buffers and trailer
        # The seal's bytes between a frame's envelope and its tag, where it has buffers.
        self.front = 0 if not buffers else SEAL_NUMBER_SIZE if trailer else SEAL_SIZE

    def tag(self, *parts: Any) -> bytes:
        """The tag of the next frame, made of ``parts``; advances the sequence."""
        h = self._keyed.copy()
        h.update(self._seq.to_bytes(8, "little"))
        for part in parts:
            h.update(part)
        self._seq += 1
        return h.digest()

    def seal(self, data: Sequence[Any]) -> bytes:
        """Sender, without ``trailer``: the seal (:data:`SEAL_SIZE` bytes) of the bytes
        ``data`` puts on the stream, buffer by buffer; any thread may call it."""
        check = self.open_seal()
        for part in data:
            check.update(part)
        return check.number + check.digest()

    def open_seal(self) -> "Seal":
        """Sender: a fresh :class:`Seal` of a frame's buffers, under a number of its own
        (``Seal.number``, for the frame's tag); any thread may call it."""
        return Seal(self._gmac, next(self._numbers).to_bytes(SEAL_NUMBER_SIZE, "little"),
                    STREAM_PIECE if self.trailer else PIECE)

    def unseal(self, seal: bytes) -> Tuple["Seal", bytes]:
        """Receiver: (a :class:`Seal` to ``update`` with each buffer's bytes as they
        arrive, the digest it must come to, empty with ``trailer``: the frame's last
        :data:`SEAL_DIGEST_SIZE` bytes) of a frame whose tag covered ``seal`` (its
        :attr:`front` bytes)."""
        number = seal[:SEAL_NUMBER_SIZE]
        return (Seal(self._gmac, number, STREAM_PIECE if self.trailer else PIECE),
                seal[SEAL_NUMBER_SIZE:])

    def stripe_seal(self, number: bytes) -> "Seal":
        """Sender and receiver: the seal of the second part of a striped frame whose seal
        is numbered ``number`` (see stripe.py): the same key and number, its pieces
        indexed from :data:`STRIPE_INDEX`."""
        return Seal(self._gmac, number, STREAM_PIECE, STRIPE_INDEX)


class Seal:
    """The seal of a frame's buffers, fed buffer by buffer: each buffer's bytes in
    pieces of at most ``piece`` bytes from its start (:data:`PIECE`, since AES-GCM takes
    less than 2 GiB at once, or :data:`STREAM_PIECE` for a seal that trails its
    buffers), each piece MAC'd with GMAC (AES-GCM with nothing to encrypt) under the
    direction's key and a nonce of its own (the seal's number and the piece's index),
    and the tags hashed in order.

    GMAC, because it is faster than BLAKE2b or HMAC-SHA256 where the CPU multiplies
    carry-less (docs/security.md has the figures). Each call releases the GIL.
    """

    __slots__ = ("_gmac", "number", "piece", "_index", "_tags")

    def __init__(self, gmac: AESGCM, number: bytes, piece: int = PIECE,
                 first_index: int = 0) -> None:
        self._gmac = gmac
        self.number = number
        self.piece = piece
        self._index = first_index
        self._tags = hashlib.blake2b(digest_size=SEAL_DIGEST_SIZE)

    def update(self, data: Any) -> None:
        """MAC ``data`` (any contiguous buffer), in pieces of at most :attr:`piece`
        bytes. A buffer may be fed in several calls, each but its last a whole number of
        pieces."""
        view = memoryview(data)
        if view.format != "B" or view.ndim != 1:
            view = view.cast("B")
        encrypt, update, number, piece = (self._gmac.encrypt, self._tags.update,
                                          self.number, self.piece)
        for i in range(0, len(view), piece):
            update(encrypt(number + self._index.to_bytes(4, "little"), b"", view[i:i + piece]))
            self._index += 1

    def digest(self) -> bytes:
        return self._tags.digest()
