"""``torch.futures.collect_all`` and ``wait_all`` that know torchrpc's futures.

torch's two run in its C++, which cannot do what waiting on an :class:`RpcFuture` takes:
a reply parked on a private connection, or sent on a burst, is read by the thread that
waits for it (lanes.py, bursts.py), and torch's C++ never calls Python to read it, so
it would wait for the timer to read it (a tick later); and it ends ``wait_all`` early only
on a future its C++ failed, not on one torchrpc failed from Python, so one error would not
end the wait. The versions here have each future read (a burst's on this thread, or on
one pool thread per burst) and end at the first error; a list without a torchrpc future
goes to torch's own.

Ported code calls ``torch.futures.wait_all(futs)`` by name, so no boundary of ours sees
the call: :func:`install` puts the two into ``torch.futures``, once per process, when
``init_rpc`` starts an agent (never at import). docs/porting.md says why.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .futures import ManyClaim, RpcFuture, _claim_later, fresh_error, new_future


def _failure(fut: torch.futures.Future) -> Optional[BaseException]:
    """The error of a completed future, as a copy that holds no frames; None if it holds
    a value."""
    try:
        _future_value(fut)
    except BaseException as exc:  # noqa: BLE001 - returned, not handled
        exc.__traceback__ = None
        exc.__context__ = exc.__cause__ = None
        return fresh_error(exc)
    return None


_future_value = torch._C.Future.value
_add_done_callback = torch._C.Future.add_done_callback
_torch_collect_all = torch.futures.collect_all
_torch_wait_all = torch.futures.wait_all


@functools.wraps(_torch_collect_all)
def collect_all(futures: List[torch.futures.Future]) -> torch.futures.Future:
    ours = next((f for f in futures if isinstance(f, RpcFuture)), None)
    if ours is None:
        return _torch_collect_all(futures)
    futures = list(futures)
    combined = new_future(ours._pool)
    if not futures:
        combined.set_result(futures)
        return combined
    finished = itertools.count(1).__next__  # atomic under the GIL: no lock per future
    ended: Dict[str, Any] = {}
    total = len(futures)

    def on_done(fut: torch.futures.Future) -> None:
        # Runs where the future completes, a reader thread too: it only counts and checks.
        error = _failure(fut)
        if error is not None:
            if ended.setdefault("by", fut) is fut:  # the first error ends it
                combined.set_exception(error)
        elif finished() == total and ended.setdefault("by", combined) is combined:
            combined.set_result(futures)

    _read_later(_claim_groups(futures)[0])
    for fut in futures:
        if isinstance(fut, RpcFuture):
            _claim_later(fut)
        _add_done_callback(fut, on_done)
    return combined


def _claim_groups(futures: List[Any]) -> Tuple[List[List[Any]], bool]:
    """The futures whose claims read for many (:class:`ManyClaim`) among ``futures``,
    their claims taken, by group: ``[claim, future, ...]`` for each; and whether there
    are no others."""
    groups: Dict[int, List[Any]] = {}
    alone = True
    for fut in futures:
        claim = fut._claim if isinstance(fut, RpcFuture) else None
        if isinstance(claim, ManyClaim):
            fut._claim = None
            groups.setdefault(id(claim.group), [claim]).append(fut)
        else:
            alone = False
    return list(groups.values()), alone


def _read_later(groups: List[List[Any]]) -> None:
    """One pool thread reads each group of ``groups`` (see :func:`_claim_groups`) until
    its futures are done, or one has failed."""
    for claim, *group in groups:
        claim.read_later(_all_done(group, claim))


@functools.wraps(_torch_wait_all)
def wait_all(futures: List[torch.futures.Future]) -> List[Any]:
    if not any(isinstance(f, RpcFuture) for f in futures):
        return _torch_wait_all(futures)
    # Futures of one group (a burst, bursts.py) alone are read on this thread; those of
    # several, each group on a pool thread (collect_all), so that an error ends the wait.
    groups, alone = _claim_groups(futures)
    if alone and len(groups) == 1:
        (claim, *group), = groups
        claim.read_until(_all_done(group, claim))
        done = torch._C.Future.done
        for fut in futures:  # an error ends the wait, as torch's does
            error = _failure(fut) if done(fut) else None
            if error is not None:
                try:
                    raise error
                finally:
                    del error
        # Each holds a value, or is being completed by another thread.
        return [_future_value(fut) if done(fut) else fut.wait() for fut in futures]
    _read_later(groups)
    # Once the combined future holds the list, every future in it holds a value.
    return [_future_value(fut) for fut in collect_all(futures).wait()]


def _all_done(group: List[Any], claim: ManyClaim) -> Callable[[], bool]:
    """Whether every future of ``group`` (read by ``claim``) is done, or one has failed.
    Each call goes on from where the last one stopped; failures are looked for only when
    an error reply came, or the reading went quiet, since the last look."""
    done = torch._C.Future.done
    events = claim.events
    state = [0, events()]  # futures of group done in a row; events seen

    def finished() -> bool:
        i = state[0]
        while i < len(group) and done(group[i]):
            i += 1
        state[0] = i
        if i == len(group):
            return True
        now = events()
        if now != state[1]:
            state[1] = now
            return any(done(f) and _failure(f) is not None for f in group)
        return False
    return finished


def install() -> None:
    """Make ``torch.futures.collect_all`` and ``wait_all`` the versions of this module
    (idempotent; ``init_rpc`` calls it, under its lock)."""
    torch.futures.collect_all = collect_all
    torch.futures.wait_all = wait_all


def installed() -> bool:
    """Whether :func:`install` has run in this process."""
    return torch.futures.collect_all is collect_all and torch.futures.wait_all is wait_all
