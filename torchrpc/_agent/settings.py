"""The settings an agent runs with: one typed, read-only object, validated above.

``rpc/options.py`` validates every field of the backend options a user builds and reads
the environment once (:func:`torchrpc.rpc.options.agent_settings` makes this object from
them); the agent and its parts read these fields and nothing else, with no defaults of
their own. The fields mean what the options' fields of the same names mean (see
:class:`~torchrpc.rpc.TensorPipeRpcBackendOptions`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Tuple

import torch

DeviceMaps = Dict[str, Dict[torch.device, torch.device]]


@dataclass(frozen=True)
class Settings:
    """What an agent is configured with (see the module docs)."""

    rpc_timeout: float
    init_method: str
    num_worker_threads: int
    device_maps: DeviceMaps
    devices: Tuple[torch.device, ...]
    listen_addr: Optional[str]
    max_message_size: int
    enable_shm: bool
    enable_uds: bool
    tensor_mac: bool
    shm_threshold: int
    stripe_threshold: int
    heartbeat_interval: float
    heartbeat_timeout: float
    send_timeout: float
    max_outbox_bytes: int
    max_pending_requests: int
    max_private_connections: int
    max_queued_requests: int
    tls_certfile: Optional[str]
    tls_keyfile: Optional[str]
    tls_cafile: Optional[str]
    tls_require_client_cert: bool
    tls_identity: Optional[str]
    profile_kineto: bool
    log_debug_info_on_timeout: bool
    spin_us: Optional[float]
