"""The platform check made when torchrpc is imported, before any POSIX-only module.

torchrpc is built and tested on Linux (``fcntl``, Unix sockets, ``/dev/shm``, ``/proc``).
macOS has the same interfaces and is let through, untested; elsewhere the import fails
with an error that says so instead of a missing ``fcntl``.
"""

from __future__ import annotations

import sys

SUPPORTED = ("linux", "darwin")


def check(platform: str = sys.platform) -> None:
    """Raise ImportError naming ``platform`` unless torchrpc can run on it."""
    if not platform.startswith(SUPPORTED):
        raise ImportError(
            f"torchrpc supports Linux (macOS untested), not this platform "
            f"(sys.platform is {platform!r}); run it on Linux, for example in WSL 2 on Windows")
