"""Where the job secret comes from. It never travels through the rendezvous store.

The store (torch's TCPStore or FileStore) is readable by anyone who reaches its port or
file, so it carries at most a *locator*: which file on which host holds the secret.

1. The ``secret`` option or ``TORCHRPC_SECRET`` (at least 32 characters; the variable is
   read once, by ``init_rpc``, and removed from the environment, so child processes do not
   inherit it), or the ``secret_file`` option or ``TORCHRPC_SECRET_FILE`` (a file only its
   owner may read: mode 0600 or stricter). Multi-host jobs use these: the launcher gives
   every worker the same value.
2. Otherwise rank 0 creates a random secret in a file of its own, mode 0600, in a
   per-user directory of mode 0700 (``$XDG_RUNTIME_DIR/torchrpc``, else
   ``/tmp/torchrpc-<uid>``), and puts the file's name and its host's identity in the
   store. Workers on the same host, running as the same user, read it; anyone else
   cannot. A worker on another host fails at once, naming the ways to provide a secret.
3. The ``insecure_secret_in_store`` option or ``TORCHRPC_INSECURE_SECRET_IN_STORE=1``
   shares the secret through the store, for trusted networks only; every use logs a
   warning.

This module reads no environment variable: ``init_rpc`` reads them into the options, and
the agent hands the values here as a :class:`Source`.
"""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import stat
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Set

from ..errors import RendezvousError

log = logging.getLogger(__name__)

SECRET_ENV = "TORCHRPC_SECRET"
SECRET_FILE_ENV = "TORCHRPC_SECRET_FILE"
VIA_STORE_ENV = "TORCHRPC_INSECURE_SECRET_IN_STORE"
MIN_LENGTH = 32  # characters: 128 bits as hex

_HOW = (f"set {SECRET_ENV} to the same random string of at least {MIN_LENGTH} characters "
        f"on every worker (for example from `python -c \"import secrets; "
        f"print(secrets.token_hex(16))\"`), or {SECRET_FILE_ENV} to a file of mode 0600 holding "
        f"it, or (trusted networks only) {VIA_STORE_ENV}=1 to share it through the "
        f"rendezvous store; add TLS for cross-host links (see docs/security.md)")

_lock = threading.Lock()
_files: Set[str] = set()  # secret files this process created, removed at exit at the latest


def _checked(value: bytes, where: str) -> bytes:
    if len(value) < MIN_LENGTH:
        raise RendezvousError(f"the job secret from {where} has {len(value)} characters; it "
                              f"must have at least {MIN_LENGTH} (128 bits): {_HOW}")
    return value


@dataclass(frozen=True)
class Source:
    """Where this worker's job secret comes from: the launcher's ``value`` (or ``path``, a
    file holding it), else rank 0 (through the store only with ``via_store``)."""

    value: Optional[bytes] = field(default=None, repr=False)  # never in logs or errors
    path: Optional[str] = None
    via_store: bool = False


def launcher_secret(source: Source) -> Optional[bytes]:
    """The secret the launcher provided (``source.value``, else the file ``source.path``),
    or None."""
    if source.value is not None:
        return _checked(source.value, f"the secret option or {SECRET_ENV}")
    path = source.path
    if not path:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise RendezvousError(f"cannot open {SECRET_FILE_ENV}={path!r}: {exc}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_mode & 0o077 or st.st_uid != os.geteuid():
            raise RendezvousError(
                f"{SECRET_FILE_ENV}={path!r} has mode {stat.S_IMODE(st.st_mode):04o} and owner "
                f"uid {st.st_uid}: it must belong to this user (uid {os.geteuid()}) with mode "
                f"0600 or stricter; run `chmod 600 {path}`")
        return _checked(f.read().strip(), SECRET_FILE_ENV)


def runtime_dir() -> str:
    """This user's private directory for secret files (created with mode 0700)."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    path = os.path.join(base, "torchrpc") if base and os.path.isdir(base) else \
        os.path.join("/tmp", f"torchrpc-{os.geteuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise RendezvousError(
            f"refusing to keep the job secret in {path}: it must be a directory owned by uid "
            f"{os.geteuid()} with mode 0700, but it is mode {stat.S_IMODE(st.st_mode):04o}, "
            f"owner uid {st.st_uid}{' (a symlink)' if stat.S_ISLNK(st.st_mode) else ''}; "
            f"another user may have created it: remove it, or {_HOW}")
    return path


def create_local(host: str, keep: bool = False) -> tuple[bytes, str]:
    """Rank 0: a new secret in a new private file; return it and the store locator.

    The file is removed once every rank has read it, or at exit at the latest, unless
    ``keep`` (a dynamic group whose store outlives rank 0: members may join after it left).
    """
    secret = secrets.token_hex(32).encode()
    name = f"job-{secrets.token_hex(16)}"
    path = os.path.join(runtime_dir(), name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    if not keep:
        with _lock:
            _files.add(path)
    return secret, f"{host}/{name}"


def read_local(locator: str, host: str) -> bytes:
    """Any other rank: the secret rank 0 keeps in the file the locator names."""
    their_host, _, name = locator.rpartition("/")
    if their_host != host:
        raise RendezvousError(
            f"cannot get the job secret: rank 0 created it on another host (or container), "
            f"where only its own user can read it; {_HOW}")
    if not name.startswith("job-") or os.sep in name:
        raise RendezvousError(f"malformed secret locator {locator!r} in the rendezvous store")
    path = os.path.join(runtime_dir(), name)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise RendezvousError(f"cannot read the job secret rank 0 created ({path}): {exc}; "
                              f"are all workers of this host running as the same user? "
                              f"Otherwise {_HOW}") from exc
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise RendezvousError(f"refusing the secret file {path}: owner uid {st.st_uid}, "
                                  f"mode {stat.S_IMODE(st.st_mode):04o}; {_HOW}")
        return _checked(f.read().strip(), path)


def discard_local() -> None:
    """Remove the secret files this process created (every rank has read them)."""
    with _lock:
        paths = list(_files)
        _files.clear()
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


atexit.register(discard_local)


def via_store_allowed(source: Source) -> bool:
    """Whether the secret travels through the store (logged as a warning each time)."""
    if source.via_store:
        log.warning("%s is set: the job secret travels through the rendezvous "
                    "store, so anyone who can reach the store can run code on every worker",
                    VIA_STORE_ENV)
        return True
    return False


def job_secret(store: Any, rank: int, host: str,
               wait: Callable[[list, str], None], keep: bool = False,
               source: Source = Source()) -> bytes:
    """The job's secret: from the launcher, or shared by rank 0 as the module docs say.

    ``wait(keys, what)`` blocks until the store has ``keys``.
    """
    secret = launcher_secret(source)
    if secret is not None:
        return secret
    if via_store_allowed(source):
        if rank == 0:
            # compare_set: a rank 0 that rejoins a dynamic group keeps the group's secret
            store.compare_set("insecure_secret", "", secrets.token_hex(32))
        wait(["insecure_secret"], "the job secret from rank 0")
        return store.get("insecure_secret")
    if rank == 0:
        secret, locator = create_local(host, keep)
        held = store.compare_set("secret_locator", "", locator).decode()
        if held == locator:
            return secret
        discard_local()  # a rank 0 that rejoins a dynamic group keeps the group's secret
        return read_local(held, host)
    wait(["secret_locator"], "where rank 0 keeps the job secret")
    return read_local(store.get("secret_locator").decode(), host)
