"""Default values, under the names torch.distributed.rpc.constants uses."""

from datetime import timedelta

from .._wire import INLINE_MAX

DEFAULT_RPC_TIMEOUT_SEC: float = 60.0
UNSET_RPC_TIMEOUT: float = -1.0
DEFAULT_INIT_METHOD: str = "env://"
DEFAULT_SHUTDOWN_TIMEOUT: float = 0.0
DEFAULT_NUM_WORKER_THREADS: int = 16
DEFAULT_MAX_MESSAGE_SIZE: int = 2 << 30
# Buffers past the inline bound go through shared memory; measured: see BENCHMARKS.md.
DEFAULT_SHM_THRESHOLD: int = INLINE_MAX
# Frames with this many tensor bytes between hosts use two sockets (BENCHMARKS.md).
DEFAULT_STRIPE_THRESHOLD: int = 4 << 20
DEFAULT_RENDEZVOUS_TIMEOUT = timedelta(seconds=300)
DEFAULT_HEARTBEAT_INTERVAL: float = 0.5
DEFAULT_HEARTBEAT_TIMEOUT: float = 5.0
# Bounds (see the README's options table).
DEFAULT_SEND_TIMEOUT: float = 30.0
DEFAULT_MAX_OUTBOX_BYTES: int = 64 << 20
DEFAULT_MAX_PENDING_REQUESTS: int = 1 << 20
DEFAULT_MAX_PRIVATE_CONNECTIONS: int = 32
DEFAULT_MAX_QUEUED_REQUESTS: int = 1 << 16
