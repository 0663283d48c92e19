"""Message kinds. The ids are part of the wire format: never renumber one.

A kind says what the envelope of a frame means. ``CALL`` and the upper-layer
request kinds are answered by a ``RESPONSE`` or an ``ERROR`` frame carrying the
same request id; frames with the ``ONEWAY`` flag are not answered. ``ONCE_PROBE`` is
one-way and answered by a one-way ``ONCE_STATUS`` (see :mod:`torchrpc._wire.probe`).
"""

from __future__ import annotations

import enum


class Kind(enum.IntEnum):
    """Every message kind on the wire, with its fixed id."""

    # agent
    CALL = 1
    RESPONSE = 2
    ERROR = 3
    GOODBYE = 4
    HEARTBEAT = 5
    SHUTDOWN_SYNC = 6
    ONCE_PROBE = 7  # which of these requests (ONCE flag) do you have? (see probe.py)
    ONCE_STATUS = 8  # the answer: a status per request id
    SNAPSHOT = 9  # an observer asks for a worker's snapshot (see _agent/snapshot.py)
    # RRef protocol (see torchrpc._rref)
    RREF_REMOTE_CALL = 16
    RREF_FETCH = 17
    RREF_USER_DELETE = 18
    RREF_FORK_REQUEST = 19
    RREF_CHILD_ACCEPT = 20
    RREF_METHOD_CALL = 21
    # distributed autograd (see torchrpc._dist_autograd)
    AUTOGRAD_BACKWARD = 32
    AUTOGRAD_RELEASE = 33
    AUTOGRAD_DONE = 34
    # profiler
    PROFILED_CALL = 48
    # CUDA IPC (see torchrpc._agent.cuda_ipc): a receiver has copied these shares
    CUDA_RELEASE = 64


KNOWN_KINDS = frozenset(int(k) for k in Kind)

# How error messages name the items of a request's payload tuple, by kind (a payload
# that cannot be pickled is reported as, e.g., ``args[1]['obs']``).
PAYLOAD_NAMES = {
    Kind.CALL: ("func", "args", "kwargs"),
    Kind.RREF_REMOTE_CALL: ("func", "args", "kwargs", "rref_id", "fork_id", "deletes"),
}
