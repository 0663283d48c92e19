"""The transport layer: authenticated TCP connections carrying wire frames."""

from .tcp import Connection, Releasable, Transport

__all__ = ["Connection", "Releasable", "Transport"]
