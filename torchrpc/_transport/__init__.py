"""The transport layer: authenticated TCP connections carrying wire frames."""

from .connection import Connection, Releasable
from .tcp import Transport

__all__ = ["Connection", "Releasable", "Transport"]
