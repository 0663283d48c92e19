"""Worker names: what torch accepts as one."""

from __future__ import annotations

import re
from typing import Any, Set

from ..errors import InvalidArgumentError, WrongTypeError

_NAME_RE = re.compile(r"[A-Za-z0-9_:\-]*")
MAX_NAME_LEN = 128
_checked: Set[str] = set()  # names already validated (a job has few; unpickling is hot)


def check_worker_name(name: Any) -> str:
    """Check a worker name as torch does; return it."""
    if name in _checked:
        return name
    if not isinstance(name, str):
        raise WrongTypeError(f"Worker name must be a str, got {type(name).__name__}")
    if not name:
        raise InvalidArgumentError("Worker name must be non-empty; pass a name such as "
                                   "'worker0'")
    if not _NAME_RE.fullmatch(name):
        raise InvalidArgumentError(f"Worker name must match ^[A-Za-z0-9-_:]*$, but got "
                                   f"{name!r}: use only letters, digits, '_', ':' and '-'")
    if len(name) >= MAX_NAME_LEN:
        raise InvalidArgumentError(f"Worker name must be shorter than {MAX_NAME_LEN} chars, "
                                   f"but got {len(name)} chars")
    if len(_checked) < 100_000:
        _checked.add(name)
    return name
