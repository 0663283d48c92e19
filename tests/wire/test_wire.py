"""The wire layer on bytes alone: tensor round trips through whole frames, hostile input.

No sockets and no processes: every round trip goes ``encode`` -> frame bytes ->
``FrameDecoder`` -> ``decode``. The decoder (``tests/support/frames.py``) feeds the bytes
to the transport's own frame reader, so the frames and their buffers (a fresh aligned
uint8 tensor each) are what a worker reads off a socket.
"""

from __future__ import annotations

import collections
import dataclasses
import pickle
import random
import struct
from typing import Any, List, Tuple

import pytest
import torch

from torchrpc import _wire
from torchrpc._transport import handshake
from torchrpc._wire import Kind
from torchrpc.errors import ProtocolError

from ..support.frames import Frame, FrameDecoder, ShmRef, macs_around

# ----------------------------------------------------------------------------------------
# helpers


def frame_bytes(obj: Any, kind: int = Kind.CALL, rid: int = 7) -> Tuple[bytes, int]:
    """The whole frame for ``obj`` and the number of buffer bytes in it."""
    env, bufs, _ = _wire.encode(obj)
    head = _wire.pack_header(kind, 0, rid, len(env), [len(b) for b in bufs])
    body = b"".join(bytes(b) for b in bufs)
    return head + env + body, len(body)


def receive(frame: Frame) -> List[torch.Tensor]:
    """The buffers of ``frame``, as the reader received them."""
    for b in frame.buffers:
        assert isinstance(b, torch.Tensor) and b.dtype == torch.uint8 and b.dim() == 1
    return list(frame.buffers)


def round_trip(obj: Any) -> Any:
    data, _ = frame_bytes(obj)
    dec = FrameDecoder()
    frames = dec.feed(data)
    assert len(frames) == 1 and dec.pending == 0
    meta, value = _wire.decode(frames[0].envelope, receive(frames[0]))
    assert meta is None
    return value


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t``'s elements in logical order (NaNs compare equal)."""
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def assert_same(a: torch.Tensor, b: torch.Tensor, strides: bool = True) -> None:
    assert type(a) is type(b)
    assert a.dtype == b.dtype and a.shape == b.shape and a.requires_grad == b.requires_grad
    if strides and a.numel() > 1:
        assert a.stride() == b.stride()
    assert torch.equal(raw(a), raw(b))


# ----------------------------------------------------------------------------------------
# round trips

DTYPES = [torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128] + [d for d in (getattr(torch, n, None) for n in
                                            ("uint16", "uint32", "uint64")) if d is not None]


def sample(dtype: torch.dtype, shape: Tuple[int, ...], seed: int = 0) -> torch.Tensor:
    """Random bytes of every bit pattern (NaNs, infinities, denormals included)."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    data = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        data = data % 2
    return data.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_dtype_round_trips_exactly(dtype):
    for shape in [(), (1,), (7,), (3, 5), (2, 3, 4)]:
        x = sample(dtype, shape, seed=len(shape))
        assert_same(round_trip(x), x)
    x = sample(dtype, (6, 8), seed=3)
    assert_same(round_trip(x.t()), x.t())
    assert_same(round_trip(x[1:5, 2:7]), x[1:5, 2:7])


def test_non_contiguous_tensors():
    x = torch.randn(8, 9, 10)
    cases = {
        "transpose": x.transpose(0, 2),
        "permute": x.permute(1, 2, 0),
        "narrow": x.narrow(1, 3, 4),
        "step": x[:, ::2, 1::3],
        "sparse step": x.reshape(-1)[::7],
        "expand": torch.randn(1, 5).expand(4, 5),
        "diagonal": x[0].diagonal(),
        "unfold (overlapping)": torch.arange(20.0).unfold(0, 5, 2),
        "channels_last": torch.randn(2, 3, 4, 5).to(memory_format=torch.channels_last),
        "conj": torch.randn(4, dtype=torch.complex64).conj(),
        "neg bit": torch.randn(4, dtype=torch.complex128).conj().imag,
    }
    for name, t in cases.items():
        out = round_trip(t)
        # Dense layouts keep their strides; sparse ones arrive compacted.
        assert_same(out, t, strides=name in ("transpose", "permute", "channels_last")), name


def test_zero_size_tensors():
    big = torch.arange(1000.0)
    for t in [torch.empty(0), torch.empty(3, 0), torch.empty(0, 5, dtype=torch.int16),
              big[500:500], big.reshape(10, 100)[:, 7:7], torch.empty(0, dtype=torch.complex128)]:
        data, nbuf = frame_bytes(t)
        assert nbuf == 0
        assert_same(round_trip(t), t, strides=False)


@dataclasses.dataclass(frozen=True)
class Inner:
    weight: torch.Tensor
    tags: Tuple[str, ...]


@dataclasses.dataclass
class Outer:
    name: str
    inner: Inner
    extras: List[Any]


Point = collections.namedtuple("Point", "x y")


def test_nested_containers_and_dataclasses():
    a, b = torch.randn(3, 3), torch.arange(5)
    obj = {
        "list": [a, (b, [a.t(), {"deep": b[1:3]}])],
        "outer": Outer("o", Inner(a, ("x", "y")), [b, None, 3.5]),
        "point": Point(a[0], torch.tensor(True)),
        "ordered": collections.OrderedDict(k=torch.zeros(2, dtype=torch.bfloat16)),
        "same": (a, a),
    }
    out = round_trip(obj)
    assert_same(out["list"][0], a)
    assert_same(out["list"][1][0], b)
    assert_same(out["list"][1][1][0], a.t())
    assert_same(out["list"][1][1][1]["deep"], b[1:3])
    assert isinstance(out["outer"], Outer) and isinstance(out["outer"].inner, Inner)
    assert_same(out["outer"].inner.weight, a)
    assert out["outer"].inner.tags == ("x", "y") and out["outer"].extras[1:] == [None, 3.5]
    assert isinstance(out["point"], Point) and out["point"].y.item() is True
    assert list(out["ordered"]) == ["k"] and out["ordered"]["k"].dtype == torch.bfloat16
    assert out["same"][0] is out["same"][1]  # one object stays one object


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
def test_sparse_tensors():
    i = torch.tensor([[0, 1, 1, 0], [2, 0, 2, 2]])
    v = torch.tensor([3.0, 4.0, 5.0, 6.0])  # (0, 2) twice: not coalesced
    coo = torch.sparse_coo_tensor(i, v, (2, 3), check_invariants=True)
    for t in [coo, coo.coalesce(),
              torch.sparse_coo_tensor(i, torch.randn(4, 2), (2, 3, 2), check_invariants=True),
              torch.sparse_coo_tensor(torch.empty(2, 0, dtype=torch.long), torch.empty(0), (4, 4),
                                      check_invariants=True),
              torch.randn(3, 3).to_sparse().to(torch.complex64)]:
        out = round_trip(t)
        assert out.layout == torch.sparse_coo and out.is_coalesced() == t.is_coalesced()
        assert out.dtype == t.dtype and out.shape == t.shape
        assert torch.equal(out._indices(), t._indices()) and torch.equal(out._values(), t._values())
        assert torch.equal(out.to_dense(), t.to_dense())
    csr = torch.tensor([[0.0, 1.0], [2.0, 0.0]]).to_sparse_csr()
    out = round_trip(csr)
    assert out.layout == torch.sparse_csr and torch.equal(out.to_dense(), csr.to_dense())


def test_small_tensors_travel_inside_the_envelope():
    cases = [torch.arange(2.0), torch.tensor(3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.bool),
             torch.randn(4, dtype=torch.complex64), torch.randn(2, 2).to(torch.bfloat16),
             torch.arange(_wire.INLINE_MAX // 4, dtype=torch.float32)]
    for t in cases:
        env, bufs, _ = _wire.encode(t)
        assert bufs == [], t
        out = _wire.decode(env, [])[1]
        assert out.dtype == t.dtype and out.shape == t.shape and torch.equal(out, t)
        out.add_(1) if t.dtype != torch.bool else out.logical_not_()  # writable, its own memory
        assert not torch.equal(out, t)
        with pytest.raises(RuntimeError, match="not resizable"):  # as docs/porting.md says
            out.resize_(t.numel() + 10)
    big = torch.arange(_wire.INLINE_MAX // 4 + 1, dtype=torch.float32)
    assert len(_wire.encode(big)[1]) == 1  # one element more: out of band
    # The bound is the encoder's to choose (the agent lowers it for peers on plain TCP).
    env, bufs, _ = _wire.encode(torch.randn(64, 10), inline_max=512)
    assert len(bufs) == 1 and _wire.encode(torch.randn(64, 10))[1] == []
    assert _wire.encode(torch.arange(128.0), inline_max=512)[1] == []
    # The bound is on a message's inline bytes together: the envelope stays small.
    quarter = [torch.full((_wire.INLINE_MAX // 16,), float(i)) for i in range(5)]
    env, bufs, _ = _wire.encode(quarter)
    assert len(bufs) == 1 and len(env) < _wire.INLINE_MAX + 1024
    out = _wire.decode(env, [torch.frombuffer(bytearray(bufs[0]), dtype=torch.uint8)])[1]
    assert all(torch.equal(a, b) for a, b in zip(out, quarter))


def test_a_small_tensor_with_strides_of_its_own_keeps_them():
    # Contiguous by torch's rule (dims of size 1 may have any stride), not by its strides.
    for t in (torch.tensor([[True, False]]).t(), torch.arange(3.0).view(3, 1).expand(3, 1)):
        assert t.is_contiguous()
        out = round_trip(t)
        assert out.stride() == t.stride() and torch.equal(out, t)


def test_small_views_of_one_storage_still_arrive_shared():
    x = torch.arange(8.0)
    env, bufs, _ = _wire.encode((x[:2], x[2:4], x))
    assert len(bufs) == 1  # not inline: one slot keeps them views of one storage
    a, b, whole = _wire.decode(env, [torch.frombuffer(bytearray(bufs[0]), dtype=torch.uint8)])[1]
    whole[0] = 100.0
    assert a[0] == 100.0 and torch.equal(b, x[2:4])
    assert a.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()


def test_an_inline_tensor_that_requires_grad_meets_the_receive_hook():
    t = torch.ones(2, requires_grad=True)
    sent, received = [], []
    env, bufs, _ = _wire.encode(t, send_hook=sent.append)
    assert bufs == [] and sent == [t]

    def hook(x):
        received.append(x)
        return x * 2
    out = _wire.decode(env, [], recv_hook=lambda meta: hook)[1]
    assert len(received) == 1 and received[0].requires_grad and torch.equal(out, t * 2)


def test_an_inline_tensor_whose_bytes_do_not_match_its_shape_is_rejected():
    env, _, _ = _wire.encode(torch.arange(4.0))
    bad = env.replace(bytes(torch.arange(4.0).numpy().tobytes()), b"\0" * 12)
    with pytest.raises(Exception) as info:
        _wire.decode(bad, [])
    assert not isinstance(info.value, SystemError)
    # A shape that claims more than the bytes (or negative sizes whose product fits) is
    # refused, and allocates nothing: the tensor's memory is sized by the bytes.
    def ops(shape):  # the pickle opcodes that build the tuple ``shape``
        code = pickle.dumps(shape, protocol=5)[2:]
        return (code[9:] if code[:1] == pickle.FRAME else code).rstrip(b".").rstrip(b"\x94")
    for shape in [(2 ** 40,), (2 ** 20, 2 ** 20), (-2, -2), (-4,), (2, 3)]:
        claimed = env.replace(ops((4,)), ops(shape))
        assert claimed != env, shape
        with pytest.raises(ValueError, match="malformed inline tensor"):
            _wire.decode(claimed, [])


def test_shared_storages_arrive_shared():
    x = torch.arange(100.0)
    a, b, c = x[10:20], x[15:40], x[5:8].view(1, 3)
    data, nbuf = frame_bytes((a, b, c))
    frames = FrameDecoder().feed(data)
    assert frames[0].header.nbuffers == 1  # one storage, one buffer
    assert nbuf <= (40 - 5) * 4 + 16  # the union of the views, not the storage
    oa, ob, oc = _wire.decode(frames[0].envelope, receive(frames[0]))[1]
    assert oa.untyped_storage().data_ptr() == ob.untyped_storage().data_ptr() \
        == oc.untyped_storage().data_ptr()
    assert torch.equal(oa, a) and torch.equal(ob, b) and torch.equal(oc, c)
    oa[7] = -1.0  # x[17] is b[2] too
    assert ob[2].item() == -1.0
    # A later view that reaches beyond the first one still shares one buffer.
    y = torch.arange(50.0)
    oy = round_trip((y[:5], y[40:], y))
    assert oy[0].untyped_storage().data_ptr() == oy[2].untyped_storage().data_ptr()
    oy[2][45] = 9.0
    assert oy[1][5].item() == 9.0


def test_views_send_only_the_elements_they_cover():
    x = torch.zeros(1 << 20)  # 4 MiB of storage
    data, nbuf = frame_bytes(x[1000:1010])
    assert nbuf <= 10 * 4 + 16 and len(data) < 1024
    data, nbuf = frame_bytes(x[::1024])  # 1024 elements spread over the whole storage
    assert nbuf == 1024 * 4 and len(data) < 8 * 1024
    data, nbuf = frame_bytes(x.view(1024, 1024)[:, :2])  # 2 of every 1024 columns
    assert nbuf == 2048 * 4
    data, nbuf = frame_bytes(x)
    assert nbuf == 4 << 20


def test_requires_grad_and_parameters():
    w = torch.nn.Parameter(torch.randn(3))
    t = torch.randn(2, requires_grad=True)
    out_w, out_t, out_d = round_trip((w, t, t.detach()))
    assert isinstance(out_w, torch.nn.Parameter) and out_w.requires_grad
    assert torch.equal(out_w.data, w.data)
    assert out_t.requires_grad and not out_d.requires_grad and out_t.is_leaf


def test_frames_decode_byte_by_byte_and_back_to_back():
    frames = [frame_bytes({"i": i, "t": torch.full((i,), float(i))}, rid=i)[0] for i in range(5)]
    stream = b"".join(frames)
    dec = FrameDecoder()
    got = []
    for i in range(len(stream)):
        got.extend(dec.feed(stream[i:i + 1]))
    assert [f.header.request_id for f in got] == list(range(5)) and dec.pending == 0
    again = FrameDecoder().feed(stream)
    assert [f.envelope for f in again] == [f.envelope for f in got]
    for i, f in enumerate(got):
        value = _wire.decode(f.envelope, receive(f))[1]
        assert value["i"] == i and torch.equal(value["t"], torch.full((i,), float(i)))


def test_shared_memory_references_in_frames():
    name = "torchrpc-1-2-abcd-3"
    env, _, _ = _wire.encode(("x",))
    lengths = [5, (1 << 20) | _wire.SHM_BIT]
    data = (_wire.pack_header(Kind.CALL, _wire.FLAG_SHM, 1, len(env), lengths) + env
            + b"12345" + _wire.pack_shm_ref(name))
    with pytest.raises(ProtocolError, match="did not negotiate shared memory"):
        FrameDecoder().feed(data)
    (frame,) = FrameDecoder(shm=True).feed(data)
    assert bytes(frame.buffers[0].numpy()) == b"12345"
    assert frame.buffers[1] == ShmRef(name, 1 << 20)
    assert len(_wire.pack_shm_ref(name)) == _wire.SHM_REF_SIZE
    for bad in ["", "../etc", "a/b", ".hidden", "x" * 65, "é"]:
        with pytest.raises(ValueError):
            _wire.pack_shm_ref(bad)


# ----------------------------------------------------------------------------------------
# hostile and truncated input


def header(kind=Kind.CALL, flags=0, rid=1, env=10, nbufs=0, magic=b"TRPC", version=1) -> bytes:
    return _wire.frame.HEADER.pack(magic, version, kind, flags, rid, env, nbufs)


@pytest.mark.parametrize("data, match", [
    (header(magic=b"HTTP"), "magic"),
    (header(version=2), "version"),
    (header(kind=99), "kind"),
    (header(flags=0x80), "flags"),
    (header(env=(2 << 30) + 1), "max_message_size"),
    (header(nbufs=(1 << 16) + 1), "buffers exceed"),
])
def test_hostile_headers_fail_on_the_header_alone(data, match):
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match=match):
        dec.feed(data)
    with pytest.raises(ProtocolError, match=match):
        _wire.parse_header(data, _wire.Limits())


def test_every_known_flag_is_accepted_and_kept():
    flags = _wire.FLAG_ONEWAY | _wire.FLAG_ONCE | _wire.FLAG_MANY | _wire.FLAG_STRIPED
    h = _wire.parse_header(header(flags=flags), _wire.Limits())
    assert h.flags == flags and h.oneway
    with pytest.raises(ProtocolError, match="flags"):
        _wire.parse_header(header(flags=_wire.FLAG_STRIPED << 1), _wire.Limits())
    with pytest.raises(ProtocolError, match="both striped and in shared memory"):
        _wire.parse_header(header(flags=_wire.FLAG_STRIPED | _wire.FLAG_SHM), _wire.Limits())


def test_truncated_headers_and_tables():
    with pytest.raises(ProtocolError, match="truncated frame header"):
        _wire.parse_header(header()[:10], _wire.Limits())
    h = _wire.parse_header(header(nbufs=3), _wire.Limits())
    with pytest.raises(ProtocolError, match="truncated length table"):
        _wire.parse_lengths(b"\0" * 16, h, _wire.Limits())
    # A decoder only waits for the rest of a frame that is well formed so far.
    data, _ = frame_bytes(torch.arange(4.0))
    dec = FrameDecoder()
    for cut in range(len(data)):
        assert FrameDecoder().feed(data[:cut]) == []
    assert len(dec.feed(data)) == 1


def test_a_stream_that_ends_inside_a_frame_is_a_truncated_frame():
    data, _ = frame_bytes({"t": torch.arange(1000.0)}, rid=3)  # a buffer on the stream
    assert len(data) > 4000 + _wire.HEADER_SIZE
    for cut in [1, _wire.HEADER_SIZE - 1, _wire.HEADER_SIZE, _wire.HEADER_SIZE + 9,
                len(data) - 4000, len(data) - 1]:  # in the header, table, envelope, buffer
        dec = FrameDecoder()
        assert dec.feed(data + data[:cut]) != [] and dec.pending == cut
        with pytest.raises(ProtocolError, match="truncated frame"):
            dec.end()
    # Ending between frames is a clean end.
    dec = FrameDecoder()
    assert len(dec.feed(data + data)) == 2
    assert dec.end() == [] and dec.pending == 0


def test_large_envelopes_and_buffers_arrive_in_pieces():
    # Past the reader's 256 KiB read buffer: the envelope grows as its bytes come, the
    # buffer is read straight into its tensor.
    big = torch.arange(300_000, dtype=torch.float32)
    blob = bytes(range(256)) * 1400  # in the envelope
    data, nbuf = frame_bytes((blob, big), rid=5)
    assert nbuf == big.numel() * 4 and len(data) - nbuf > 256 * 1024
    dec = FrameDecoder()
    got = []
    for i in range(0, len(data), 100_003):
        got += dec.feed(data[i:i + 100_003])
    (frame,) = got
    assert frame.header.request_id == 5 and dec.pending == 0
    out_blob, out_big = _wire.decode(frame.envelope, receive(frame))[1]
    assert out_blob == blob and torch.equal(out_big, big)


def test_limits_are_enforced_before_allocation():
    limits = _wire.Limits(max_message_size=1 << 20, max_buffers=4)
    dec = FrameDecoder(limits)
    with pytest.raises(ProtocolError, match="exceeds max_message_size"):
        dec.feed(header(env=(1 << 20) + 1))  # only the 24 header bytes have arrived
    dec = FrameDecoder(limits)
    with pytest.raises(ProtocolError, match="exceed the limit"):
        dec.feed(header(nbufs=5))
    # The buffer lengths are added up as soon as the table is in, before any buffer.
    dec = FrameDecoder(limits)
    table = struct.pack("<2Q", 1 << 19, (1 << 19) + 1)
    with pytest.raises(ProtocolError, match="exceeds max_message_size"):
        dec.feed(header(env=0, nbufs=2) + table)
    assert dec.pending == _wire.HEADER_SIZE + 16  # nothing was allocated for the claim
    # Lengths near 2**64 cannot overflow the check.
    dec = FrameDecoder(limits)
    with pytest.raises(ProtocolError):
        dec.feed(header(env=0, nbufs=2) + struct.pack("<2Q", (1 << 63) - 1, (1 << 63) - 1))
    with pytest.raises(ValueError):
        _wire.Limits(max_message_size=0)
    with pytest.raises(ValueError):
        _wire.Limits(max_buffers=0)


def test_shared_memory_bits_are_validated():
    dec = FrameDecoder()
    with pytest.raises(ProtocolError, match="shared-memory bit"):
        dec.feed(header(env=0, nbufs=1) + struct.pack("<Q", 8 | _wire.SHM_BIT))
    for ref in [b"\0" * 64, b"../../etc/passwd".ljust(64, b"\0"), b"a/b".ljust(64, b"\0"),
                b"x" * 64 + b"", b"ok\0junk".ljust(64, b"\0")]:
        data = (header(flags=_wire.FLAG_SHM, env=0, nbufs=1)
                + struct.pack("<Q", 8 | _wire.SHM_BIT) + ref)
        if ref == b"x" * 64:
            assert FrameDecoder(shm=True).feed(data)[0].buffers == [ShmRef("x" * 64, 8)]
            continue
        with pytest.raises(ProtocolError, match="shared-memory reference"):
            FrameDecoder(shm=True).feed(data)
    with pytest.raises(ProtocolError, match="truncated shared-memory reference"):
        _wire.parse_shm_ref(b"abc")


KEY = bytes(range(32))


def mac_frame(mac: handshake.FrameMac, obj: Any, rid: int = 1) -> bytes:
    """The frame of ``obj`` as a connection with MACs sends it: after the envelope, the
    seal of the buffers (where it has any), then the tag."""
    env, bufs, _ = _wire.encode(obj, inline_max=64)
    head = _wire.pack_header(Kind.CALL, 0, rid, len(env), [len(b) for b in bufs])
    return macs_around(mac, head, env, [bytes(b) for b in bufs])


@pytest.mark.parametrize("trailer", [False, True], ids=["seal-in-front", "seal-trailer"])
def test_frames_with_macs_are_checked(trailer):
    def mac(key: bytes = KEY) -> handshake.FrameMac:
        return handshake.FrameMac(key, buffers=True, trailer=trailer)

    tx = mac()
    values = [("call", i, torch.full((100,), float(i))) for i in range(3)] + [("plain",)]
    stream = b"".join(mac_frame(tx, v, rid=i) for i, v in enumerate(values))
    for piece in (len(stream), 7):  # whole, and in pieces that cut every part
        dec = FrameDecoder(mac=mac())
        got = []
        for i in range(0, len(stream), piece):
            got += dec.feed(stream[i:i + piece])
        assert [_wire.decode(f.envelope, receive(f))[1][0] for f in got] \
            == ["call"] * 3 + ["plain"]
        assert torch.equal(_wire.decode(got[2].envelope, receive(got[2]))[1][2],
                           torch.full((100,), 2.0))

    def fresh() -> FrameDecoder:
        return FrameDecoder(mac=mac())

    first = mac_frame(mac(), ("call", torch.ones(100)))
    env_at = _wire.HEADER_SIZE + 8 + 3
    altered = first[:env_at] + bytes([first[env_at] ^ 1]) + first[env_at + 1:]
    with pytest.raises(ProtocolError, match="failed authentication"):
        fresh().feed(altered)
    # The tensor bytes come after the tag: the seal catches them, and its digest too
    # where it trails them.
    last = len(first) - 1 - (handshake.SEAL_DIGEST_SIZE if trailer else 0)
    for at in {last, len(first) - 1}:
        altered = first[:at] + bytes([first[at] ^ 1]) + first[at + 1:]
        with pytest.raises(ProtocolError,
                           match="tensor bytes of a frame .* failed authentication"):
            fresh().feed(altered)
    # A replayed frame fails (the sequence number is implicit), and so does one without
    # MACs or with another key, or with the other place of the seal.
    dec = fresh()
    assert len(dec.feed(first)) == 1
    with pytest.raises(ProtocolError, match="failed authentication"):
        dec.feed(first)
    data, _ = frame_bytes(("plain",))
    with pytest.raises(ProtocolError, match="failed authentication"):
        fresh().feed(data + data)  # the next frame's bytes read as this one's tag
    with pytest.raises(ProtocolError, match="failed authentication"):
        fresh().feed(mac_frame(mac(bytes(32)), ("x",)))
    other = handshake.FrameMac(KEY, buffers=True, trailer=not trailer)
    with pytest.raises(ProtocolError, match="failed authentication"):
        fresh().feed(mac_frame(other, ("call", torch.ones(100))) + bytes(64))


def _sealed_frame(mac: handshake.FrameMac, sizes: List[int]) -> Tuple[bytes, List[bytes]]:
    bufs = [bytes((i * 7 + n) % 251 for i in range(n)) for n in sizes]
    head = _wire.pack_header(Kind.CALL, 0, 1, 1, sizes)
    return macs_around(mac, head, b"e", bufs), bufs


PIECE = handshake.STREAM_PIECE


@pytest.mark.parametrize("sizes", [[PIECE - 1], [PIECE], [PIECE + 1], [2 * PIECE + 3],
                                   [PIECE, 0, 1, PIECE - 1], [0]])
def test_a_trailing_seal_checks_every_piece_of_every_buffer(sizes):
    # The reader MACs a buffer in the seal's pieces as they come: one altered byte at
    # either edge of any piece, or in the last buffer's last byte, fails the frame.
    def mac() -> handshake.FrameMac:
        return handshake.FrameMac(KEY, buffers=True, trailer=True)

    stream, bufs = _sealed_frame(mac(), sizes)
    (frame,) = FrameDecoder(mac=mac()).feed(stream)
    assert [bytes(b.numpy()) for b in frame.buffers] == bufs
    first = len(stream) - handshake.SEAL_DIGEST_SIZE - sum(sizes)
    edges = set()
    at = first
    for n in sizes:
        edges |= {at + i for i in range(0, n, PIECE)} | {at + min(i + PIECE, n) - 1
                                                         for i in range(0, n, PIECE)}
        at += n
    for at in sorted(edges) + [len(stream) - 1]:
        altered = stream[:at] + bytes([stream[at] ^ 0x10]) + stream[at + 1:]
        with pytest.raises(ProtocolError,
                           match="tensor bytes of a frame .* failed authentication"):
            FrameDecoder(mac=mac()).feed(altered)
    # A buffer's pieces are MAC'd in order: two of its pieces swapped fail too.
    if sizes == [2 * PIECE + 3]:
        body = stream[first:first + sum(sizes)]
        swapped = body[PIECE:2 * PIECE] + body[:PIECE] + body[2 * PIECE:]
        with pytest.raises(ProtocolError, match="tensor bytes"):
            FrameDecoder(mac=mac()).feed(stream[:first] + swapped + stream[first + len(body):])


def test_random_headers_never_crash_the_decoder():
    rng = random.Random(1234)
    limits = _wire.Limits(max_message_size=1 << 20)
    for _ in range(5000):
        data = rng.randbytes(rng.randint(0, 64))
        if rng.random() < 0.5:
            data = b"TRPC\x01" + data
        try:
            for f in FrameDecoder(limits, shm=True).feed(data):
                assert len(f.envelope) + sum(
                    b.size if isinstance(b, ShmRef) else b.numel() for b in f.buffers) <= 1 << 20
        except ProtocolError:
            pass


def test_buffers_that_do_not_match_the_envelope_are_rejected():
    env, bufs, _ = _wire.encode(torch.arange(1000.0), inline_max=512)  # out of band
    short = torch.zeros(8, dtype=torch.uint8)  # 2 elements where 1000 were announced
    with pytest.raises(Exception) as info:
        _wire.decode(env, [short])
    assert not isinstance(info.value, SystemError)
    with pytest.raises(pickle.UnpicklingError):
        _wire.decode(env, [])  # a buffer is missing
    for cut in (0, 5, len(env) // 2, len(env) - 1):
        with pytest.raises(Exception):
            _wire.decode(env[:cut], bufs)


def test_unknown_dtypes_travel_as_objects():
    x = torch.arange(4.0).to(getattr(torch, "float8_e4m3fn", torch.float16))
    assert_same(round_trip(x), x)


def test_once_probes_round_trip_and_reject_malformed_envelopes():
    ids = [1, 2, (1 << 64) - 1]
    assert _wire.parse_probe(_wire.pack_probe(ids)) == tuple(ids)
    answers = [(1, _wire.probe.MISSING), (2, _wire.probe.RUNNING), (7, _wire.probe.REPLIED)]
    assert _wire.parse_status(_wire.pack_status(answers)) == answers
    assert len(_wire.pack_probe(ids)) == 8 * len(ids)  # ids only, no pickle
    most = list(range(_wire.MAX_PROBE_IDS))
    assert len(_wire.parse_probe(_wire.pack_probe(most))) == _wire.MAX_PROBE_IDS
    for bad in (b"", b"\0" * 7, b"\0" * 8 * (_wire.MAX_PROBE_IDS + 1)):
        with pytest.raises(ProtocolError, match="malformed ONCE_PROBE"):
            _wire.parse_probe(bad)
    for bad in (b"", b"\0" * 10):
        with pytest.raises(ProtocolError, match="malformed ONCE_STATUS"):
            _wire.parse_status(bad)
    with pytest.raises(ProtocolError, match="unknown ONCE_STATUS status 9"):
        _wire.parse_status(struct.pack("<QB", 5, 9))
    with pytest.raises(ValueError, match="1 to"):
        _wire.pack_probe([])
    # The probe kinds are known to the frame layer, with fixed ids.
    assert (Kind.ONCE_PROBE, Kind.ONCE_STATUS) == (7, 8)
    h = _wire.parse_header(_wire.pack_header(Kind.ONCE_PROBE, _wire.FLAG_ONEWAY, 0, 16, []),
                           _wire.Limits())
    assert h.kind == Kind.ONCE_PROBE and h.oneway
