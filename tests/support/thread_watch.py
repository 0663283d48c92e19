"""What a process's threads raised and what torchrpc logged at ERROR, for tests to assert
on. A group member started with ``TORCHRPC_TEST_WATCH=DIR`` watches from before
``init_rpc`` to after ``shutdown`` and leaves ``DIR/NAME.json`` (see worker_main)."""

from __future__ import annotations

import logging
import threading
from typing import Any, Dict, List

WATCH_ENV = "TORCHRPC_TEST_WATCH"


class ThreadWatch(logging.Handler):
    """Counts exceptions that end threads (``threading.excepthook``) and ERROR records of
    the ``torchrpc`` logger (exceptions a background thread survived)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.raised: List[str] = []
        self.errors: List[str] = []
        self._old_hook = threading.excepthook

    def install(self) -> "ThreadWatch":
        self._old_hook = threading.excepthook
        threading.excepthook = self._hook
        logging.getLogger("torchrpc").addHandler(self)
        return self

    def uninstall(self) -> None:
        threading.excepthook = self._old_hook
        logging.getLogger("torchrpc").removeHandler(self)

    def _hook(self, args: Any) -> None:
        name = args.thread.name if args.thread is not None else "?"
        self.raised.append(f"{name}: {args.exc_type.__name__}: {args.exc_value}"[:500])
        self._old_hook(args)

    def emit(self, record: logging.LogRecord) -> None:
        self.errors.append(record.getMessage()[:500])

    def report(self) -> Dict[str, List[str]]:
        return {"raised": list(self.raised), "errors": list(self.errors)}
