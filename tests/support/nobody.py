"""Run a Python script as uid ``nobody`` that imports this checkout's torchrpc and torch.

The checkout and its ``.venv`` may sit under a directory ``nobody`` cannot enter (a home
directory of mode 0700, a clone made by ``mktemp -d``). Then the package directory and
the venv's site-packages are bind-mounted, read-only as their modes make them, under a
fresh world-readable directory for the run, and unmounted after it; where mounting is not allowed (a container without the
capability), a tree of hard links to their files stands in. The world-readable
environment the script runs in is built here, whatever the checkout's place.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
import subprocess
import tempfile
from typing import Dict, Iterator, List, Optional

import pytest
import torch

from .group import ROOT

PYTHON = "/usr/bin/python3.11"  # the system's interpreter, of the venv's Python version
SITE = os.path.dirname(os.path.dirname(torch.__file__))

needs_nobody = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("runuser") is None or not os.path.exists(PYTHON),
    reason="needs root, runuser and /usr/bin/python3.11 to run a process as nobody")


def _world_enters(path: str) -> bool:
    """Whether any user may enter ``path`` and every directory above it."""
    path = os.path.realpath(path)
    while True:
        if not os.stat(path).st_mode & stat.S_IXOTH:
            return False
        parent = os.path.dirname(path)
        if parent == path:
            return True
        path = parent


@contextlib.contextmanager
def _readable(paths: List[str]) -> Iterator[List[str]]:
    """``paths`` as ``nobody`` can reach them: themselves, or bind mounts of them under
    their own names (a package stays importable by its name)."""
    if all(_world_enters(p) for p in paths):
        yield paths
        return
    top = tempfile.mkdtemp(prefix="torchrpc-nobody-")
    os.chmod(top, 0o755)
    mounted: List[str] = []
    targets: List[str] = []
    try:
        for i, path in enumerate(paths):
            os.mkdir(os.path.join(top, str(i)), 0o755)
            target = os.path.join(top, str(i), os.path.basename(path))
            os.mkdir(target)
            if _mount(path, target):
                mounted.append(target)
            else:
                _link_tree(path, target)
            targets.append(target)
        yield targets
    finally:
        for target in mounted:
            subprocess.run(["umount", "-l", target], check=False)
        if all(not os.path.ismount(t) for t in mounted):
            shutil.rmtree(top, ignore_errors=True)


def _mount(path: str, target: str) -> bool:
    """Bind-mount ``path`` at ``target``; False where this process may not mount."""
    try:
        done = subprocess.run(["mount", "--bind", path, target], capture_output=True)
    except FileNotFoundError:
        return False
    return done.returncode == 0


def _link_tree(path: str, target: str) -> None:
    """``path``'s files as hard links under ``target`` (directories made anew, with their
    modes), or skip the test where that fails too (another file system)."""
    done = subprocess.run(["cp", "-al", "--no-target-directory", path, target],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot show {path} to nobody: neither a bind mount nor hard links "
                    f"work here ({done.stderr.strip()})")


def run_as_nobody(script: str, env: Dict[str, str], timeout: float = 120
                  ) -> subprocess.CompletedProcess:
    """Run ``script`` with :data:`PYTHON` as ``nobody``, in an environment of ``env`` only
    (plus a PATH, a HOME and a PYTHONPATH that reaches torchrpc and torch); its output."""
    # The package, not the checkout: a checkout made by ``mktemp -d`` is itself mode 0700.
    with _readable([os.path.join(ROOT, "torchrpc"), SITE]) as (package, site):
        full = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "OMP_NUM_THREADS": "1",
                "PYTHONPATH": f"{os.path.dirname(package)}:{site}", **env}
        return subprocess.run(["runuser", "-u", "nobody", "--", "/usr/bin/env", "-i",
                               *[f"{k}={v}" for k, v in full.items()], PYTHON, "-c", script],
                              capture_output=True, text=True, timeout=timeout, cwd="/tmp")


def init_rpc_as_nobody(name: str, rank: int, world_size: Optional[int], port: int
                       ) -> subprocess.CompletedProcess:
    """Run ``init_rpc(name, rank, world_size)`` as ``nobody`` against the rendezvous on
    loopback ``port``; its stdout says ``FAILED <error type> <message>`` or ``JOINED``."""
    script = ("import torchrpc.rpc as rpc\n"
              "try:\n"
              f"    rpc.init_rpc({name!r}, rank={rank}, world_size={world_size})\n"
              "except Exception as exc:\n"
              "    print('FAILED', type(exc).__name__, exc)\n"
              "else:\n"
              "    print('JOINED')\n")
    return run_as_nobody(script, {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
