"""The group's store once the job secret is known: sealed records in, checked records out.

A thin wrapper of torch's store that seals what it writes with :mod:`.records` and opens
what it reads; a record that fails its check is ignored and logged once (on the
``torchrpc`` logger). See rendezvous.py and membership.py for the records of a group.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional

from .._transport.logbudget import LogBudget
from . import records


class Records:
    """The group's store once the job secret is known: :meth:`put` writes sealed
    records, :meth:`read` returns a record's fields only if its seal holds (see
    :mod:`.records`); a bad one is ignored and logged once. Every other operation goes
    to the store as it is (counters, checks, compare-and-set)."""

    def __init__(self, store: Any, secret: bytes, job: str) -> None:
        self.store = store
        self.job = job
        self._key = records.derive_key(secret, job)
        self._bad = records.BadRecords(
            LogBudget(what="ignored records of the rendezvous store").warn)

    def sealed(self, key: str, fields: Dict[str, Any]) -> bytes:
        """The sealed record of ``fields`` for store key ``key``."""
        return records.seal(self._key, self.job, key, fields)

    def put(self, key: str, fields: Dict[str, Any]) -> None:
        """Write ``fields`` at ``key``, sealed."""
        self.store.set(key, self.sealed(key, fields))

    def open(self, key: str, value: bytes, required: Optional[Dict[str, Any]] = None,
             what: str = "") -> Optional[Dict[str, Any]]:
        """The fields of ``value``, read at ``key``, if it is a good sealed record with
        the ``required`` fields; else None (logged once, saying what was wrong)."""
        try:
            return records.open_record(self._key, self.job, key, value, required)
        except records.BadRecord as exc:
            self._bad.report(f"{self.job}/{key}", value, exc, what)
            return None

    def report(self, key: str, value: bytes, why: str) -> None:
        """Log once that the good sealed record ``value`` at ``key`` was ignored: ``why``."""
        self._bad.report(f"{self.job}/{key}", value, records.BadRecord(why))

    def read(self, key: str, required: Optional[Dict[str, Any]] = None,
             what: str = "") -> Optional[Dict[str, Any]]:
        """The fields of the sealed record at ``key``; None if there is none, or it is
        bad (logged once)."""
        if not self.store.check([key]):
            return None
        return self.open(key, self.store.get(key), required, what)

    # The store's own operations, unchanged.
    def set(self, key: str, value: Any) -> None:
        self.store.set(key, value)

    def get(self, key: str) -> bytes:
        return self.store.get(key)

    def add(self, key: str, amount: int) -> int:
        return self.store.add(key, amount)

    def check(self, keys: List[str]) -> bool:
        return self.store.check(keys)

    def compare_set(self, key: str, expected: Any, desired: Any) -> bytes:
        return self.store.compare_set(key, expected, desired)

    def multi_get(self, keys: List[str]) -> List[bytes]:
        return self.store.multi_get(keys)

    def delete_key(self, key: str) -> bool:
        return self.store.delete_key(key)
