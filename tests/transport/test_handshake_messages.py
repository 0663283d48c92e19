"""The handshake as messages, with no sockets: both sides' steps run back to back."""

from __future__ import annotations

import pytest

from torchrpc._transport import handshake as hs
from torchrpc.errors import AuthenticationError

SECRET = b"s" * 32


ADDRESS = ("10.0.0.1", 29500)


def _run(client_secret=SECRET, server_secret=SECRET, client_rank=1, server_rank=0,
         client_features=hs.FEATURE_SHM | hs.FEATURE_FRAME_MAC, server_features=hs.FEATURE_SHM,
         expected_server=0, tamper=lambda name, data: data, client_binding=b"",
         server_binding=b"", incarnation=0, server_incarnation=5, meant_incarnation=5,
         server_address=ADDRESS, dialed=ADDRESS):
    """One handshake; ``tamper(step, bytes)`` may change each message on the way. The
    server is process ``server_incarnation`` listening at ``server_address``; the client
    means process ``meant_incarnation`` and dialed ``dialed``."""
    hello, c_nonce = hs.make_hello(client_rank, client_features, incarnation)
    seen = hs.parse_hello(tamper("hello", hello))
    challenge, s_nonce = hs.make_challenge(server_secret, seen, server_rank, server_features,
                                           server_binding, server_incarnation, server_address)
    proof, got_rank, got_features = hs.answer_challenge(
        client_secret, tamper("challenge", challenge), client_rank, c_nonce, expected_server,
        client_features, client_binding, incarnation, meant_incarnation, dialed)
    hs.check_proof(server_secret, tamper("proof", proof), seen, s_nonce, server_rank,
                   server_features, server_binding, server_incarnation, server_address)
    return seen, got_rank, got_features, (c_nonce, s_nonce)


def test_both_sides_agree_and_learn_each_other():
    seen, rank, features, (c_nonce, s_nonce) = _run(incarnation=7)
    assert (seen.rank, seen.features, seen.incarnation) == \
        (1, hs.FEATURE_SHM | hs.FEATURE_FRAME_MAC, 7)
    assert (rank, features) == (0, hs.FEATURE_SHM)
    # Frame keys: the client's sending key is the server's receiving one, and back.
    c2s, s2c = hs.frame_keys(SECRET, c_nonce, s_nonce, 1, 0)
    assert c2s != s2c
    assert hs.frame_keys(SECRET, c_nonce, s_nonce, 1, 0) == (c2s, s2c)
    assert hs.frame_keys(b"x" * 32, c_nonce, s_nonce, 1, 0)[0] != c2s


def test_every_handshake_has_fresh_nonces_and_keys():
    keys = {hs.frame_keys(SECRET, *_run()[3], 1, 0) for _ in range(3)}
    assert len(keys) == 3


def test_a_wrong_secret_fails_on_both_sides():
    with pytest.raises(AuthenticationError, match="the server failed authentication"):
        _run(client_secret=b"t" * 32)
    # A client that skipped the server's check still cannot prove itself.
    hello, c_nonce = hs.make_hello(1, 0)
    seen = hs.parse_hello(hello)
    challenge, s_nonce = hs.make_challenge(SECRET, seen, 0, 0)
    forged = hs.answer_challenge(b"t" * 32, hs.CHALLENGE.pack(
        *hs.CHALLENGE.unpack(challenge)[:3], hs._mac(b"t" * 32, b"srv", c_nonce, s_nonce, 1, 0,
                                                      0, 0, b"")), 1, c_nonce, 0)[0]
    with pytest.raises(AuthenticationError, match="claiming rank 1 failed authentication"):
        hs.check_proof(SECRET, forged, seen, s_nonce, 0)


@pytest.mark.parametrize("step,offset", [("hello", 8), ("hello", 12), ("challenge", 4),
                                         ("challenge", 20)])
def test_a_changed_rank_feature_or_nonce_fails(step, offset):
    def flip(name, data):
        if name != step:
            return data
        b = bytearray(data)
        b[offset] ^= 1
        return bytes(b)
    with pytest.raises(AuthenticationError):
        _run(tamper=flip, expected_server=None)


def test_the_wrong_server_rank_and_a_different_tls_binding_fail():
    with pytest.raises(AuthenticationError, match="connected to rank 0, expected rank 3"):
        _run(expected_server=3)
    with pytest.raises(AuthenticationError, match="server failed authentication"):
        _run(client_binding=b"cert A", server_binding=b"cert B")
    _run(client_binding=b"cert A", server_binding=b"cert A")


def test_a_proof_does_not_replay_into_another_handshake():
    hello, c_nonce = hs.make_hello(1, 0)
    seen = hs.parse_hello(hello)
    first, s1 = hs.make_challenge(SECRET, seen, 0, 0)
    proof = hs.answer_challenge(SECRET, first, 1, c_nonce, 0)[0]
    _, s2 = hs.make_challenge(SECRET, seen, 0, 0)  # the same HELLO sent again
    with pytest.raises(AuthenticationError):
        hs.check_proof(SECRET, proof, seen, s2, 0)
    hs.check_proof(SECRET, proof, seen, s1, 0)


@pytest.mark.parametrize("data,match", [
    (b"", "short handshake: 0 of"),
    (b"GET / HTTP/1.1\r\n" + b"x" * 100, "short handshake"),
    (hs.HELLO.pack(b"HTTP", 1, 0, 0, b"n" * 16, 0), "not a torchrpc handshake"),
    (hs.HELLO.pack(hs.MAGIC, 9, 0, 0, b"n" * 16, 0), "handshake version 9"),
])
def test_garbage_hellos_are_refused_by_size_magic_and_version(data, match):
    with pytest.raises(AuthenticationError, match=match):
        hs.parse_hello(data)


def test_short_challenges_and_proofs_are_refused():
    hello, c_nonce = hs.make_hello(1, 0)
    with pytest.raises(AuthenticationError, match="short handshake reply"):
        hs.answer_challenge(SECRET, b"x" * 10, 1, c_nonce, 0)
    with pytest.raises(AuthenticationError, match="short handshake proof"):
        hs.check_proof(SECRET, b"x" * 10, hs.parse_hello(hello), b"n" * 16, 0)


def test_frame_macs_count_frames_so_drops_replays_and_reorders_fail():
    key = b"k" * 32
    tx, rx = hs.FrameMac(key), hs.FrameMac(key)
    tags = [tx.tag(b"head%d" % i, b"envelope") for i in range(3)]
    assert rx.tag(b"head0", b"envelope") == tags[0]
    assert rx.tag(b"head2", b"envelope") != tags[2]  # frame 1 was dropped
    replay = hs.FrameMac(key)
    replay.tag(b"head0", b"envelope")
    assert replay.tag(b"head0", b"envelope") != tags[0]  # frame 0 again, as frame 1
    assert len(tags[0]) == hs.FRAME_MAC_SIZE
    assert hs.FrameMac(b"j" * 32).tag(b"head0", b"envelope") != tags[0]


@pytest.mark.parametrize("server", [
    dict(server_address=("10.0.0.9", 29500)),  # a relay: the dialer dialed another address
    dict(server_address=("10.0.0.1", 29501)),
    dict(server_address=("10.0.0.10", 29500)),  # no ambiguity of host and port
    dict(server_incarnation=6),  # another process under the rank (a restarted worker)
])
def test_the_responder_proves_the_incarnation_and_address_the_dialer_meant(server):
    with pytest.raises(AuthenticationError,
                       match=r"failed authentication as rank 0 \(incarnation 5\) listening at "
                             r"10\.0\.0\.1:29500: .* a relay"):
        _run(**server)
    _run()  # the same handshake, with the worker the dialer meant, passes


def test_a_proof_made_for_another_address_does_not_pass_the_server():
    # A client that skipped the check of the server's MAC (or a relay answering for it)
    # cannot make a PROOF that passes a server at another address.
    hello, c_nonce = hs.make_hello(1, 0)
    seen = hs.parse_hello(hello)
    challenge, s_nonce = hs.make_challenge(SECRET, seen, 0, 0, b"", 5, ADDRESS)
    _, _, nonce, _ = hs.CHALLENGE.unpack(challenge)
    proof = hs._mac(SECRET, b"cli", nonce, c_nonce, 1, 0, 0, 0, b"", 0, 5, ("10.0.0.9", 29500))
    with pytest.raises(AuthenticationError, match="claiming rank 1 failed authentication"):
        hs.check_proof(SECRET, proof, seen, s_nonce, 0, 0, b"", 5, ADDRESS)


def test_a_seal_covers_every_byte_of_the_buffers_and_is_bound_to_its_frame():
    key = b"k" * 32
    tx, rx = hs.FrameMac(key, buffers=True), hs.FrameMac(key, buffers=True)
    data = [bytes(range(256)) * 40, memoryview(bytearray(b"\x07" * 1000))]
    seal = tx.seal(data)
    assert len(seal) == hs.SEAL_SIZE
    tag = tx.tag(b"head", b"envelope", seal)
    assert rx.tag(b"head", b"envelope", seal) == tag  # the frame's tag covers the seal
    mac, want = rx.unseal(seal)
    for part in data:
        mac.update(part)
    assert mac.digest() == want
    # One byte changed, anywhere in any buffer, or the buffers cut differently but the
    # bytes moved: the tag differs (the lengths are covered by the frame's tag).
    for i, j in [(0, 0), (0, 10239), (1, 500)]:
        changed = [bytearray(p) for p in data]
        changed[i][j] ^= 1
        mac, want = hs.FrameMac(key, buffers=True).unseal(seal)
        for part in changed:
            mac.update(part)
        assert mac.digest() != want
    # Every seal has a fresh one-time key: the same bytes seal differently.
    again = tx.seal(data)
    assert again[:8] != seal[:8] and again[8:] != seal[8:]
    # A seal moved onto another frame fails that frame's tag.
    assert rx.tag(b"head", b"envelope", seal) != tx.tag(b"head", b"envelope", again)
    # Another key (another connection or direction) opens none of it.
    mac, want = hs.FrameMac(b"j" * 32, buffers=True).unseal(seal)
    for part in data:
        mac.update(part)
    assert mac.digest() != want


def test_a_seal_of_a_buffer_fed_in_pieces_equals_the_senders(monkeypatch):
    monkeypatch.setattr(hs, "PIECE", 1000)  # pieces small enough to test on bytes
    key = b"k" * 32
    big = bytes(range(256)) * 15
    seal = hs.FrameMac(key, buffers=True).seal([memoryview(big), b"tail"])
    mac, want = hs.FrameMac(key, buffers=True).unseal(seal)
    for i in range(0, len(big), hs.PIECE):  # slices that end on piece boundaries
        mac.update(memoryview(big)[i:i + hs.PIECE])
    mac.update(b"tail")
    assert mac.digest() == want
    # The same bytes cut into other buffers (the lengths say which) seal differently.
    mac, want = hs.FrameMac(key, buffers=True).unseal(seal)
    mac.update(big + b"tail")
    assert mac.digest() != want
