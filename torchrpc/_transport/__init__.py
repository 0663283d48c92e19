"""The transport layer: authenticated TCP connections carrying wire frames."""

from .tcp import Connection, Transport

__all__ = ["Connection", "Transport"]
