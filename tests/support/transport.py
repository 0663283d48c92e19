"""Bare transports in this process for the transport tests, functions that those tests
run on remote workers, and the memory-test worker.

``python -m tests.support.transport memory RANK PORT OUT`` is one member of the two-worker
group of the peak-RSS test: rank 0 echoes a large tensor off rank 1 and writes both
processes' peak RSS to ``OUT`` as JSON.
"""

from __future__ import annotations

import json
import os
import queue
import resource
import sys
import threading
import time
from typing import Any, Callable, Dict, List, Optional

import torch

import torchrpc.rpc as rpc
from torchrpc import _wire
from torchrpc._transport import Connection, Transport, handshake, tls
from torchrpc._wire import Kind

def tls_contexts(pki: Dict[str, str], cert: str = "worker", ca: str = "ca",
                 require: bool = True, identity: Optional[str] = None) -> tls.TlsContexts:
    """TLS contexts with ``cert`` (and its key) from ``pki`` (see certs.make_pki)."""
    return tls.make_contexts(pki[cert], pki[f"{cert}.key"], pki[ca], require, identity)


class Peer:
    """A bare transport in this process that records what arrives.

    With ``echo``, CALL frames go back as RESPONSE frames (copies with ``copy_back``,
    else a buffer in shared memory goes back into the caller's segment); every other
    frame lands in ``frames`` as (header, envelope, buffers), every close reason in
    ``closed``, and every inbound connection in ``accepted``. ``shm_on`` offers shared
    memory from ``shm_threshold`` bytes on to peers that ``same_host`` and ``same_pids``
    accept; ``tensor_mac`` offers MACs over the tensor bytes on plain TCP; ``stripe_threshold``
    offers stripes (``_transport/stripe.py``). It listens on ``host``.
    """

    def __init__(self, rank: int, secret: bytes = b"s" * 32, shm_on: bool = False,
                 same_host: bool = True, same_pids: bool = True, copy_back: bool = False,
                 tls_contexts: Optional[tls.TlsContexts] = None, local_socket: bool = False,
                 echo: bool = True, shm_threshold: int = 64 << 10,
                 tensor_mac: bool = True, host: str = "127.0.0.1",
                 stripe_threshold: int = 0) -> None:
        self.frames: "queue.Queue" = queue.Queue()
        self.accepted: "queue.Queue[Connection]" = queue.Queue()
        self.closed: List[Any] = []
        self.echo = echo
        self.copy_back = copy_back
        self.t = Transport(rank, secret, _wire.Limits(), self._on_connect, self._on_frame,
                           lambda c, why: self.closed.append(why), host,
                           features=handshake.FEATURE_SHM if shm_on else 0,
                           shm_threshold=shm_threshold, same_host=lambda r: same_host,
                           same_pids=lambda r: same_pids, tls_contexts=tls_contexts,
                           local_socket=local_socket, tensor_mac=tensor_mac,
                           stripe_threshold=stripe_threshold)

    def _on_connect(self, conn: Connection) -> None:
        if not conn.outbound:
            self.accepted.put(conn)

    def _on_frame(self, conn: Connection, header: _wire.Header, envelope: bytes,
                  buffers: List[torch.Tensor]) -> None:
        if self.echo and header.kind == Kind.CALL:
            if self.copy_back:
                buffers = [b.clone() for b in buffers]
            conn.send(Kind.RESPONSE, 0, header.request_id, bytes(envelope),
                      [_wire.tensor_bytes(b) for b in buffers], buffers)
        else:
            self.frames.put((header, bytes(envelope), buffers))

    def connect(self, other: "Peer", **kwargs: Any) -> Connection:
        return self.t.connect(other.t.rank, *other.t.address, timeout=5, **kwargs)

    def close(self) -> None:
        self.t.close()


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 10.0) -> None:
    """Poll ``cond`` until it holds; fail naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


_held: Dict[str, Any] = {}
_lock = threading.Lock()


def mapping_of(t: Any) -> str:
    """The file behind the memory of ``t``, a tensor or a numpy array, in /proc/self/maps
    ('' for anonymous memory)."""
    addr = t.data_ptr() if isinstance(t, torch.Tensor) else t.__array_interface__["data"][0]
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split(maxsplit=5)
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            if lo <= addr < hi:
                return fields[5].strip() if len(fields) == 6 else ""
    return ""


def is_segment(mapping: str) -> bool:
    """Whether a mapping (see :func:`mapping_of`) is a torchrpc shared-memory segment:
    a sealed memfd (never a file in /dev/shm, see torchrpc/_transport/shm.py)."""
    return mapping.startswith("/memfd:torchrpc-") and mapping.endswith("(deleted)")


def echo_where(x: Any) -> tuple:
    """``x`` back, and where it lived on this worker."""
    return x, mapping_of(x)


def hold(key: str, value: Any) -> None:
    with _lock:
        _held[key] = value


def held(key: str) -> Any:
    with _lock:
        return _held[key]


def bump_held(key: str) -> None:
    """Add 1 in place to the tensor held under ``key``."""
    with _lock:
        _held[key].add_(1)


def debug_counter(key: str) -> Any:
    """One entry of this worker's debug info."""
    return rpc.get_debug_info()[key]


def drop_all() -> None:
    with _lock:
        _held.clear()


_flags: Dict[str, threading.Event] = {}


def _flag(key: str) -> threading.Event:
    with _lock:
        return _flags.setdefault(key, threading.Event())


def wait_for_flag(key: str, timeout: float) -> bool:
    """Block (not on an RPC) until set_flag(key) runs on this worker."""
    return _flag(key).wait(timeout)


def set_flag(key: str) -> bool:
    _flag(key).set()
    return True


def fire(to: str, nbytes: int) -> None:
    """Send ``nbytes`` to ``to`` without waiting for the answer (the call stays pending)."""
    hold("fired", rpc.rpc_async(to, hold, args=("payload", torch.ones(nbytes, dtype=torch.uint8)),
                                timeout=0))


def echo_via(to: str, x: torch.Tensor) -> torch.Tensor:
    """Echo ``x`` off worker ``to``, from here."""
    return rpc.rpc_sync(to, echo_where, args=(x,))[0]


def shm_segments() -> List[int]:
    """(segments this worker's connections send through, segments they receive through)."""
    from torchrpc.rpc import api
    agent = api.current_agent()
    conns = agent._transport.connections()
    return [sum(c.shm_tx.num_segments for c in conns if c.shm_tx is not None),
            sum(c.shm_rx.num_segments for c in conns if c.shm_rx is not None)]


def peak_rss() -> Dict[str, int]:
    """Peak RSS of this process in KiB: VmHWM (this address space) and ru_maxrss.

    ru_maxrss also counts the parent's size before exec (Linux folds it in at fork and
    exec), so VmHWM is the number to hold a worker to.
    """
    hwm = 0
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                hwm = int(line.split()[1])
    return {"vmhwm_kib": hwm, "ru_maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def _memory_member(rank: int, port: int, out: str) -> None:
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    opts = rpc.TensorPipeRpcBackendOptions(num_worker_threads=4, rpc_timeout=60,
                                           enable_shm=os.environ.get("SHM", "1") == "1")
    rpc.init_rpc(f"m{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if rank == 0:
        nbytes = int(os.environ.get("PAYLOAD", str(256 << 20)))
        base = {"caller": peak_rss(), "callee": rpc.rpc_sync("m1", peak_rss)}
        x = torch.rand(nbytes // 4)
        ok = True
        for _ in range(3):
            back = rpc.rpc_sync("m1", echo_where, args=(x,))[0]
            ok = ok and torch.equal(back, x)
            del back
        report = {"ok": ok, "payload": nbytes, "base": base,
                  "caller": peak_rss(), "callee": rpc.rpc_sync("m1", peak_rss)}
        with open(out, "w") as f:
            json.dump(report, f)
    rpc.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "memory":
        _memory_member(int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
