"""The caller's side of at-most-once: resending only what did not arrive (``Probes``).

Theory of operation. An attempt of a request with the ONCE flag that may have reached
the callee (its send returned: the frame was queued, and the connection broke after) is
not sent again blindly: the attempt asks the callee first, with one small probe for all
such requests to that peer (ids only, see _wire/probe.py), and sends the frame again only
for the ids the callee never got. For the others it keeps waiting for the reply, under
the same deadline. A probe that cannot be sent, or whose connection breaks before the
answer, fails the attempt like a failed send: the next one, after the policy's backoff,
probes again. The callee's dedup (``Dispatch.first_time``) stays the safety net: a frame
still in the old connection's buffers may reach it after the probe said it was missing.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable, Dict, List

from .. import _wire
from .._transport import Connection
from .._wire import Kind
from .._wire.probe import MISSING
from ..errors import RpcError
from .pending import Pending, Resend
from .route import Sender
from .worker import WorkerInfo

log = logging.getLogger(__name__)

# How long a caller waits to ask again about an at-most-once request that the callee
# said it has (its reply may have been lost with the connection it left on).
_RECHECK = 1.0


class Probes:
    """The probes one agent sends before sending requests again, and what they found.

    ``calls``: the caller's side, which sends again or fails what a probe found;
    ``name``: the agent's (for logs); ``pending``: the request table, read only;
    ``shared_to(dst)``: the shared connection to ``dst`` (Connections.to), which carries
    the probes; ``call_later(delay, fn, *args)``: the timer's.
    """

    def __init__(self, calls: Sender, name: str, pending: Dict[int, Pending],
                 shared_to: Callable[[WorkerInfo], Connection],
                 call_later: Callable[..., None]) -> None:
        self._calls = calls
        self._name = name
        self._pending = pending
        self._shared_to = shared_to
        self._call_later = call_later
        # rank -> ids of requests whose next attempt asks that peer first (one probe for all).
        self._due: Dict[int, List[int]] = {}
        self._lock = threading.Lock()
        self.sent = 0  # probe frames sent
        self.resends_avoided = 0  # requests a probe found delivered, not sent again
        self.resends_after_probe = 0  # requests a probe found missing, sent again

    def later(self, dst: WorkerInfo, rid: int, delay: float) -> None:
        """Let the next attempt of request ``rid`` ask ``dst`` first, in ``delay`` seconds
        (or with the probe already due for ``dst``)."""
        with self._lock:
            due = self._due.get(dst.id)
            if due is not None:
                due.append(rid)
                return
            self._due[dst.id] = [rid]
        self._call_later(delay, self._probe_peer, dst)

    def answered(self, r: Resend) -> None:
        """The reply of a request came before its probe's answer."""
        with self._lock:
            if r.probing:
                r.probing = False
                if not r.known:
                    self.resends_avoided += 1

    def _probe_peer(self, dst: WorkerInfo) -> None:
        """Ask ``dst`` which of the requests due to be probed it has."""
        with self._lock:
            due = self._due.pop(dst.id, [])
        asking = []
        for rid in due:
            p = self._pending.get(rid)
            r = p.resend if p is not None else None
            if r is None or not r.scheduled:
                continue  # answered, timed out or failed meanwhile
            r.scheduled = False
            r.probing = True
            asking.append(rid)
        for i in range(0, len(asking), _wire.MAX_PROBE_IDS):
            ids = asking[i:i + _wire.MAX_PROBE_IDS]
            with self._lock:  # counted first: the answer may come before send returns
                self.sent += 1
            try:
                self._shared_to(dst).send(Kind.ONCE_PROBE, _wire.FLAG_ONEWAY, 0,
                                          _wire.pack_probe(ids), [], None)
            except RpcError as exc:  # not sent: this attempt failed
                with self._lock:
                    self.sent -= 1
                for rid in ids:
                    self._calls.request_lost(rid, dst, exc)
                continue
            log.info("%s asks %s whether it has %d request(s) before sending them again",
                     self._name, dst.name, len(ids))

    def on_status(self, conn: Connection, envelope: bytes) -> None:
        """The answer to a probe: send again what the callee never got; wait for the rest."""
        pending = self._pending
        missing = []
        for rid, status in _wire.parse_status(envelope):
            p = pending.get(rid)
            r = p.resend if p is not None else None
            if r is None or p.dst.id != conn.peer_rank:
                continue  # answered (the kept reply came just before), timed out or failed
            with self._lock:  # one answer acts once
                if not r.probing:
                    continue  # an answer to an earlier attempt's probe
                r.probing = False
                if status == MISSING:
                    self.resends_after_probe += 1
                    missing.append((rid, p))
                    continue
                if not r.known:
                    r.known = True
                    self.resends_avoided += 1
                # Its reply may yet be lost (sent on the broken connection before the
                # callee saw it break): ask again later, while it is still unanswered.
                r.scheduled = True
            self.later(p.dst, rid, _RECHECK)
        for rid, p in missing:
            r = p.resend
            self._calls.transmit(None, rid, p, r.kind, r.flags, r.env, r.bufs, r.keep)
