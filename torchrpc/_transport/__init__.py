"""The transport layer: authenticated TCP connections carrying wire frames."""

from .connection import Connection, Releasable
from .reader import PollPolicy
from .tcp import Transport

__all__ = ["Connection", "PollPolicy", "Releasable", "Transport"]
