"""The transport layer: authenticated connections carrying wire frames, over TCP, Unix
sockets or TLS."""

from .connection import Connection, Link, Releasable
from .reader import PollPolicy
from .tcp import Transport

__all__ = ["Connection", "Link", "PollPolicy", "Releasable", "Transport"]
