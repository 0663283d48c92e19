"""The transport layer: authenticated TCP connections carrying wire frames."""

from .connection import Connection, Link, Releasable
from .tcp import Transport

__all__ = ["Connection", "Link", "Releasable", "Transport"]
