"""Backend options: validated objects whose fields may be assigned after construction.

Settings are options, read once. Every ``TORCHRPC_*`` variable is the environment's way to
set one field of :class:`TensorPipeRpcBackendOptions`; a field left unset (None) takes the
variable's value when ``init_rpc`` starts (:func:`read_environment`, the one place that
reads them), else the built-in default. The layers below receive the values, never the
environment.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Dict, List, MutableMapping, Optional, Tuple

import torch

from .._agent.settings import Settings
from .._rendezvous import secret as _secret
from .._rendezvous.rendezvous import Deadline, Plan, interface_address, rendezvous_timeout
from . import _checks, constants
from ._checks import DeviceLike, Field

LISTEN_ADDR_ENV = "TORCHRPC_LISTEN_ADDR"
IFNAME_ENV = "TORCHRPC_IFNAME"
TORCH_IFNAME_ENV = "TP_SOCKET_IFNAME"  # torch's (TensorPipe's) variable, read after ours
RENDEZVOUS_TIMEOUT_ENV = "TORCHRPC_RENDEZVOUS_TIMEOUT"
SPIN_US_ENV = "TORCHRPC_SPIN_US"
SECRET_ENV = _secret.SECRET_ENV
SECRET_FILE_ENV = _secret.SECRET_FILE_ENV
VIA_STORE_ENV = _secret.VIA_STORE_ENV


class RpcBackendOptions:
    """An abstract structure encapsulating the options passed into the RPC backend.

    Args:
        rpc_timeout (float): default timeout in seconds for every RPC; 0 means none.
        init_method (str): URL of the rendezvous store, as for
            ``torch.distributed.init_process_group`` (default ``env://``).
    """

    def __init__(self, rpc_timeout: float = constants.DEFAULT_RPC_TIMEOUT_SEC,
                 init_method: str = constants.DEFAULT_INIT_METHOD) -> None:
        _checks.check_number(type(self).__name__, "rpc_timeout", rpc_timeout, construction=True)
        self.rpc_timeout = rpc_timeout
        self.init_method = init_method

    @property
    def rpc_timeout(self) -> float:
        """A float indicating the timeout to use for all RPCs."""
        return self._rpc_timeout

    @rpc_timeout.setter
    def rpc_timeout(self, value: float) -> None:
        _checks.check_number(type(self).__name__, "rpc_timeout", value)
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
        tensor_mac (bool): on plain TCP links, the frames' MACs cover the tensors' bytes
            too (GMAC, see docs/security.md); a tensor altered on the way closes the
            connection and fails its calls. Same-host links (Unix sockets, shared
            memory) and TLS need none. False leaves tensor bytes unchecked on links whose
            other end sets it too (default True).
        shm_threshold (int): between workers of one host, buffers of at least this many
            bytes go through shared memory (default 64 KiB: where tensors stop
            travelling inside the envelope; see BENCHMARKS.md).
        stripe_threshold (int): between workers of different hosts, a message carrying at
            least this many tensor bytes sends half of them over a second socket of its
            connection, so that two threads copy at once (default 4 MiB; 0: one socket
            only; see BENCHMARKS.md).
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

    The fields below are settings the environment may give too: left None, each takes its
    variable's value when ``init_rpc`` starts, else the built-in default.

    Keyword Args:
        listen_ifname (str, optional): listen on this network interface's address, unless
            ``listen_addr`` is set (``TORCHRPC_IFNAME``, else torch's ``TP_SOCKET_IFNAME``).
        rendezvous_timeout (float, optional): seconds for the whole rendezvous: opening
            the store, claiming the rank and name, the job secret and waiting for every
            worker (``TORCHRPC_RENDEZVOUS_TIMEOUT``; unset: the RPC timeout, at least 60 s).
        spin_us (float, optional): microseconds a blocking call polls its socket before it
            sleeps, 0 to 1e6 (``TORCHRPC_SPIN_US``; unset: 2000 while the workers of this
            host leave CPUs spare, 0 while they outnumber its CPUs, else 200; 0: never).
        secret (str, optional): the job secret, the same on every worker, at least 32
            characters (``TORCHRPC_SECRET``, removed from the environment once read). It
            never appears in the options' repr.
        secret_file (str, optional): a file of mode 0600 holding the job secret
            (``TORCHRPC_SECRET_FILE``).
        insecure_secret_in_store (bool, optional): share the job secret through the
            rendezvous store, for trusted networks only
            (``TORCHRPC_INSECURE_SECRET_IN_STORE=1``; unset: off).
    """

    listen_ifname = Field(_checks.name_or_none,
                            'Network interface whose address to listen on (None: from the environment).', "name a network interface such as 'eth0'")
    rendezvous_timeout = Field(_checks.rendezvous_seconds,
                                 'Seconds for the whole rendezvous (None: from the environment, else the RPC timeout, at least 60 s).')
    spin_us = Field(_checks.spin_us,
                      'Microseconds a blocking call polls its socket before it sleeps (None: from the environment, else 2000 with spare CPUs, 0 with more workers than CPUs, else 200).')
    secret = Field(_checks.secret_or_none,
                     'The job secret (None: from the environment, else shared by rank 0).')
    secret_file = Field(_checks.path_or_none,
                          'A file of mode 0600 holding the job secret (None: from the environment).')
    insecure_secret_in_store = Field(_checks.flag_or_none,
                                       'Whether the job secret travels through the store (None: from the environment, else no).')
    listen_addr = Field(_checks.name_or_none,
                        'Address to listen on (None: the interface that reaches the rendezvous host).', "give an IP address or a host name")
    enable_shm = Field(_checks.flag,
                       'Whether workers of one host pass large buffers through shared memory.')
    enable_uds = Field(_checks.flag,
                       'Whether workers of one host connect through a Unix socket.')
    shm_threshold = Field(_checks.count,
                          'Bytes from which a buffer goes through shared memory, between workers of one host.', 0)
    stripe_threshold = Field(_checks.count,
                             'Tensor bytes from which a message between hosts uses two sockets (0: never).', 0)
    max_message_size = Field(_checks.count,
                               'The largest frame this worker accepts, in bytes.', 1024)
    send_timeout = Field(_checks.seconds,
                           'Seconds a send may make no progress, or wait for outbox room (0: no limit).')
    max_outbox_bytes = Field(_checks.count,
                               "Bytes that may wait in one connection's outbox before senders wait for room.", 1)
    max_pending_requests = Field(_checks.count,
                                   'Outstanding requests this worker may have at once.', 1)
    max_private_connections = Field(_checks.count,
                                      'Private connections to one peer; more blocking calls at once share one.', 0)
    max_queued_requests = Field(_checks.count,
                                  'Requests that may wait for a pool thread; calls beyond that are refused.', 1)
    tls_certfile = Field(_checks.path_or_none,
                           'PEM certificate of this worker; TLS is on when it is set.')
    tls_keyfile = Field(_checks.path_or_none,
                          'PEM private key of this worker, when not inside ``tls_certfile``.')
    tls_cafile = Field(_checks.path_or_none,
                         "PEM CA certificates that peers' certificates must chain to.")
    tls_require_client_cert = Field(_checks.flag,
                                      'Whether a connecting peer must present a certificate too (mutual TLS).')
    tensor_mac = Field(_checks.flag,
                       "Whether the frames' MACs on plain TCP cover the tensors' bytes.")
    log_debug_info_on_timeout = Field(_checks.flag,
                                        'Whether a timed-out call logs the debug info of this worker and of the callee.')

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
                 tensor_mac: bool = True,
                 shm_threshold: int = constants.DEFAULT_SHM_THRESHOLD,
                 stripe_threshold: int = constants.DEFAULT_STRIPE_THRESHOLD,
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
                 log_debug_info_on_timeout: bool = False,
                 listen_ifname: Optional[str] = None,
                 rendezvous_timeout: Optional[float] = None,
                 spin_us: Optional[float] = None,
                 secret: Optional[str] = None,
                 secret_file: Optional[str] = None,
                 insecure_secret_in_store: Optional[bool] = None) -> None:
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
        self.tensor_mac = tensor_mac
        self.shm_threshold = shm_threshold
        self.stripe_threshold = stripe_threshold
        self._heartbeat_interval = _checks.seconds("heartbeat_interval", heartbeat_interval)
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
        self.listen_ifname = listen_ifname
        self.rendezvous_timeout = rendezvous_timeout
        self.spin_us = spin_us
        self.secret = secret
        self.secret_file = secret_file
        self.insecure_secret_in_store = insecure_secret_in_store
        # Set on the copy read_environment makes: the plan of that init_rpc's rendezvous.
        self._rendezvous_plan: Optional[Plan] = None

    @property
    def rendezvous_plan(self) -> Optional[Plan]:
        """The rendezvous plan (deadline, secret source) of the ``init_rpc`` these options
        were read for; None on options that did not go through :func:`read_environment`."""
        return self._rendezvous_plan

    @property
    def num_worker_threads(self) -> int:
        """The number of threads in the pool used to execute requests."""
        return self._num_worker_threads

    @num_worker_threads.setter
    def num_worker_threads(self, value: int) -> None:
        _checks.check_number(type(self).__name__, "num_worker_threads", value, integer=True)
        if value < 1:
            raise ValueError(f"num_worker_threads must be an int >= 1, got {value!r}")
        self._num_worker_threads = value

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats on an idle connection (0: none)."""
        return self._heartbeat_interval

    @heartbeat_interval.setter
    def heartbeat_interval(self, value: float) -> None:
        value = _checks.seconds("heartbeat_interval", value)
        _checks.check_heartbeat(value, self._heartbeat_timeout)
        self._heartbeat_interval = value

    @property
    def heartbeat_timeout(self) -> float:
        """Seconds of silence after which a connection is closed as dead (0: never)."""
        return self._heartbeat_timeout

    @heartbeat_timeout.setter
    def heartbeat_timeout(self, value: float) -> None:
        value = _checks.seconds("heartbeat_timeout", value)
        _checks.check_heartbeat(self._heartbeat_interval, value)
        self._heartbeat_timeout = value

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
                callee's devices (``"cpu"`` included). ``init_rpc`` checks that the map
                is invertible and that both workers have the devices it names.
        """
        new = _checks.normalize_device_map(to, device_map)
        self._device_maps[to] = _checks.merge_device_map(
            to, self._device_maps.get(to, {}), new)

    def set_devices(self, devices: List[DeviceLike]) -> None:
        """Set local devices used by the agent.

        Args:
            devices (List of int, str, or torch.device): local CUDA devices.
        """
        self._devices = _checks.cuda_devices(devices)


def _from_env(environ: MutableMapping[str, str], name: str, parse: Callable[[str], Any],
              check: Callable[[str, Any], Any], fix: str) -> Any:
    """Variable ``name`` parsed and checked as its field is, or None when it is unset or
    empty; a bad value raises a ValueError that names the variable."""
    text = environ.get(name)
    if not text:
        return None
    try:
        return check(name, parse(text))
    except (TypeError, ValueError) as exc:
        raise ValueError(f"environment variable {name}={text!r} is not valid: {fix}") from exc


def _env_rendezvous_timeout(environ: MutableMapping[str, str]) -> Optional[float]:
    return _from_env(environ, RENDEZVOUS_TIMEOUT_ENV, float, _checks.rendezvous_seconds,
                     "give a number of seconds > 0, or unset it")


def _rpc_timeout_or_default(options: RpcBackendOptions) -> float:
    return options.rpc_timeout or constants.DEFAULT_RENDEZVOUS_TIMEOUT.total_seconds()


def rendezvous_plan_of(options: TensorPipeRpcBackendOptions) -> Plan:
    """The rendezvous plan ``init_rpc`` read for ``options``; for options that did not go
    through it (a backend started directly), one from their timeouts, starting now."""
    if options.rendezvous_plan is not None:
        return options.rendezvous_plan
    return Plan(Deadline(rendezvous_timeout(_rpc_timeout_or_default(options),
                                            options.rendezvous_timeout)))


def read_environment(options: RpcBackendOptions, environ: MutableMapping[str, str],
                     launcher_secret: Optional[str] = None
                     ) -> Tuple[RpcBackendOptions, Plan]:
    """The settings of one ``init_rpc``: a copy of ``options`` whose unset (None) fields
    take their ``TORCHRPC_*`` variables from ``environ``, and the rendezvous plan, whose
    deadline starts here. ``launcher_secret``: ``TORCHRPC_SECRET`` as this process read it
    (the caller removes the variable from the environment).

    Options of a registered third-party backend are returned as they are; only the
    rendezvous timeout applies to them. Options already read are returned as they are.
    """
    rpc_timeout = _rpc_timeout_or_default(options)
    if not isinstance(options, TensorPipeRpcBackendOptions):
        deadline = Deadline(rendezvous_timeout(rpc_timeout, _env_rendezvous_timeout(environ)))
        return options, Plan(deadline)
    if options.rendezvous_plan is not None:
        return options, options.rendezvous_plan
    read = copy.copy(options)
    if not read.listen_addr:
        read.listen_addr = environ.get(LISTEN_ADDR_ENV) or None
    if read.listen_ifname is None:
        read.listen_ifname = environ.get(IFNAME_ENV) or environ.get(TORCH_IFNAME_ENV) or None
    if not read.listen_addr and read.listen_ifname is not None:
        # The interface's address, looked up once: the agent listens on listen_addr.
        read.listen_addr = interface_address(read.listen_ifname)
    if read.rendezvous_timeout is None:
        read.rendezvous_timeout = rendezvous_timeout(rpc_timeout,
                                                     _env_rendezvous_timeout(environ))
    if read.spin_us is None:
        read.spin_us = _from_env(environ, SPIN_US_ENV, float, _checks.spin_us,
                                 "give microseconds between 0 and 1e6 (0: never poll), or "
                                 "unset it")
    if read.secret is None:
        read.secret = launcher_secret or None
    if read.secret_file is None:
        read.secret_file = environ.get(SECRET_FILE_ENV) or None
    if read.insecure_secret_in_store is None:
        read.insecure_secret_in_store = environ.get(VIA_STORE_ENV, "") not in ("", "0")
    source = _secret.Source(None if read.secret is None else read.secret.encode(),
                            read.secret_file, read.insecure_secret_in_store)
    read._rendezvous_plan = Plan(Deadline(read.rendezvous_timeout), source)
    return read, read._rendezvous_plan


def agent_settings(options: TensorPipeRpcBackendOptions) -> Settings:
    """The settings an agent runs with: the fields of ``options`` (validated as they were
    set), read once."""
    return Settings(
        rpc_timeout=float(options.rpc_timeout), init_method=options.init_method,
        num_worker_threads=int(options.num_worker_threads), device_maps=options.device_maps,
        devices=tuple(options.devices), listen_addr=options.listen_addr,
        max_message_size=int(options.max_message_size), enable_shm=bool(options.enable_shm),
        enable_uds=bool(options.enable_uds), tensor_mac=bool(options.tensor_mac),
        shm_threshold=int(options.shm_threshold),
        stripe_threshold=int(options.stripe_threshold),
        heartbeat_interval=float(options.heartbeat_interval),
        heartbeat_timeout=float(options.heartbeat_timeout),
        send_timeout=float(options.send_timeout), max_outbox_bytes=int(options.max_outbox_bytes),
        max_pending_requests=int(options.max_pending_requests),
        max_private_connections=int(options.max_private_connections),
        max_queued_requests=int(options.max_queued_requests),
        tls_certfile=options.tls_certfile, tls_keyfile=options.tls_keyfile,
        tls_cafile=options.tls_cafile,
        tls_require_client_cert=bool(options.tls_require_client_cert),
        tls_identity=options.tls_identity, profile_kineto=bool(options.profile_kineto),
        log_debug_info_on_timeout=bool(options.log_debug_info_on_timeout),
        spin_us=options.spin_us)
