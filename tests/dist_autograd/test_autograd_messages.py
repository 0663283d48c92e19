"""Distributed autograd's messages and its credit and deadline machine, with no sockets.

The messages cross the wire format; the pass books are driven by hand; and whole
engines run on fake agents joined back to back (:class:`_Net`), whose requests are
served on threads and whose lost workers are declared by the test: credit adds up to
one across the parts of a pass, which ends exactly once; a lost worker's error reaches
the root; late and duplicate reports change nothing; every hop gets the time the root
has left.
"""

from __future__ import annotations

import itertools
import threading
import time
from fractions import Fraction
from typing import Any, List, Optional, Tuple

import pytest
import torch

from torchrpc._agent import Extensions, WorkerInfo
from torchrpc._agent.remote_error import capture, rebuild_error
from torchrpc._dist_autograd.engine import install
from torchrpc._dist_autograd.messages import BackwardRequest, DoneReport
from torchrpc._dist_autograd.passes import (PassBook, RootPass, deadline_of, plan_forward,
                                            time_left)
from torchrpc._dist_autograd.records import (DistAutogradContext, RecvRecorder, SendRecorder,
                                             local_pass, make_context_id)
from torchrpc._wire import Kind
from torchrpc.errors import ConnectionLostError, RpcTimeoutError

from ..support.autograd import SleepInBackward
from ..support.group import wait_for
from ..wire.test_wire import round_trip

PASS = (0, 1)


def test_a_report_of_a_lost_part_carries_no_credit_and_ends_the_pass_at_the_root():
    lost = ConnectionLostError("worker worker3 (rank 3) was lost", worker="worker3")
    report = round_trip(DoneReport(PASS, Fraction(0), capture(lost, "worker2")))
    assert report.credit == 0 and report.pass_id == PASS
    error = rebuild_error(report.error)
    assert isinstance(error, ConnectionLostError) and "worker3" in str(error)
    state = RootPass()
    state.add(Fraction(1, 2), None)
    assert not state.done
    state.add(report.credit, error)
    assert state.done and state.error is error


def test_credit_comes_back_in_parts():
    state = RootPass()
    for part in (Fraction(1, 2), Fraction(1, 4), Fraction(1, 4)):
        assert not state.done
        state.add(round_trip(DoneReport(PASS, part)).credit, None)
    assert state.done and state.error is None and state.wait(0)


@pytest.mark.parametrize("credit", [Fraction(0), Fraction(3, 2), Fraction(-1, 2), 0.5, 1])
def test_a_report_without_an_error_needs_credit_in_0_1(credit):
    with pytest.raises(ValueError, match="credit must be a Fraction in"):
        DoneReport(PASS, credit)


def test_a_report_with_an_error_still_refuses_bad_credit():
    info = capture(RuntimeError("boom"), "worker2")
    with pytest.raises(ValueError, match="credit must be a Fraction in"):
        DoneReport(PASS, Fraction(3, 2), info)


# -- the pass books, with no agent ---------------------------------------------------------------


def test_a_pass_ends_exactly_once_and_late_or_duplicate_reports_change_nothing():
    book = PassBook(0)
    pass_id, state = book.start(7, None)
    assert book.credit_back(pass_id, Fraction(1, 2), None) is False
    assert book.credit_back(pass_id, Fraction(1, 2), None) is True
    # the same report again (sent twice), and an error that comes after the end
    assert book.credit_back(pass_id, Fraction(1, 2), None) is False
    assert book.credit_back(pass_id, Fraction(0), ConnectionLostError("late")) is False
    assert state.done and state.error is None
    book.finish(pass_id)
    assert book.credit_back(pass_id, Fraction(1, 2), None) is False  # the root has moved on
    assert book.credit_back((3, 99), Fraction(1), None) is False  # a pass nobody knows


def test_a_lost_worker_ends_the_passes_that_reached_it_and_names_the_others():
    root, middle = PassBook(0), PassBook(1)
    pass_id, state = root.start(7, None)
    middle.part_starts(7, pass_id, [(1, 0)], held=True)
    middle.exit(7)
    lost = ConnectionLostError("worker2 was lost", worker="worker2")
    assert middle.worker_lost(2, {7}, lost) == [pass_id]  # the root must hear of it
    assert middle.worker_lost(0, {7}, lost) == []  # the root itself: nobody to tell
    report = round_trip(DoneReport(pass_id, Fraction(0), capture(lost, "worker1")))
    assert root.credit_back(report.pass_id, report.credit, rebuild_error(report.error))
    assert state.done and isinstance(state.error, ConnectionLostError)
    assert "worker2" in str(state.error)
    # a pass rooted here in a context that reached the lost worker ends there and then
    other, waiting = root.start(8, None)
    assert root.worker_lost(2, {8}, lost) == []
    assert waiting.done and waiting.error is lost


def _routed(*ranks: int) -> dict:
    return {rank: [((rank, 0), torch.ones(1))] for rank in ranks}


def test_credit_is_split_among_the_parts_and_adds_up_to_one():
    plan = plan_forward(7, PASS, _routed(1, 2, 3), Fraction(1), None, None, 0.0)
    assert [rank for rank, _ in plan.requests] == [1, 2, 3]
    assert plan.reply is None and not plan.reports
    # each part splits its share again; the leaves return what they got
    returned = []
    for _, req in plan.requests:
        req = round_trip(req)
        assert req.time_left is None
        sub = plan_forward(7, PASS, _routed(0, 4), req.credit, 0, None, 0.0)
        assert sub.reply is not None and len(sub.requests) == 1
        returned.append(sub.reply.credit)
        leaf = plan_forward(7, PASS, {}, sub.requests[0][1].credit, 1, None, 0.0)
        returned.extend(credit for credit, _ in leaf.reports)
    assert sum(returned) == 1
    state = RootPass()
    assert [state.add(credit, None) for credit in returned].count(True) == 1


def test_requests_carry_the_time_left_and_none_goes_out_after_the_deadline():
    plan = plan_forward(7, PASS, _routed(1, 2), Fraction(1), None, 10.0, 7.5)
    assert [round_trip(req).time_left for _, req in plan.requests] == [2.5, 2.5]
    late = plan_forward(7, PASS, _routed(1, 2), Fraction(1, 2), 0, 10.0, 10.5, "worker3")
    assert not late.requests and late.reply is None
    assert [credit for credit, _ in late.reports] == [Fraction(1, 4), Fraction(1, 4)]
    for _, error in late.reports:
        assert isinstance(error, RpcTimeoutError) and "worker3" in str(error)
    assert time_left(None, 5.0) is None and time_left(4.0, 5.0) == 0.0
    assert deadline_of(2.5, 100.0) == 102.5 and deadline_of(None, 100.0) is None


@pytest.mark.parametrize("left", [-1.0, float("nan"), float("inf"), 1, "1"])
def test_a_request_refuses_a_bad_time_left(left):
    with pytest.raises(ValueError, match="time_left must be None or a float"):
        BackwardRequest(7, PASS, Fraction(1), (((1, 0), torch.ones(1)),), left)


# -- engines on fake agents joined back to back ----------------------------------------------------


class _FakeAgent:
    """What the engine uses of an agent; its requests go through a :class:`_Net`."""

    def __init__(self, net: "_Net", rank: int, timeout: float) -> None:
        self.net = net
        self.rank = rank
        self.name = f"worker{rank}"
        self.info = WorkerInfo(self.name, rank)
        self.default_timeout = timeout
        self.extensions = Extensions()
        self.handlers: dict = {}
        self.loss_hooks: list = []

    def add_call_hook(self, hook: Any) -> None:
        pass

    def register_handler(self, kind: int, handler: Any) -> None:
        self.handlers[int(kind)] = handler

    def add_debug_source(self, name: str, source: Any) -> None:
        pass

    def add_loss_hook(self, hook: Any) -> None:
        self.loss_hooks.append(hook)

    def add_tick_hook(self, hook: Any, pending: Any = None) -> None:
        pass

    def add_shutdown_hook(self, hook: Any) -> None:
        pass

    def resolve(self, rank: int) -> WorkerInfo:
        return self.net.agents[rank].info

    def request(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                what: Any = None, retry: Any = None) -> torch.futures.Future:
        return self.net.deliver(self.rank, dst.id, int(kind), payload, timeout)

    def request_sync(self, dst: WorkerInfo, kind: int, payload: Any, timeout: float,
                     what: Any = None, retry: Any = None) -> Any:
        return self.request(dst, kind, payload, timeout).wait()


class _Net:
    """Engines on fake agents: a request crosses the wire format, is served by the
    callee's handler on a thread of its own, and its reply crosses back; a request to a
    dead worker waits until its timeout, or until the worker is declared lost."""

    def __init__(self, size: int, timeout: float = 30.0) -> None:
        self.agents = [_FakeAgent(self, rank, timeout) for rank in range(size)]
        self.engines = [install(agent) for agent in self.agents]
        self.dead: set = set()
        self.sent: List[Tuple[int, int, int, Any, float]] = []  # src, dst, kind, payload, timeout
        self._waiting: List[Tuple[int, torch.futures.Future]] = []
        self._lock = threading.Lock()
        self._settled: set = set()  # ids of the futures settled (all are kept in sent)
        self._futures: List[torch.futures.Future] = []
        self._messages = itertools.count(1)

    def _settle(self, fut: torch.futures.Future, value: Any = None,
                error: Optional[BaseException] = None) -> None:
        with self._lock:  # the reply or the timeout, whichever comes first
            if id(fut) in self._settled:
                return
            self._settled.add(id(fut))
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(value)  # runs the callbacks, which may send requests

    def deliver(self, src: int, dst: int, kind: int, payload: Any,
                timeout: float) -> torch.futures.Future:
        fut: torch.futures.Future = torch.futures.Future()
        self._futures.append(fut)  # alive while the net is: ids stay unique
        self.sent.append((src, dst, kind, payload, timeout))
        if timeout > 0:
            timer = threading.Timer(timeout, self._settle, args=(fut, None, RpcTimeoutError(
                f"request from worker{src} to worker{dst} timed out after {timeout:g} s")))
            timer.daemon = True
            timer.start()
        if dst in self.dead:
            self._waiting.append((dst, fut))
            return fut
        handler = self.agents[dst].handlers[kind]
        payload = round_trip(payload)

        def serve() -> None:
            try:
                value = handler(self.agents[src].info, payload)
            except BaseException as exc:  # noqa: BLE001 - the caller's future fails
                self._settle(fut, error=exc)
                return
            self._settle(fut, round_trip(value) if value is not None else None)
        threading.Thread(target=serve, daemon=True).start()
        return fut

    def lose(self, rank: int) -> None:
        """Worker ``rank`` is lost: requests to it fail, every other engine hears of it."""
        error = ConnectionLostError(f"worker{rank} was lost", worker=f"worker{rank}")
        for dst, fut in list(self._waiting):
            if dst == rank:
                self._settle(fut, error=error)
        for agent in self.agents:
            if agent.rank != rank:
                for hook in agent.loss_hooks:
                    hook(self.agents[rank].info, error)

    def context(self, rank: int, context_id: int) -> DistAutogradContext:
        return self.engines[rank].contexts.join(context_id)

    def message(self, context_id: int, src: int, dst: int, t: torch.Tensor) -> torch.Tensor:
        """``t`` sent from ``src`` to ``dst`` in a context, recorded at both ends as the
        call hooks record it; what ``dst`` receives."""
        msg = next(self._messages)
        sender = self.context(src, context_id)
        sender.add_known_worker(dst)
        SendRecorder(sender, msg)(t)
        return RecvRecorder(self.context(dst, context_id), src, msg)(
            t.detach().clone().requires_grad_())

    def requests(self, kind: int = Kind.AUTOGRAD_BACKWARD) -> List[Tuple[int, int, Any, float]]:
        return [(src, dst, payload, timeout) for src, dst, k, payload, timeout in self.sent
                if k == kind]


def _count_root_reports(engine: Any, monkeypatch: Any) -> List[Tuple[Fraction, Any, bool]]:
    """Every report the root's books take: (credit, error, whether it ended the pass)."""
    seen: List[Tuple[Fraction, Any, bool]] = []
    original = engine.passes.credit_back

    def credit_back(pass_id, credit, error):
        ended = original(pass_id, credit, error)
        seen.append((credit, error, ended))
        return ended
    monkeypatch.setattr(engine.passes, "credit_back", credit_back)
    return seen


def test_a_pass_over_four_workers_returns_all_its_credit_once(monkeypatch):
    net = _Net(4)
    cid = make_context_id(0, 1)
    x = torch.ones(2, requires_grad=True)
    y = net.message(cid, 0, 1, x) * 2  # worker1
    z = net.message(cid, 1, 2, y) * 3 + 0  # worker2
    w = net.message(cid, 1, 3, y) * 5  # worker3
    back = net.message(cid, 1, 0, net.message(cid, 2, 1, z) + net.message(cid, 3, 1, w))
    seen = _count_root_reports(net.engines[0], monkeypatch)
    net.engines[0].backward(cid, [back.sum()])
    assert torch.equal(net.engines[0].gradients(cid)[x], torch.full((2,), 16.0))
    assert sum(credit for credit, _, _ in seen) == 1
    assert [ended for _, _, ended in seen].count(True) == 1
    assert all(error is None for _, error, _ in seen)
    # worker1 splits its credit between worker2 and worker3; each half comes back with
    # the gradient for one of worker1's two sends of y, whose records share y's node:
    # worker1 keeps the first until the second is in, runs the node once with both (as
    # torch's engine does) and sends the root one request with all the credit
    credits = sorted((dst, req.credit) for src, dst, req, _ in net.requests() if src == 1)
    assert credits == [(0, Fraction(1)), (2, Fraction(1, 2)), (3, Fraction(1, 2))]


def test_a_lost_worker_s_error_reaches_the_root():
    net = _Net(3)
    cid = make_context_id(0, 1)
    x = torch.ones(2, requires_grad=True)
    y = net.message(cid, 0, 1, x) * 2
    z = net.message(cid, 1, 2, y) * 3
    back = net.message(cid, 1, 0, net.message(cid, 2, 1, z))
    net.dead.add(2)
    errors: List[BaseException] = []

    def run() -> None:
        try:
            net.engines[0].backward(cid, [back.sum()])
        except BaseException as exc:  # noqa: BLE001 - what the test looks at
            errors.append(exc)
    root = threading.Thread(target=run)
    start = time.monotonic()
    root.start()
    # Waiting, not only sent: a loss declared before it waits would never fail it.
    wait_for("a request to rank 2 waits", lambda: any(dst == 2 for dst, _ in net._waiting), 10)
    net.lose(2)
    root.join(10)
    assert not root.is_alive() and time.monotonic() - start < 10
    assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
    assert isinstance(errors[0], ConnectionLostError) and "worker2" in str(errors[0])
    reports = net.requests(Kind.AUTOGRAD_DONE)
    assert reports and all(src == 1 and dst == 0 for src, dst, _, _ in reports)


def test_every_hop_gets_the_time_the_root_has_left():
    net = _Net(3, timeout=5.0)
    cid = make_context_id(0, 1)
    x = torch.ones(2, requires_grad=True)
    y = net.message(cid, 0, 1, x) * 2
    z = net.message(cid, 1, 2, y) * 3
    # worker1 takes 0.5 s before it sends the gradient of z on to worker2
    back = net.message(cid, 1, 0, SleepInBackward.apply(net.message(cid, 2, 1, z), 0.5))
    net.engines[0].backward(cid, [back.sum()])
    assert torch.equal(net.engines[0].gradients(cid)[x], torch.full((2,), 6.0))
    timeouts = {(src, dst): (req.time_left, timeout) for src, dst, req, timeout in net.requests()}
    left, timeout = timeouts[(0, 1)]
    assert 4.5 < left <= 5.0 and timeout == left
    left, timeout = timeouts[(1, 2)]  # after worker1's 0.5 s, not a fresh 5 s
    assert left < 4.55 and timeout == left


def test_a_pass_whose_first_hop_eats_the_time_fails_at_the_root_s_deadline():
    net = _Net(3, timeout=1.0)
    cid = make_context_id(0, 1)
    x = torch.ones(2, requires_grad=True)
    y = net.message(cid, 0, 2, x) * 3  # worker2, which will not answer in time
    z = SleepInBackward.apply(net.message(cid, 2, 0, y), 0)
    slow = SleepInBackward.apply(net.message(cid, 0, 1, z), 0.7) * 2  # worker1: 0.7 s
    back = net.message(cid, 1, 0, slow)
    net.dead.add(2)
    start = time.monotonic()
    with pytest.raises(RpcTimeoutError, match="timed out"):
        net.engines[0].backward(cid, [back.sum()])
    elapsed = time.monotonic() - start
    assert 0.7 < elapsed < 1.4, elapsed  # a fresh RPC timeout for the second hop: 1.7 s
    (_, _, req, timeout), = [r for r in net.requests() if r[1] == 2]
    assert timeout == req.time_left and timeout < 0.35


def _counting_clones(monkeypatch) -> List[torch.Tensor]:
    """Record every ``Tensor.clone`` that Python code makes from here on."""
    made: List[torch.Tensor] = []
    clone = torch.Tensor.clone

    def counted(self, *args, **kwargs):
        made.append(self)
        return clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counted)
    return made


def test_a_local_pass_copies_no_gradient_that_reaches_one_leaf(monkeypatch):
    # The weight and bias gradients of a layer are made and taken one after the other: a
    # freed gradient's id comes back for the next, which is still not shared.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    out = model(torch.randn(8, 64))
    ctx = DistAutogradContext(7)
    clones = _counting_clones(monkeypatch)
    local_pass(ctx, [out], [torch.ones_like(out)])
    assert clones == []
    grads = ctx._grads
    assert set(map(id, grads)) == set(map(id, model.parameters()))
    out.backward(torch.ones_like(out))  # the same pass, by torch's local engine
    for p in model.parameters():
        assert torch.allclose(grads[p], p.grad) and p.grad.data_ptr() != grads[p].data_ptr()


def test_a_local_pass_copies_a_gradient_that_reaches_two_leaves(monkeypatch):
    a = torch.ones(3, requires_grad=True)
    b = torch.ones(3, requires_grad=True)
    out = a + b  # both leaves get the one gradient tensor
    ctx = DistAutogradContext(8)
    clones = _counting_clones(monkeypatch)
    local_pass(ctx, [out], [torch.full((3,), 2.0)])
    assert len(clones) == 1
    ga, gb = ctx._grads[a], ctx._grads[b]
    assert torch.equal(ga, torch.full((3,), 2.0)) and torch.equal(gb, ga)
    assert ga.data_ptr() != gb.data_ptr()
    assert a.grad is None and b.grad is None  # .grad gets back its own value
