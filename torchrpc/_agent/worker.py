"""WorkerInfo: the name and id of a worker."""

from __future__ import annotations

import operator
from typing import Any, Tuple

from .._rendezvous.names import check_worker_name


class WorkerInfo:
    """A structure that encapsulates information of a worker in the system.

    Contains the name and ID of the worker. Not meant to be constructed directly:
    get one from :func:`~torchrpc.rpc.get_worker_info` and pass it as ``to`` to
    avoid resolving a name on every call. Hashable; equal when it is the same worker.
    """

    __slots__ = ("_name", "_id")

    def __init__(self, name: str, id: int) -> None:
        self._name = check_worker_name(name)
        self._id = id

    # Read-only, as torch's; read through C getters, as they are on every call's path.
    name = property(operator.attrgetter("_name"), doc="The name of the worker.")
    id = property(operator.attrgetter("_id"), doc="Globally unique id to identify the worker.")

    def __eq__(self, other: Any) -> bool:
        return isinstance(other, WorkerInfo) and self._id == other._id and self._name == other._name

    def __hash__(self) -> int:
        return hash((self._id, self._name))

    def __repr__(self) -> str:
        return f"WorkerInfo(id={self._id}, name={self._name})"

    def __reduce__(self) -> Tuple[Any, ...]:
        return WorkerInfo, (self._name, self._id)
