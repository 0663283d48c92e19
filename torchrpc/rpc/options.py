"""Backend options: validated objects whose fields may be assigned after construction."""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Union

import torch

from ..errors import OptionTypeError
from . import constants

DeviceLike = Union[int, str, torch.device]


def _to_device(d: DeviceLike) -> torch.device:
    if isinstance(d, torch.device):
        return d
    if isinstance(d, int) and not isinstance(d, bool):
        if d < 0:
            raise ValueError(f"device index must be non-negative, got {d}")
        return torch.device("cuda", d)
    if isinstance(d, str):
        try:
            return torch.device(d)
        except RuntimeError as exc:
            raise ValueError(f"invalid device {d!r}: {exc}") from exc
    raise TypeError(f"a device must be an int, str or torch.device, got {type(d).__name__}")


def normalize_device_map(to: str, device_map: Dict[DeviceLike, DeviceLike]
                         ) -> Dict[torch.device, torch.device]:
    """Validate one worker's device map; it must be invertible (no two sources to one target)."""
    if not isinstance(to, str):
        raise TypeError(f"device map key must be a worker name (str), got {type(to).__name__}")
    if not isinstance(device_map, dict):
        raise TypeError(f"device map for {to!r} must be a dict, got {type(device_map).__name__}")
    out: Dict[torch.device, torch.device] = {}
    seen: Dict[torch.device, torch.device] = {}
    for src, dst in device_map.items():
        s, d = _to_device(src), _to_device(dst)
        if d in seen and seen[d] != s:
            raise ValueError(
                f"device map for {to!r} is not invertible: both {seen[d]} and {s} map to {d}; "
                f"every target device may appear once")
        seen[d] = s
        out[s] = d
    return out


def _seconds(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
        raise ValueError(f"{name} must be a number of seconds >= 0, got {value!r}")
    return float(value)


def _check_heartbeat(interval: float, timeout: float) -> None:
    if interval > 0 and 0 < timeout <= interval:
        raise ValueError(f"heartbeat_timeout ({timeout:g} s) must be longer than "
                         f"heartbeat_interval ({interval:g} s), or 0 to never time out; "
                         f"a few intervals is usual")


def _count(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def _path_or_none(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise TypeError(f"{name} must be a file path (str) or None, got {value!r}")
    return os.fspath(value)


def _check_number(cls: str, name: str, value: Any, construction: bool = False,
                  integer: bool = False) -> None:
    """Raise torch's TypeError (pybind's wording) when ``value`` is not a number."""
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds):
        where = (f"{cls}.__init__(): incompatible constructor arguments" if construction
                 else f"{cls}.{name}: incompatible function arguments")
        fix = (" (a datetime.timedelta: pass its .total_seconds())"
               if hasattr(value, "total_seconds") else "")
        raise OptionTypeError(
            f"{where}. {name} must be "
            f"{'an int' if integer else 'a number of seconds (float)'}, got "
            f"{type(value).__name__} {value!r}{fix}")


class RpcBackendOptions:
    """An abstract structure encapsulating the options passed into the RPC backend.

    Args:
        rpc_timeout (float): default timeout in seconds for every RPC; 0 means none.
        init_method (str): URL of the rendezvous store, as for
            ``torch.distributed.init_process_group`` (default ``env://``).
    """

    def __init__(self, rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = constants.DEFAULT_INIT_METHOD) -> None:
        _check_number(type(self).__name__, "rpc_timeout", rpc_timeout, construction=True)
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method

    @property
    def rpc_timeout(self) -> float:
        """A float indicating the timeout to use for all RPCs."""
        return self._rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        _check_number(type(self).__name__, "rpc_timeout", value)
        if value < 0:
            raise ValueError(f"rpc_timeout must be a number of seconds >= 0 (0: no timeout), "
                             f"got {value!r}")
        self._rpc_timeout = float(value)

    @property
    def init_method(self) -> str:
        """URL specifying how to initialize the process group. Default is ``env://``."""
        return self._init_method

    @init_method.setter
    def init_method(self, value: str) -> None:
        if not isinstance(value, str) or "://" not in value:
            raise ValueError(f"init_method must be a URL such as 'env://', 'tcp://host:port' "
                             f"or 'file:///path', got {value!r}")
        self._init_method = value


class TensorPipeRpcBackendOptions(RpcBackendOptions):
    """The options of torchrpc's default backend (named as torch's, so ports need no change).

    Args:
        num_worker_threads (int): threads kept in the pool that runs requests (default 16).
            Threads blocked in RPCs don't count, so nested calls never deadlock.
        rpc_timeout (float): default timeout in seconds (default 60; 0 means none).
        init_method (str): rendezvous URL (default ``env://``).
        device_maps (Dict[str, Dict]): device placement from this worker to each callee;
            every map must be invertible.
        devices (List): local devices used by the agent.
        listen_addr (str, optional): address to listen on; default: the interface that
            reaches the rendezvous host (loopback for a local job).
        max_message_size (int): frames larger than this are refused (default 2 GiB).
        enable_shm (bool): same-host shared memory for large buffers (default True).
        enable_uds (bool): workers of one host (and network namespace) connect through a
            Unix socket instead of loopback TCP, with the same authentication (default
            True; see BENCHMARKS.md).
        shm_threshold (int): between workers of one host, buffers of at least this many
            bytes go through shared memory (default 256 KiB: below it the socket is as
            fast in a tight loop and faster between computations; see BENCHMARKS.md).
        heartbeat_interval (float): an idle connection carries a heartbeat this often, in
            seconds (default 0.5; 0 sends none, and peers then never time this worker out).
        heartbeat_timeout (float): a peer that sends heartbeats and brings nothing in on
            any connection for this long is lost: all its connections close and the calls
            pending on it fail (default 5 s; 0 never times one out). Must exceed
            ``heartbeat_interval``.
        send_timeout (float): a send that makes no progress for this long (the peer does
            not read) fails and closes its connection; so does a frame that waits this
            long for room in a full outbox (default 30 s; 0: no limit).
        max_outbox_bytes (int): bytes that may wait in one connection's outbox while
            another thread writes; beyond that a sending thread waits for room (back-
            pressure), up to ``send_timeout`` (default 64 MiB). Connection readers never
            wait.
        max_pending_requests (int): outstanding requests this worker may have at once;
            one more raises at once (default 1,048,576).
        max_private_connections (int): private connections to one peer (for blocking
            calls); calls beyond that many at once go over the shared one, and a peer's
            connections beyond that many are refused (default 32).
        max_queued_requests (int): requests that may wait for a thread of the pool; a
            call or ``remote()`` arriving beyond that fails at its caller with an error
            saying the worker is overloaded (default 65,536). The messages of the RRef and
            distributed autograd protocols are never refused.
        tls_certfile (str, optional): PEM certificate of this worker; setting it turns TLS on
            for every link. Every worker of the job needs one.
        tls_keyfile (str, optional): PEM private key, when not inside ``tls_certfile``.
        tls_cafile (str, optional): PEM certificates of the job's CA, which peers'
            certificates must chain to; required with ``tls_certfile`` (the system's trust
            store is never used).
        tls_require_client_cert (bool): mutual TLS: a connecting peer must present a
            certificate that chains to ``tls_cafile`` too (default True).
        tls_identity (str, optional): a name every peer's certificate must carry (a DNS or
            URI subject alternative name, or the common name), for example the job's name.
            Without it, a peer's certificate must name the IP address it is reached at or
            connects from (an IP address or a host name resolving to it).
        profile_kineto (bool): RPCs made under a Kineto profiler (``torch.profiler.profile``,
            ``torch.autograd.profiler.profile``) become profiler events too, with the
            callee's operators replayed as remote events (default False: as torch's RPC,
            only torch's legacy profiler, ``torch.autograd.profiler_legacy.profile``,
            records RPCs).
        log_debug_info_on_timeout (bool): when a call times out, log (as a warning of the
            ``torchrpc._agent.agent`` logger) this worker's debug info and the callee's,
            which it is asked for with a 5 s limit, on a pool thread (default False).
    """

    def __init__(self, *, num_worker_threads: int = constants.DEFAULT_NUM_WORKER_THREADS,
                 rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = constants.DEFAULT_INIT_METHOD,
                 device_maps: Optional[Dict[str, Dict[DeviceLike, DeviceLike]]] = None,
                 devices: Optional[List[DeviceLike]] = None,
                 _transports: Optional[List[Any]] = None, _channels: Optional[List[Any]] = None,
                 listen_addr: Optional[str] = None,
                 max_message_size: int = constants.DEFAULT_MAX_MESSAGE_SIZE,
                 enable_shm: bool = True,
                 enable_uds: bool = True,
                 shm_threshold: int = constants.DEFAULT_SHM_THRESHOLD,
                 heartbeat_interval: float = constants.DEFAULT_HEARTBEAT_INTERVAL,
                 heartbeat_timeout: float = constants.DEFAULT_HEARTBEAT_TIMEOUT,
                 send_timeout: float = constants.DEFAULT_SEND_TIMEOUT,
                 max_outbox_bytes: int = constants.DEFAULT_MAX_OUTBOX_BYTES,
                 max_pending_requests: int = constants.DEFAULT_MAX_PENDING_REQUESTS,
                 max_private_connections: int = constants.DEFAULT_MAX_PRIVATE_CONNECTIONS,
                 max_queued_requests: int = constants.DEFAULT_MAX_QUEUED_REQUESTS,
                 tls_certfile: Optional[str] = None, tls_keyfile: Optional[str] = None,
                 tls_cafile: Optional[str] = None,
                 tls_require_client_cert: bool = True,
                 tls_identity: Optional[str] = None,
                 profile_kineto: bool = False,
                 log_debug_info_on_timeout: bool = False) -> None:
        super().__init__(rpc_timeout, init_method)
        self.num_worker_threads = num_worker_threads
        self._device_maps: Dict[str, Dict[torch.device, torch.device]] = {}
        for to, dm in (device_maps or {}).items():
            self.set_device_map(to, dm)
        self._devices: List[torch.device] = []
        if devices:
            self.set_devices(devices)
        self._transports = _transports
        self._channels = _channels
        self.listen_addr = listen_addr
        self.max_message_size = max_message_size
        self.enable_shm = enable_shm
        self.enable_uds = enable_uds
        self.shm_threshold = shm_threshold
        self._heartbeat_interval = _seconds("heartbeat_interval", heartbeat_interval)
        self.heartbeat_timeout = heartbeat_timeout
        self.send_timeout = send_timeout
        self.max_outbox_bytes = max_outbox_bytes
        self.max_pending_requests = max_pending_requests
        self.max_private_connections = max_private_connections
        self.max_queued_requests = max_queued_requests
        self.tls_certfile = tls_certfile
        self.tls_keyfile = tls_keyfile
        self.tls_cafile = tls_cafile
        self.tls_require_client_cert = tls_require_client_cert
        if tls_identity is not None and (not isinstance(tls_identity, str) or not tls_identity):
            raise ValueError(f"tls_identity must be a non-empty str or None, got "
                             f"{tls_identity!r}")
        self.tls_identity = tls_identity
        if not isinstance(profile_kineto, bool):
            raise TypeError(f"profile_kineto must be a bool, got {profile_kineto!r}")
        self.profile_kineto = profile_kineto
        self.log_debug_info_on_timeout = log_debug_info_on_timeout

    @property
    def num_worker_threads(self) -> int:
        """The number of threads in the pool used to execute requests."""
        return self._num_worker_threads

    @num_worker_threads.setter
    def num_worker_threads(self, value: int) -> None:
        _check_number(type(self).__name__, "num_worker_threads", value, integer=True)
        if value < 1:
            raise ValueError(f"num_worker_threads must be an int >= 1, got {value!r}")
        self._num_worker_threads = value

    @property
    def max_message_size(self) -> int:
        """The largest frame this worker accepts, in bytes."""
        return self._max_message_size

    @max_message_size.setter
    def max_message_size(self, value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or value < 1024:
            raise ValueError(f"max_message_size must be an int >= 1024 bytes, got {value!r}")
        self._max_message_size = value

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats on an idle connection (0: none)."""
        return self._heartbeat_interval

    @heartbeat_interval.setter
    def heartbeat_interval(self, value: float) -> None:
        value = _seconds("heartbeat_interval", value)
        _check_heartbeat(value, self._heartbeat_timeout)
        self._heartbeat_interval = value

    @property
    def heartbeat_timeout(self) -> float:
        """Seconds of silence after which a connection is closed as dead (0: never)."""
        return self._heartbeat_timeout

    @heartbeat_timeout.setter
    def heartbeat_timeout(self, value: float) -> None:
        value = _seconds("heartbeat_timeout", value)
        _check_heartbeat(self._heartbeat_interval, value)
        self._heartbeat_timeout = value

    @property
    def send_timeout(self) -> float:
        """Seconds a send may make no progress, or wait for outbox room (0: no limit)."""
        return self._send_timeout

    @send_timeout.setter
    def send_timeout(self, value: float) -> None:
        self._send_timeout = _seconds("send_timeout", value)

    @property
    def max_outbox_bytes(self) -> int:
        """Bytes that may wait in one connection's outbox before senders wait for room."""
        return self._max_outbox_bytes

    @max_outbox_bytes.setter
    def max_outbox_bytes(self, value: int) -> None:
        self._max_outbox_bytes = _count("max_outbox_bytes", value, 1)

    @property
    def max_pending_requests(self) -> int:
        """Outstanding requests this worker may have at once."""
        return self._max_pending_requests

    @max_pending_requests.setter
    def max_pending_requests(self, value: int) -> None:
        self._max_pending_requests = _count("max_pending_requests", value, 1)

    @property
    def max_private_connections(self) -> int:
        """Private connections to one peer; more blocking calls at once share one."""
        return self._max_private_connections

    @max_private_connections.setter
    def max_private_connections(self, value: int) -> None:
        self._max_private_connections = _count("max_private_connections", value, 0)

    @property
    def max_queued_requests(self) -> int:
        """Requests that may wait for a pool thread; calls beyond that are refused."""
        return self._max_queued_requests

    @max_queued_requests.setter
    def max_queued_requests(self, value: int) -> None:
        self._max_queued_requests = _count("max_queued_requests", value, 1)

    @property
    def tls_certfile(self) -> Optional[str]:
        """PEM certificate of this worker; TLS is on when it is set."""
        return self._tls_certfile

    @tls_certfile.setter
    def tls_certfile(self, value: Optional[str]) -> None:
        self._tls_certfile = _path_or_none("tls_certfile", value)

    @property
    def tls_keyfile(self) -> Optional[str]:
        """PEM private key of this worker, when not inside ``tls_certfile``."""
        return self._tls_keyfile

    @tls_keyfile.setter
    def tls_keyfile(self, value: Optional[str]) -> None:
        self._tls_keyfile = _path_or_none("tls_keyfile", value)

    @property
    def tls_cafile(self) -> Optional[str]:
        """PEM CA certificates that peers' certificates must chain to."""
        return self._tls_cafile

    @tls_cafile.setter
    def tls_cafile(self, value: Optional[str]) -> None:
        self._tls_cafile = _path_or_none("tls_cafile", value)

    @property
    def tls_require_client_cert(self) -> bool:
        """Whether a connecting peer must present a certificate too (mutual TLS)."""
        return self._tls_require_client_cert

    @tls_require_client_cert.setter
    def tls_require_client_cert(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"tls_require_client_cert must be a bool, got {value!r}")
        self._tls_require_client_cert = value

    @property
    def log_debug_info_on_timeout(self) -> bool:
        """Whether a timed-out call logs the debug info of this worker and of the callee."""
        return self._log_debug_info_on_timeout

    @log_debug_info_on_timeout.setter
    def log_debug_info_on_timeout(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"log_debug_info_on_timeout must be a bool, got {value!r}")
        self._log_debug_info_on_timeout = value

    @property
    def device_maps(self) -> Dict[str, Dict[torch.device, torch.device]]:
        """The device map locations."""
        return {k: dict(v) for k, v in self._device_maps.items()}

    @property
    def devices(self) -> List[torch.device]:
        """All devices used by the local agent."""
        return list(self._devices)

    def set_device_map(self, to: str, device_map: Dict[DeviceLike, DeviceLike]) -> None:
        """Set device mapping between this worker and callee ``to``; calls add up.

        Args:
            to (str): callee name.
            device_map (Dict of int, str, or torch.device): this worker's devices to the
                callee's devices. The combined map must be invertible.
        """
        new = normalize_device_map(to, device_map)
        merged = dict(self._device_maps.get(to, {}))
        merged.update(new)
        self._device_maps[to] = normalize_device_map(to, merged)

    def set_devices(self, devices: List[DeviceLike]) -> None:
        """Set local devices used by the agent.

        Args:
            devices (List of int, str, or torch.device): local devices.
        """
        if not isinstance(devices, (list, tuple)):
            raise TypeError(f"devices must be a list, got {type(devices).__name__}")
        self._devices = [_to_device(d) for d in devices]
