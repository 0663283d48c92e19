"""A featureless RPC between two processes: the floor under any pure-Python design.

It does what a call needs and nothing else: pickle the function and its arguments
(small tensors inline as raw bytes, as torchrpc sends them), one ``sendmsg`` per frame
over a Unix socket pair, the callee runs the function on the thread that read the
request, the caller unpickles the reply. There are no deadlines, retries, hooks,
counters, RRefs, security checks or failure handling: a dead peer hangs it. Only
``rpc_sync`` and ``rpc_async`` exist (the latency and throughput workloads); every other
workload shows as an error row.

Two designs of the reply path, as torchrpc has them (see ``_agent/lanes.py`` and
``_agent/private_lane.py``):

* ``rpc_sync`` goes out on its own connection and the calling thread reads the reply
  itself, polling the socket without blocking (both ends poll);
* ``rpc_async`` goes out on a second connection whose replies a reading thread takes,
  completing the futures; with ``self_read`` (the ``floor-self`` system) there is no such
  thread: the calling thread takes whatever replies have arrived at every 16th call, and
  waiting on a future (``wait``, ``torch.futures.wait_all``) reads until it is done. A
  burst of large ``rpc_async`` calls can then fill both sockets and hang: it is for
  small calls only.

The benchmark runs it as the ``floor`` and ``floor-self`` systems: what torchrpc could
gain on this machine by doing less, measured side by side (see BENCHMARKS.md).
"""

from __future__ import annotations

import ctypes
import io
import os
import pickle
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
from torch.distributed import TCPStore

_HEAD = struct.Struct("<IQB")  # envelope length, request id, is-error
_CHUNK = 1 << 20
_REPLY, _ERROR = 0, 1
_STORE_KEY = "floor/callee-address"
# self_read: the calling thread takes the replies that came at every this many calls
# (enough that the socket buffers never fill, few enough recv calls to cost little).
_DRAIN_EVERY = 16
_POLL_S = 0.002  # how long a polling reader polls before it blocks (torchrpc: 2 ms on spare CPUs)


class TensorPipeRpcBackendOptions:
    """Takes the benchmark's options; only ``init_method`` (``tcp://host:port``) is used."""

    def __init__(self, num_worker_threads: int = 16, rpc_timeout: float = 60.0,
                 init_method: str = "env://") -> None:
        self.num_worker_threads = num_worker_threads
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method


def _rebuild_tensor(data: bytes, dtype: torch.dtype, shape: Tuple[int, ...]) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=dtype).view(shape) if data \
        else torch.empty(shape, dtype=dtype)


class _Pickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor:
            t = obj.detach().contiguous()
            return _rebuild_tensor, (ctypes.string_at(t.data_ptr(), t.numel() * t.itemsize),
                                     t.dtype, tuple(t.shape))
        return NotImplemented


def _dumps(obj: Any) -> bytes:
    out = io.BytesIO()
    _Pickler(out, 5).dump(obj)
    return out.getvalue()


class _Frames:
    """Frames read from one socket into one buffer; ``poll``: wait for data polling for
    up to _POLL_S before blocking."""

    def __init__(self, sock: socket.socket, poll: bool) -> None:
        self.sock = sock
        self.buf = bytearray(_CHUNK)
        self.view = memoryview(self.buf)
        self.lo = self.hi = 0
        self.poll = poll

    def take(self) -> Optional[Tuple[int, int, bytes]]:
        """The next whole frame in the buffer, or None."""
        if self.hi - self.lo < _HEAD.size:
            return None
        n, rid, err = _HEAD.unpack_from(self.buf, self.lo)
        start = self.lo + _HEAD.size
        if self.hi - start < n:
            self._make_room(_HEAD.size + n)
            return None
        self.lo = start + n
        return rid, err, bytes(self.view[start:start + n])

    def _make_room(self, size: int) -> None:
        """Let the buffer hold a frame of ``size`` bytes from ``lo`` whole."""
        if self.lo + size <= len(self.buf):
            return
        self.view.release()  # a bytearray with a view on it cannot change size
        del self.buf[:self.lo]
        self.hi -= self.lo
        self.lo = 0
        if size > len(self.buf):
            self.buf.extend(bytes(size - len(self.buf)))
        self.view = memoryview(self.buf)

    def fill(self, block: bool = True) -> bool:
        """Read what the socket has; False if nothing came (``block``: wait for it), raise
        EOFError when the peer closed."""
        if self.lo == self.hi:
            self.lo = self.hi = 0
        elif self.lo > len(self.buf) // 2:
            self.buf[:self.hi - self.lo] = self.buf[self.lo:self.hi]
            self.hi -= self.lo
            self.lo = 0
        until = time.perf_counter() + _POLL_S if self.poll and block else 0.0
        while True:
            try:
                polling = not block or time.perf_counter() < until
                n = self.sock.recv_into(self.view[self.hi:], 0,
                                        socket.MSG_DONTWAIT if polling else 0)
            except BlockingIOError:
                if block:
                    continue
                return False
            if n == 0:
                raise EOFError("the peer closed the connection")
            self.hi += n
            return True

    def next(self) -> Tuple[int, int, bytes]:
        """Block (polling if ``poll``) until a frame is whole."""
        frame = self.take()
        while frame is None:
            self.fill()
            frame = self.take()
        return frame


def _send(sock: socket.socket, rid: int, err: int, env: bytes) -> None:
    sock.sendmsg([_HEAD.pack(len(env), rid, err), env])


def _serve(sock: socket.socket, poll: bool) -> None:
    """The callee's side of one connection: run each request, reply; until it closes."""
    frames = _Frames(sock, poll)
    try:
        while True:
            rid, _, env = frames.next()
            try:
                func, args, kwargs = pickle.loads(env)
                reply, err = _dumps(func(*args, **kwargs)), _REPLY
            except Exception as exc:  # noqa: BLE001 - every failure goes back to the caller
                reply, err = _dumps(RuntimeError(f"{type(exc).__name__}: {exc}")), _ERROR
            _send(sock, rid, err, reply)
    except (EOFError, OSError):
        pass
    finally:
        sock.close()


def _value(err: int, env: bytes) -> Any:
    value = pickle.loads(env)
    if err:
        raise value
    return value


class _Caller:
    """The caller's two connections: one for rpc_sync, one for rpc_async."""

    def __init__(self, sync: socket.socket, many: socket.socket, self_read: bool) -> None:
        self.sync, self.many = sync, many
        self.sync_frames = _Frames(sync, poll=True)
        self.many_frames = _Frames(many, poll=self_read)
        self.self_read = self_read
        self.pending: Dict[int, torch.futures.Future] = {}
        self.next_rid = 0
        self.lock = threading.Lock()  # the reading of the rpc_async connection (self_read)
        self.reader: Optional[threading.Thread] = None
        if not self_read:
            self.reader = threading.Thread(target=self._read_many, name="floor-reader",
                                           daemon=True)
            self.reader.start()

    def call_sync(self, func: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
        self.next_rid += 1
        _send(self.sync, self.next_rid, 0, _dumps((func, args, kwargs)))
        _, err, env = self.sync_frames.next()
        return _value(err, env)

    def call_async(self, func: Callable[..., Any], args: tuple, kwargs: dict
                   ) -> torch.futures.Future:
        env = _dumps((func, args, kwargs))
        fut = _Future()
        fut.caller = self
        self.next_rid += 1
        self.pending[self.next_rid] = fut
        if self.self_read and self.next_rid % _DRAIN_EVERY == 0 \
                and self.lock.acquire(blocking=False):
            try:
                self._complete(block=False)
            finally:
                self.lock.release()
        _send(self.many, self.next_rid, 0, env)
        return fut

    def _complete(self, block: bool) -> None:
        frames = self.many_frames
        while True:
            frame = frames.take()
            if frame is None:
                if not frames.fill(block):
                    return
                continue
            rid, err, env = frame
            fut = self.pending.pop(rid)
            try:
                fut.set_result(_value(err, env))
            except Exception as exc:  # noqa: BLE001 - the callee's error
                fut.set_exception(exc)
            if block:
                return

    def read_until(self, done: Callable[[], bool]) -> None:
        """self_read: read replies on this thread until ``done()``."""
        with self.lock:
            while not done():
                self._complete(block=True)

    def _read_many(self) -> None:
        try:
            while True:
                self._complete(block=True)
        except (EOFError, OSError):
            pass


class _Future(torch.futures.Future):
    caller: Optional[_Caller] = None

    def wait(self) -> Any:
        caller = self.caller
        if caller is not None and caller.self_read:
            caller.read_until(self.done)
        return super().wait()


_torch_wait_all = torch.futures.wait_all


def _wait_all(futures: List[torch.futures.Future]) -> List[Any]:
    for fut in futures:
        if isinstance(fut, _Future):
            fut.wait()  # self_read: read the replies here (else: wait as torch does)
    return _torch_wait_all(futures)


_state: Dict[str, Any] = {}


def init_rpc(name: str, rank: int, world_size: int,
             rpc_backend_options: Optional[TensorPipeRpcBackendOptions] = None,
             self_read: bool = False) -> None:
    """Connect the two workers: rank 0 calls, rank 1 serves."""
    if world_size != 2:
        raise ValueError(f"the floor RPC runs two workers, got world_size={world_size}")
    init = rpc_backend_options.init_method if rpc_backend_options else "env://"
    if init.startswith("tcp://"):
        host, port = init[len("tcp://"):].rsplit(":", 1)
    else:
        host, port = os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"]
    store = TCPStore(host, int(port), world_size, rank == 0)
    _state["store"] = store
    if rank == 1:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(f"\0torchrpc-floor-{os.getpid()}-{id(listener)}")
        listener.listen(2)
        store.set(_STORE_KEY, listener.getsockname()[1:])
        servers = []
        for poll in (True, False):
            conn, _ = listener.accept()
            servers.append(threading.Thread(target=_serve, args=(conn, poll), daemon=True,
                                            name=f"floor-serve-{int(poll)}"))
            servers[-1].start()
        listener.close()
        _state["servers"] = servers
        return
    address = "\0" + store.get(_STORE_KEY).decode()
    socks = []
    for _ in range(2):
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(address)
        socks.append(sock)
    _state["caller"] = _Caller(socks[0], socks[1], self_read)
    torch.futures.wait_all = _wait_all


def rpc_sync(to: Any, func: Callable[..., Any], args: Optional[tuple] = None,
             kwargs: Optional[dict] = None, timeout: float = -1.0) -> Any:
    """Run ``func(*args, **kwargs)`` on the other worker and return its result."""
    return _state["caller"].call_sync(func, tuple(args or ()), dict(kwargs or {}))


def rpc_async(to: Any, func: Callable[..., Any], args: Optional[tuple] = None,
              kwargs: Optional[dict] = None, timeout: float = -1.0) -> torch.futures.Future:
    """A future of ``func(*args, **kwargs)`` run on the other worker."""
    return _state["caller"].call_async(func, tuple(args or ()), dict(kwargs or {}))


def shutdown(graceful: bool = True, timeout: float = 0) -> None:
    """The caller closes its connections; the callee waits until they are closed."""
    caller = _state.pop("caller", None)
    if caller is not None:
        caller.sync.close()
        caller.many.shutdown(socket.SHUT_RDWR)
        caller.many.close()
        torch.futures.wait_all = _torch_wait_all
        if caller.reader is not None:
            # Joined: a thread still in torch's C++ code when the interpreter finalizes
            # aborts the process.
            caller.reader.join(10.0)
    for thread in _state.pop("servers", ()):
        thread.join()
    _state.pop("store", None)
