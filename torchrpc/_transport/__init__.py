"""The transport layer: authenticated connections carrying wire frames, over TCP, Unix
sockets or TLS (and in memory, for tests)."""

from .connection import Connection, Link, Releasable
from .tcp import Transport

__all__ = ["Connection", "Link", "Releasable", "Transport"]
