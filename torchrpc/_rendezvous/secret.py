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
   ``/tmp/torchrpc-<uid>``; one that another user made first, or a symlink, is passed
   over for a fresh private directory of this process), and puts the file's directory,
   its name and its host's identity in the store (the *locator*). Workers on the same
   host, running as the same user, read it, after checking that the directory and the
   file are theirs and private (the store is writable by anyone); anyone else cannot. A
   worker on another host fails, naming the ways to provide a secret.

   The file lives as long as the process that made it runs its agent, so that
   ``python -m torchrpc.inspect`` of the same user on the same host finds the secret the
   way a worker does (:func:`shared_secret`); it is removed when that agent stops
   (graceful or not) or at exit. Its name carries its maker's pid namespace, pid and
   start time, so a file left by a killed job (SIGKILL, or a SIGTERM that skips
   ``atexit``) is told apart: no reader uses it, and the next rank 0 of this user
   removes it. A dynamic group whose store outlives rank 0 (``file://``) keeps its file
   for later joiners; its name carries no maker.
3. The ``insecure_secret_in_store`` option or ``TORCHRPC_INSECURE_SECRET_IN_STORE=1``
   shares the secret through the store, for trusted networks only; every use logs a
   warning.

This module reads no environment variable: ``init_rpc`` reads them into the options, and
the agent hands the values here as a :class:`Source`.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import secrets
import stat
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, List, Optional, Set

from .._transport.shm import pid_namespace
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

LOCATOR_KEY = "secret_locator"
IN_STORE_KEY = "insecure_secret"  # where the opted-in insecure secret travels
LOCATOR_GRACE = 5.0  # seconds a worker retries a locator it cannot use before it fails

_lock = threading.Lock()
_files: Set[str] = set()  # secret files this process created, removed at exit at the latest
_fallback: List[str] = []  # this process's own directory, if the shared ones are not safe


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


def _unsafe(st: os.stat_result) -> Optional[str]:
    """Why a directory with this ``lstat`` cannot hold secrets; None if it can."""
    if stat.S_ISLNK(st.st_mode):
        return "it is a symlink"
    if not stat.S_ISDIR(st.st_mode):
        return "it is not a directory"
    if st.st_uid != os.geteuid():
        return f"its owner is uid {st.st_uid}, not this user (uid {os.geteuid()})"
    if st.st_mode & 0o077:
        return f"its mode is {stat.S_IMODE(st.st_mode):04o}, not 0700"
    return None


def _private_dir(path: str) -> Optional[str]:
    """``path``, made if missing (mode 0700), if it is this user's private directory;
    else None, logged with why (another user may have made it first)."""
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        log.warning("cannot keep the job secret in %s: %s", path, exc)
        return None
    why = _unsafe(os.lstat(path))
    if why is not None:
        log.warning("will not keep the job secret in %s: %s; another user may have made "
                    "it first. Using a private directory of this process instead", path, why)
        return None
    return path


def runtime_dir() -> str:
    """This user's private directory for secret files (mode 0700): ``$XDG_RUNTIME_DIR/
    torchrpc``, else ``torchrpc-<uid>`` in the temporary directory. One that someone else
    owns, with another mode, or a symlink, is not used: the process makes a fresh private
    one of its own instead (``tempfile.mkdtemp``), removed at exit when empty."""
    with _lock:
        fallback = _fallback[-1] if _fallback else None
    if fallback is not None and _unsafe(os.lstat(fallback)) is None:
        return fallback  # passed over the shared ones already (and said why, once)
    base = os.environ.get("XDG_RUNTIME_DIR")
    candidates = []
    if base and os.path.isdir(base) and _unsafe(os.lstat(base)) is None:
        candidates.append(os.path.join(base, "torchrpc"))
    candidates.append(os.path.join(tempfile.gettempdir(), f"torchrpc-{os.geteuid()}"))
    for path in candidates:
        if _private_dir(path) is not None:
            return path
    with _lock:
        _fallback.append(tempfile.mkdtemp(prefix=f"torchrpc-{os.geteuid()}-"))
        return _fallback[-1]


def _started(pid: int) -> Optional[str]:
    """When process ``pid`` started (clock ticks since boot, from ``/proc``), or None if
    there is no such process (or no ``/proc``)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode("ascii")
    except (OSError, IndexError, UnicodeDecodeError):
        return None


_MAKER = re.compile(r"job-(\d+)-(\d+)-(\d+)-[0-9a-f]{32}")  # pidns, pid, start time, token


def _maker_gone(name: str) -> Optional[str]:
    """Why the secret file ``name`` is stale (the process that made it, named in it, has
    ended), or None: it runs, or the name does not say (a kept file), or it ran in
    another pid namespace, where this process cannot tell."""
    match = _MAKER.fullmatch(name)
    if match is None:
        return None
    pidns, pid, start = (int(x) for x in match.groups())
    if not pidns or pidns != pid_namespace():
        return None
    if _started(pid) != str(start):
        return (f"the process that made it (pid {pid}) has ended: it is left from a job that "
                f"was killed")
    return None


def _sweep(directory: str) -> None:
    """Remove this user's secret files in ``directory`` whose maker has ended (a job
    killed before it could remove its own)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        why = _maker_gone(name)
        if why is None:
            continue
        try:
            os.unlink(os.path.join(directory, name))
        except OSError:
            continue
        log.info("removed the stale secret file %s: %s", os.path.join(directory, name), why)


def create_local(host: str, keep: bool = False) -> tuple[bytes, str]:
    """Rank 0: a new secret in a new private file; return it and the store locator (a
    JSON object: the host's identity, the directory and the file's name).

    The file is removed when this process's agent stops (:func:`discard_local`), or at
    exit at the latest, unless ``keep`` (a dynamic group whose store outlives rank 0:
    members may join after it left). Stale files of killed jobs in the directory are
    removed first.
    """
    secret = secrets.token_hex(32).encode()
    directory = runtime_dir()
    _sweep(directory)
    started = _started(os.getpid())
    if keep or started is None or not pid_namespace():  # no maker to check (or no /proc)
        name = f"job-{secrets.token_hex(16)}"
    else:
        name = f"job-{pid_namespace()}-{os.getpid()}-{started}-{secrets.token_hex(16)}"
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(secret)
    if not keep:
        with _lock:
            _files.add(path)
    return secret, json.dumps({"host": host, "dir": directory, "file": name})


def _parse_locator(locator: str) -> tuple[str, str, str]:
    try:
        fields = json.loads(locator)
        where = (fields["host"], fields["dir"], fields["file"])
    except (ValueError, TypeError, KeyError) as exc:
        raise RendezvousError(f"malformed secret locator in the rendezvous store "
                              f"({locator[:80]!r}): {exc!r}") from None
    if not all(isinstance(x, str) for x in where):
        raise RendezvousError(f"malformed secret locator in the rendezvous store "
                              f"({locator[:80]!r})")
    return where


def _unusable(reason: str, advice: str = _HOW) -> RendezvousError:
    """The error of a secret file that cannot be used: ``reason`` and the advice to
    workers; its ``reason`` attribute keeps the reason alone (the inspector gives advice
    of its own)."""
    error = RendezvousError(f"{reason}; {advice}")
    error.reason = reason  # type: ignore[attr-defined]
    return error


_SAME_USER = f"are all workers of this host running as the same user? Otherwise {_HOW}"


def read_local(locator: str, host: str) -> bytes:
    """Any other rank: the secret rank 0 keeps in the file the locator names. The
    locator comes from the untrusted store, so what it names is checked: a directory
    and a file (no symlinks) of this user, that no one else may read or write, made by a
    process that still runs (or kept for later joiners)."""
    their_host, directory, name = _parse_locator(locator)
    if their_host != host:
        raise _unusable("cannot get the job secret: rank 0 created it on another host "
                        "(or container), where only its own user can read it")
    if not name.startswith("job-") or os.sep in name or not os.path.isabs(directory):
        raise RendezvousError(f"malformed secret locator {locator[:200]!r} in the rendezvous "
                              f"store")
    path = os.path.join(directory, name)
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        raise _unusable(f"cannot open the directory of the job secret rank 0 created "
                        f"({directory}): {exc}", _SAME_USER) from exc
    try:
        why = _unsafe(os.fstat(dfd))
        if why is not None:
            raise _unusable(f"refusing the secret directory {directory}: {why}")
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        except OSError as exc:
            raise _unusable(f"cannot read the job secret rank 0 created ({path}): {exc}",
                            _SAME_USER) from exc
    finally:
        os.close(dfd)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077:
            raise _unusable(f"refusing the secret file {path}: owner uid {st.st_uid}, "
                            f"mode {stat.S_IMODE(st.st_mode):04o}")
        stale = _maker_gone(name)
        if stale is not None:
            raise _unusable(f"refusing the secret file {path}: {stale}")
        return _checked(f.read().strip(), path)


def shared_secret(store: Any, host: str, source: Source) -> bytes:
    """The secret rank 0 shares, read once (no waiting): the one in the store if
    ``source.via_store`` (the insecure opt-in), else the file the locator names. A worker
    that is not rank 0 and ``python -m torchrpc.inspect`` both read it here. Raises
    :class:`RendezvousError` if it is not there, or cannot be used."""
    if via_store_allowed(source):
        if not store.check([IN_STORE_KEY]):
            raise RendezvousError(f"{VIA_STORE_ENV} is set, but the rendezvous store holds no "
                                  f"secret: the group was not started with it")
        return store.get(IN_STORE_KEY)
    if not store.check([LOCATOR_KEY]):
        hint = (f" (it holds one in the store: the group was started with {VIA_STORE_ENV}=1, "
                f"which this process needs too)" if store.check([IN_STORE_KEY]) else "")
        raise RendezvousError(f"the rendezvous store names no secret file of rank 0{hint}")
    return read_local(store.get(LOCATOR_KEY).decode(errors="replace"), host)


def discard_local(locator: Optional[str] = None) -> None:
    """Remove the secret files this process created (its agent stops), or only the one
    of ``locator`` (made by :func:`create_local`, kept or not)."""
    with _lock:
        if locator is None:
            paths = list(_files)
            _files.clear()
        else:
            _, directory, name = _parse_locator(locator)
            paths = [os.path.join(directory, name)]
            _files.discard(paths[0])
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass


def _at_exit() -> None:
    discard_local()
    for path in _fallback:
        try:
            os.rmdir(path)  # only when empty: kept files serve later joiners
        except OSError:
            pass


atexit.register(_at_exit)


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
               source: Source = Source(), deadline: Optional[float] = None) -> bytes:
    """The job's secret: from the launcher, or shared by rank 0 as the module docs say.

    ``wait(keys, what)`` blocks until the store has ``keys``; ``deadline`` (a
    ``time.monotonic()``) bounds the retries of a locator that cannot be used (yet).

    The locator is the one thing read from the store before the secret is known, and it
    is untrusted: rank 0 replaces one it cannot use (an outsider's, written first), and
    the others retry one they cannot use for :data:`LOCATOR_GRACE` seconds (rank 0 may
    be about to replace it) before they fail, alone.
    """
    secret = launcher_secret(source)
    if secret is not None:
        return secret
    if source.via_store:
        if rank == 0:
            # compare_set: a rank 0 that rejoins a dynamic group keeps the group's secret
            store.compare_set(IN_STORE_KEY, "", secrets.token_hex(32))
        wait([IN_STORE_KEY], "the job secret from rank 0")
        return shared_secret(store, host, source)
    if rank == 0:
        return _create_shared(store, host, keep)
    give_up: Optional[float] = None
    said = ""
    while True:
        wait([LOCATOR_KEY], "where rank 0 keeps the job secret")
        try:
            return shared_secret(store, host, source)
        except RendezvousError as exc:
            now = time.monotonic()
            give_up = give_up or now + LOCATOR_GRACE
            if now > give_up or (deadline is not None and now > deadline):
                raise
            if str(exc) != said:
                said = str(exc)
                log.warning("the secret locator in the rendezvous store cannot be used (yet); "
                            "retrying for %g s: %s", LOCATOR_GRACE, exc)
            time.sleep(0.05)


def _create_shared(store: Any, host: str, keep: bool) -> bytes:
    """Rank 0: make the secret file and put its locator in the store; a rank 0 that finds
    a usable locator there already (it rejoins a dynamic group, or a duplicate rank 0
    came first) reads that secret instead, and one it cannot use is replaced."""
    secret, locator = create_local(host, keep)
    held = store.compare_set(LOCATOR_KEY, "", locator).decode(errors="replace")
    for _ in range(5):
        if held == locator:
            return secret
        try:
            theirs = read_local(held, host)
        except RendezvousError as exc:
            log.warning("rank 0 replaces the secret locator it found in the rendezvous store, "
                        "which it cannot use: %s", exc)
            held = store.compare_set(LOCATOR_KEY, held, locator).decode(errors="replace")
            continue
        discard_local(locator)  # its own, which no one reads
        return theirs
    raise RendezvousError("cannot put the secret locator in the rendezvous store: another "
                          "process keeps writing it")
