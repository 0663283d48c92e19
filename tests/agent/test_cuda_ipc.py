"""CUDA IPC's bookkeeping (cuda_ipc.py) with its CUDA calls replaced: the sender keeps each
snapshot it shares until the receiver acknowledges it or is lost, the receiver lets go of
what it opened and acknowledges once its copy is done, the same-host decision, and the
encoder choosing IPC in one place. The CUDA calls themselves run in tests/rpc/test_cuda.py
on a GPU; the release messages between workers in test_cuda_release.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from torchrpc import _wire
from torchrpc._agent import cuda_ipc
from torchrpc._agent.hooks import CUDA_IPC, Extensions
from torchrpc._agent.worker import WorkerInfo
from torchrpc._wire import Kind

from ..support import cuda as ch


class Event:
    def __init__(self) -> None:
        self.done = False


class FakeCalls(cuda_ipc.CudaCalls):
    """CUDA IPC in one process: a share's handle names a snapshot kept here."""

    def __init__(self) -> None:
        super().__init__()
        self.memory = {}  # handle -> snapshot
        self.waited, self.let_go_of, self.events = [], [], []

    def snapshot(self, t):
        snap = t.detach().clone()
        handle = b"handle-%d" % len(self.memory)
        self.memory[handle] = snap
        nbytes = snap.numel() * snap.element_size()
        return snap, (0, handle, nbytes, 0, b"/torch_counter", 3, b"event", True), Event()

    def event_handle(self, event):
        return b"ipc-event"

    def open_copy(self, info, target):
        out = ch.fake_cuda(self.memory[info.handle].clone())
        done = Event()
        self.events.append(done)
        return out, ("opened", info.share_id), done

    def done(self, event):
        return event.done

    def wait(self, event):
        self.waited.append(event)

    def let_go(self, receipt, device):
        self.let_go_of.append(receipt[cuda_ipc.KEEP])
        receipt[cuda_ipc.KEEP] = None


W0, W1, W2 = WorkerInfo("w0", 0), WorkerInfo("w1", 1), WorkerInfo("w2", 2)


def _ipc(me, calls, gpus=None, same_host=True, sent=None):
    hosts = SimpleNamespace(worker_info=me, gpus=gpus or {0: "*", 1: "*", 2: "*"},
                            same_host=lambda rank: same_host)
    release = (lambda rank, ids: sent.append((rank, ids))) if sent is not None else None
    return cuda_ipc.CudaIpc(me.name, hosts, release, calls)


# -- the sender's table ------------------------------------------------------------------------

def test_a_share_is_kept_until_its_receiver_acknowledges_it():
    table = cuda_ipc.ShareTable(FakeCalls())
    a = table.share(1, torch.ones(3))
    b = table.share(1, torch.ones(2, 2, dtype=torch.float64))
    c = table.share(2, torch.ones(1))
    assert (a.share_id, b.share_id, c.share_id) == (1, 2, 3)
    assert b.dtype == torch.float64 and b.shape == (2, 2) and b.size_bytes == 32
    assert a.event == b"ipc-event" and a.handle == b"handle-0"
    assert table.held_for(1) == 2 and table.held_for(2) == 1
    assert table.acknowledged(1, [a.share_id]) == 1
    assert table.acknowledged(1, [a.share_id]) == 0  # once
    assert table.acknowledged(1, [c.share_id]) == 0  # worker2's: not worker1's to release
    assert set(table.outstanding) == {b.share_id, c.share_id}
    assert table.released == 1


def test_a_lost_receiver_releases_every_share_it_held_and_only_those():
    table = cuda_ipc.ShareTable(FakeCalls())
    for peer in (1, 1, 2):
        table.share(peer, torch.ones(2))
    assert table.peer_lost(1) == 2 and table.peer_lost(1) == 0
    assert table.held_for(2) == 1 and table.released == 2
    assert table.clear() == 1 and not table.outstanding and table.released == 3


def test_the_snapshot_not_the_tensor_is_what_is_shared():
    calls = FakeCalls()
    table = cuda_ipc.ShareTable(calls)
    x = torch.arange(4.0)
    info = table.share(1, x)
    x.add_(100)  # the caller changes its tensor once the call is made
    assert calls.memory[info.handle].tolist() == [0.0, 1.0, 2.0, 3.0]
    snap, _ = table.outstanding[info.share_id][1]
    assert snap.data_ptr() != x.data_ptr()


# -- the receiver's table ----------------------------------------------------------------------

def _info(calls, peer_table, shape=(3,)):
    return peer_table.share(0, torch.arange(float(torch.Size(shape).numel())).view(shape))


def test_a_copy_is_acknowledged_once_done_and_what_was_opened_let_go_of_first():
    calls = FakeCalls()
    sent = []
    ipc = _ipc(W1, calls, sent=sent)
    sender = cuda_ipc.ShareTable(calls)
    infos = [_info(calls, sender) for _ in range(3)]
    outs = [ipc.receipts.receive(0, info, torch.device("cuda:0"), reply=False)
            for info in infos]
    assert [o.tolist() for o in outs] == [[0.0, 1.0, 2.0]] * 3
    assert not calls.waited  # a request's callee runs after the copy on the stream
    ipc.tick()
    assert sent == [] and len(ipc.receipts.pending) == 3
    calls.events[0].done = calls.events[2].done = True
    ipc.tick()
    assert sent == [(0, (infos[0].share_id, infos[2].share_id))]
    assert calls.let_go_of == [("opened", infos[0].share_id), ("opened", infos[2].share_id)]
    calls.events[1].done = True
    ipc.tick()
    assert sent[1:] == [(0, (infos[1].share_id,))] and not ipc.receipts.pending
    assert ipc.acks_sent == 2


def test_a_reply_is_waited_for_until_its_copy_is_done():
    calls = FakeCalls()
    ipc = _ipc(W0, calls, sent=[])
    info = _info(calls, cuda_ipc.ShareTable(calls))
    ipc.receipts.receive(1, info, torch.device("cuda:0"), reply=True)
    assert calls.waited == [calls.events[0]]


def test_an_acknowledgement_that_cannot_be_sent_is_logged_and_dropped(caplog):
    calls = FakeCalls()

    def release(rank, ids):
        raise RuntimeError("worker0 has left")

    hosts = SimpleNamespace(worker_info=W1, gpus={}, same_host=lambda rank: True)
    ipc = cuda_ipc.CudaIpc("w1", hosts, release, calls)
    ipc.receipts.receive(0, _info(calls, cuda_ipc.ShareTable(calls)), torch.device("cuda:0"),
                         reply=False)
    calls.events[0].done = True
    with caplog.at_level("INFO", logger="torchrpc"):
        ipc.tick()
    assert "could not tell worker 0 it copied 1 CUDA shares: worker0 has left" in caplog.text
    assert not ipc.receipts.pending and ipc.acks_sent == 0


def test_a_malformed_release_message_is_refused():
    ipc = _ipc(W0, FakeCalls(), sent=[])
    with pytest.raises(ValueError, match="malformed CUDA_RELEASE from w1"):
        ipc.on_release(W1, [1, 2])
    with pytest.raises(ValueError, match="malformed CUDA_RELEASE"):
        ipc.on_release(W1, (1, "2"))
    ipc.on_release(W1, (1, 2))  # unknown ids: nothing to drop


# -- which peers share through IPC -------------------------------------------------------------

@pytest.mark.parametrize("same_host, mine, theirs, ok", [
    (True, "*", "*", True), (True, "0,1", "0,1", True), (True, "0", "1", False),
    (False, "*", "*", False), (True, None, "*", False), (True, "*", None, False)])
def test_ipc_only_to_a_peer_on_this_host_that_sees_the_same_gpus(same_host, mine, theirs, ok):
    assert cuda_ipc.ipc_possible(same_host, mine, theirs) is ok


def test_sharing_is_offered_for_peers_that_can_open_it_and_never_for_this_worker():
    calls = FakeCalls()
    ipc = _ipc(W0, calls, gpus={0: "*", 1: "*", 2: "1"})
    assert ipc.sharing(W1) is not None
    assert ipc.sharing(W0) is None  # the worker itself: no copy crosses a process
    assert ipc.sharing(W2) is None  # sees other GPUs
    assert _ipc(W0, calls, same_host=False).sharing(W1) is None


# -- the encoder chooses IPC in one place -------------------------------------------------------

class _SendContext:
    """A message's context to w1 whose CUDA tensors land on cuda:0 and are shared."""

    def __init__(self, ipc, peer=W1) -> None:
        self.ipc, self.peer = ipc, peer
        self.offers = 0

    def target_device(self, device):
        return torch.device("cuda:0")

    def cuda_share(self):
        self.offers += 1
        return self.ipc.sharing(self.peer)


def _receiver_context(ipc, peer=W0, kind=Kind.CALL):
    extensions = Extensions()
    extensions.install(CUDA_IPC, ipc)
    return SimpleNamespace(agent=SimpleNamespace(extensions=extensions), peer=peer, kind=kind)


def test_a_cuda_tensor_to_a_peer_on_this_host_crosses_as_a_share_not_as_bytes():
    calls = FakeCalls()
    sender, receiver = _ipc(W0, calls), _ipc(W1, calls, sent=[])
    context = _SendContext(sender)
    xs = [ch.fake_cuda(torch.full((50_000,), float(i))) for i in range(3)]
    env, bufs, _ = _wire.encode(("label", *xs), context)
    assert bufs == [] and len(env) < 2000  # the handles, not the 600 KB
    assert context.offers == 1  # asked once a message
    assert len(sender.shares.outstanding) == 3
    for x in xs:
        x.add_(7)  # changed once sent: the receiver still gets the old values
    out = _wire.decode(env, [], _receiver_context(receiver))[1]
    assert out[0] == "label"
    assert [t[0].item() for t in out[1:]] == [0.0, 1.0, 2.0]
    assert all(t.device == torch.device("cuda:0") for t in out[1:])
    assert len(receiver.receipts.pending) == 3


def test_a_share_that_requires_grad_arrives_as_a_leaf_recorded_by_the_receive_hook():
    calls = FakeCalls()
    sender, receiver = _ipc(W0, calls), _ipc(W1, calls, sent=[])
    sent, received = [], []
    x = ch.fake_cuda(torch.ones(4)).requires_grad_()
    env, _, _ = _wire.encode(x, _SendContext(sender), send_hook=sent.append)

    def recv_hook(meta):
        return lambda t: received.append(t) or t

    out = _wire.decode(env, [], _receiver_context(receiver), recv_hook)[1]
    assert sent == [x] and received == [out]
    assert out.requires_grad and out.is_leaf


def test_without_a_peer_on_this_host_or_to_the_cpu_a_cuda_tensor_crosses_as_bytes():
    calls = FakeCalls()
    x = ch.fake_cuda(torch.ones(3))
    env, bufs, _ = _wire.encode(x, _SendContext(_ipc(W0, calls, same_host=False)))
    assert b"cuda_ipc" not in env and b"cuda:0" in env

    class ToCpu(_SendContext):
        def target_device(self, device):
            return torch.device("cpu")

    ipc = _ipc(W0, calls)
    env, bufs, _ = _wire.encode(x, ToCpu(ipc))
    assert b"cuda_ipc" not in env and not ipc.shares.outstanding
    assert _wire.decode(env, bufs)[1].tolist() == [1.0, 1.0, 1.0]


def test_a_share_is_refused_outside_a_message_or_when_its_metadata_does_not_fit():
    calls = FakeCalls()
    info = cuda_ipc.ShareTable(calls).share(0, torch.ones(4))
    with pytest.raises(ValueError, match="outside an RPC message"):
        cuda_ipc._receive(info, "cuda:0")
    context = _receiver_context(_ipc(W1, calls, sent=[]))
    with pytest.raises(ValueError, match="target 'cpu'"):
        cuda_ipc._receive(info, "cpu", context=context)
    for bad in (info._replace(shape=(5,)), info._replace(shape=(-1,)),
                info._replace(dtype="float32")):
        with pytest.raises(ValueError, match="malformed CUDA IPC share"):
            cuda_ipc._receive(bad, "cuda:0", context=context)
    with pytest.raises(ValueError, match="outside an RPC message"):
        cuda_ipc._receive(tuple(info), "cuda:0", context=context)


def test_a_message_encoded_in_two_passes_shares_each_cuda_tensor_once():
    calls = FakeCalls()
    sender, receiver = _ipc(W0, calls), _ipc(W1, calls, sent=[])
    base = torch.arange(100.0)
    # Two views of one storage, the second reaching past what the first pickled: encode()
    # runs a second pass with the whole range known.
    value = (ch.fake_cuda(torch.ones(8)), base[:10], base[50:])
    env, bufs, _ = _wire.encode(value, _SendContext(sender))
    assert len(sender.shares.outstanding) == 1
    received = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in bufs]
    out = _wire.decode(env, received, _receiver_context(receiver))[1]
    assert out[0].tolist() == [1.0] * 8 and out[2].tolist() == base[50:].tolist()
    assert out[1].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()
