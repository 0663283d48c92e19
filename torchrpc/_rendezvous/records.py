"""Sealed store records: what the group writes in the rendezvous store, under a MAC.

The rendezvous store (torch's TCPStore, FileStore) is writable by anyone who reaches its
port or file. So every record a worker acts on is *sealed*: a MAC under a key derived
from the job secret covers the job (the store prefix of the group), the store key the
record sits under (which holds its sequence: ``event/<n>``, ``rank/<r>``,
``shutdown/1/<r>``) and the record's body. A record copied to another key, another
sequence or another group's prefix, or altered, or made without the secret, fails
:func:`open_record`; so does one that does not parse or lacks a field.

The byte layout of a sealed record::

    b"R1 " + hex(mac) + b" " + body

    body  = the record's fields as compact JSON (an object)
    mac   = HMAC-SHA256(record key, b"torchrpc-record-1\\0" + job + b"\\0" + store key
                        + b"\\0" + body)
    record key = HMAC-SHA256(job secret, b"torchrpc store records\\0" + job)

Pure functions over bytes: no store, no I/O. :class:`BadRecords` only remembers which bad
records it has logged, so that each one is logged once.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Type, Union

MAGIC = b"R1 "
_MAC_HEX = 64
_DOMAIN = b"torchrpc-record-1\0"
_KEY_DOMAIN = b"torchrpc store records\0"
MAX_RECORD = 1 << 20  # bytes; a bigger value is refused before it is parsed


class BadRecord(ValueError):
    """A store value that is not a sealed record of this job at this key (or lacks a
    field): its message says what was wrong."""


def derive_key(secret: bytes, job: str) -> bytes:
    """The key that seals the records of the group under store prefix ``job``."""
    return hmac.new(secret, _KEY_DOMAIN + job.encode(), hashlib.sha256).digest()


def _mac(key: bytes, job: str, where: str, body: bytes) -> bytes:
    return hmac.new(key, _DOMAIN + job.encode() + b"\0" + where.encode() + b"\0" + body,
                    hashlib.sha256).hexdigest().encode()


def seal(key: bytes, job: str, where: str, fields: Mapping[str, Any]) -> bytes:
    """The sealed record of ``fields`` (JSON-able) for store key ``where`` of ``job``."""
    body = json.dumps(dict(fields), separators=(",", ":"), sort_keys=True).encode()
    return MAGIC + _mac(key, job, where, body) + b" " + body


def open_record(key: bytes, job: str, where: str, value: Union[bytes, str],
                required: Optional[Mapping[str, Union[Type, Tuple[Type, ...]]]] = None
                ) -> Dict[str, Any]:
    """The fields of the sealed record ``value`` found at store key ``where`` of ``job``;
    with ``required`` (field -> type), each of those fields must be there with that type.
    Raise :class:`BadRecord` saying what is wrong otherwise."""
    if isinstance(value, str):
        value = value.encode()
    if len(value) > MAX_RECORD:
        raise BadRecord(f"{len(value)} bytes, more than a record may have ({MAX_RECORD})")
    if not value.startswith(MAGIC) or len(value) < len(MAGIC) + _MAC_HEX + 1 \
            or value[len(MAGIC) + _MAC_HEX:len(MAGIC) + _MAC_HEX + 1] != b" ":
        raise BadRecord(f"not a sealed record (it starts {value[:16]!r})")
    mac = value[len(MAGIC):len(MAGIC) + _MAC_HEX]
    body = value[len(MAGIC) + _MAC_HEX + 1:]
    if not hmac.compare_digest(mac, _mac(key, job, where, body)):
        raise BadRecord("its MAC does not match: it was not written by a holder of the job "
                        "secret for this key, or it was altered or moved here from another key")
    try:
        fields = json.loads(body)
    except ValueError as exc:
        raise BadRecord(f"its body is not JSON: {exc}") from None
    if not isinstance(fields, dict):
        raise BadRecord(f"its body is a JSON {type(fields).__name__}, not an object")
    for name, kind in (required or {}).items():
        if name not in fields:
            raise BadRecord(f"it lacks the field {name!r}")
        got = fields[name]
        if not isinstance(got, kind) or (isinstance(got, bool) and kind is int):
            raise BadRecord(f"its field {name!r} is a {type(got).__name__}, not a "
                            f"{getattr(kind, '__name__', kind)}")
    return fields


class BadRecords:
    """Logs each bad record once, with ``warn`` (a logger's ``warning``, or a rate-limited
    one, so that a flood of junk does not flood the log), remembering a bounded number of
    the ones logged (so that it does not fill memory either)."""

    LIMIT = 1024

    def __init__(self, warn: Callable[..., None]) -> None:
        self._warn = warn
        self._seen: Dict[Tuple[str, bytes], None] = {}

    def report(self, where: str, value: Union[bytes, str], error: BadRecord,
               what: str = "") -> None:
        """Log that the value at store key ``where`` was ignored, unless it was already."""
        if isinstance(value, str):
            value = value.encode()
        mark = (where, hashlib.sha256(value).digest()[:16])
        if mark in self._seen:
            return
        if len(self._seen) >= self.LIMIT:
            self._seen.pop(next(iter(self._seen)))
        self._seen[mark] = None
        self._warn("ignored the rendezvous store's record at %r%s: %s", where,
                   f" ({what})" if what else "", error)
