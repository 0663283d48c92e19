"""An agent with no sockets, for tests of its parts driven by messages alone: built as a
backend builds it and never started; fake connections record the frames sent on them,
and the store is an in-memory one."""

from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch.distributed as dist

from torchrpc import _wire
from torchrpc._agent import Agent, collect
from torchrpc._agent.futures import mark_reader_thread, new_future
from torchrpc._agent.lifecycle import RUNNING
from torchrpc._agent.pending import Pending
from torchrpc._rendezvous.rendezvous import PREFIX, Records
from torchrpc._wire import Kind
from torchrpc.errors import RpcError, ThreadFailedError
from torchrpc.rpc.options import TensorPipeRpcBackendOptions, agent_settings

SECRET = b"s" * 64  # the job secret of the agents made here (no rendezvous)


class FakeConn:
    """The transport's connection, as the agent sees it: records what is sent on it."""

    def __init__(self, peer_rank: int, fail: bool = False) -> None:
        self.peer_rank = peer_rank
        self.private = False
        self.outbound = True
        self.closed = False
        self.fail = fail
        self.sent: List[Tuple[int, int, int]] = []  # kind, flags, request id
        self.payloads: List[Tuple[bytes, Any]] = []  # envelope and buffers, in that order

    def send(self, kind: int, flags: int, rid: int, env: bytes, bufs: Any,
             keep: Any = None) -> None:
        if self.fail:
            raise RpcError("broken")
        self.sent.append((kind, flags, rid))
        self.payloads.append((bytes(env), bufs))

    def close(self, reason: Optional[BaseException] = None) -> None:
        self.closed = True

    def goodbyes(self) -> int:
        return sum(1 for kind, flags, _ in self.sent
                   if kind == Kind.GOODBYE and flags & _wire.FLAG_ONEWAY)


class NoTransport:
    """A transport that reaches nobody and has no connections."""

    secure = False

    def connect(self, *args: Any, **kwargs: Any) -> Any:
        raise RpcError("unreachable")

    def connections(self) -> List[Any]:
        return []

    def close(self, timeout: float = 10.0) -> None:
        pass


def info(name: str, rank: int, incarnation: int = 0) -> dict:
    """What worker ``name`` publishes when it joins (a membership event without "op")."""
    return {"name": name, "rank": rank, "host": "127.0.0.1", "port": 1 + rank, "hostid": "h",
            "incarnation": incarnation}


class Agents:
    """Makes agents that own no socket; :meth:`close` stops those still running."""

    def __init__(self) -> None:
        self.made: List[Agent] = []
        collect.install()  # as init_rpc does

    def __call__(self, world_size: Optional[int] = 1, store: Any = None) -> Agent:
        """An agent of rank 0 (``worker0``); in a fixed group it knows its
        ``world_size`` workers already, in a dynamic one (None) only itself."""
        options = TensorPipeRpcBackendOptions(num_worker_threads=2, rpc_timeout=5)
        agent = Agent(store if store is not None else dist.HashStore(), "worker0", 0,
                      world_size, agent_settings(options))
        # as start() leaves it: the job secret is known, the group's records are sealed
        agent.store = Records(agent.store, SECRET, PREFIX)
        for rank in range(world_size or 1):
            agent.registry.add(rank, info(f"worker{rank}", rank, agent.registry.incarnation
                                          if rank == 0 else 0))
        self.made.append(agent)
        return agent

    def close(self) -> None:
        mark_reader_thread(False)  # _on_frame marks the thread that delivers a frame
        for agent in self.made:
            if agent.lifecycle.state is RUNNING:
                agent._transport = None
                try:
                    agent.shutdown(graceful=False)
                except ThreadFailedError:
                    pass  # a failed agent stops, then says why: the test saw that


def running(agent: Agent) -> Agent:
    """``agent``, as start() leaves it after the rendezvous, serving."""
    agent.shutdown_protocol.enter(RUNNING)
    agent.mark_ready()
    return agent


def pending_to(agent: Agent, rank: int, rid: int = 7) -> Pending:
    """A request to worker ``rank`` waiting for its reply."""
    p = Pending(new_future(agent.pool), agent.registry.workers[rank], "f", 0, None)
    agent.requests.add(rid, p, None)
    return p


def deliver(agent: Agent, conn: FakeConn, kind: int) -> None:
    """A one-way frame of ``kind`` with no payload arrives on ``conn``."""
    envelope = _wire.encode(None)[0]
    header = _wire.Header(kind, _wire.FLAG_ONEWAY, 0, len(envelope), 0)
    agent.inbound.on_frame(conn, header, envelope, [])
