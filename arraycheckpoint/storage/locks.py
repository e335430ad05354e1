"""Save locks on POSIX file systems: one lock file per target, ``<dir>/.acp-lock-<h>``
(:func:`.localnames.lock_path`).

The coordinator creates it with ``O_EXCL`` and holds an ``flock`` on it until the save ends: the kernel drops
that lock when the process ends however it ends, so a lock file nobody holds is a crashed save's and is taken
over (with a warning), never refused for good.

Some file systems have no ``flock`` (some NFS mounts, FUSE file systems), or one that only this host sees
(NFS mounted with ``local_lock=flock``: set ``ARRAYCHECKPOINT_LOCK_NO_FLOCK=1`` there). Without it a lock is
judged by what its file says of its owner, a small JSON document (:class:`Owner`: host name, boot id, pid
namespace, pid, the process's start time, the save's token, its heartbeat interval, whether it holds the
flock), and by its age (a free flock says nothing of a holder that runs without flock: its document decides):

* on the same host and boot (and pid namespace), the lock is a crashed save's when its process is gone, or
  its pid now names another process (another start time);
* elsewhere it is a lease: the holder refreshes the lock file's mtime every ``ARRAYCHECKPOINT_LOCK_HEARTBEAT_SECONDS``
  (10 s; one background thread per process, one ``futimens`` per held lock), and a lock not refreshed for
  ``ARRAYCHECKPOINT_LOCK_LEASE_INTERVALS`` (6) times the longer of that interval and the holder's own is a
  crashed save's. Its age is measured against the file system's clock (the mtime of a file created for the
  purpose), so clock skew between hosts does not count;
* a lock whose document cannot be read as one (an older version's, a lock being created) has only its age.

A crashed lock is taken over by exactly one save: takers race for an ``O_EXCL`` marker
``<lock>.takeover``, and the winner replaces the lock only if it is still the very file judged (same inode,
same mtime: not refreshed meanwhile); a marker that is no regular file, or dated more than a lease ahead, is
moved aside. A save whose lock was taken over from it (its process stopped for longer than the lease) is
refused at commit: the file at the lock's path is another (inode), or names another token (a taker holding the
flock rewrites it in place). The lock file is untrusted input: read with a bound, never through a
link, and only when it is a regular file.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import stat
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

from .heartbeat import Heartbeat

log = logging.getLogger("arraycheckpoint")

#: the most of a lock file that is read (its document is ~300 bytes)
MAX_LOCK_BYTES = 4096
NO_FLOCK_ENV = "ARRAYCHECKPOINT_LOCK_NO_FLOCK"
HEARTBEAT_ENV = "ARRAYCHECKPOINT_LOCK_HEARTBEAT_SECONDS"
LEASE_ENV = "ARRAYCHECKPOINT_LOCK_LEASE_INTERVALS"
_DEFAULT_HEARTBEAT = 10.0
_DEFAULT_LEASE_INTERVALS = 6.0
#: a holder's own interval is believed up to this (a document claiming a year would keep its lock a year)
_MAX_HEARTBEAT = 3600.0

#: lock files held by this process's saves: (lock path, token) -> the descriptor holding it (its flock)
_HELD: dict[tuple[str, str], int] = {}
_HELD_LOCK = threading.Lock()


def _env_float(name: str, default: float) -> float:
    try:
        value = float(os.environ.get(name, default))
    except ValueError:
        return default
    return value if value > 0 and value == value else default


def heartbeat_seconds() -> float:
    """How often a held lock's mtime is refreshed (``ARRAYCHECKPOINT_LOCK_HEARTBEAT_SECONDS``, 10 s)."""
    return min(_MAX_HEARTBEAT, _env_float(HEARTBEAT_ENV, _DEFAULT_HEARTBEAT))


def lease_intervals() -> float:
    """After how many missed heartbeats a lock without flock, of another host, is a crashed save's
    (``ARRAYCHECKPOINT_LOCK_LEASE_INTERVALS``, 6)."""
    return _env_float(LEASE_ENV, _DEFAULT_LEASE_INTERVALS)


@dataclass(frozen=True)
class Owner:
    """Who holds a lock, as its file says."""

    token: str
    host: str
    boot_id: str
    pidns: str
    pid: int
    start: int  # the process's start time, clock ticks since boot (/proc/<pid>/stat field 22)
    heartbeat: float
    #: whether the holder holds the lock's flock (False: its mount has none, or ``NO_FLOCK_ENV`` said not to
    #: trust it; then a free flock tells nothing: its liveness is judged as without flock). An older
    #: document without the field is taken as holding it.
    flock: bool = True

    def same_machine(self, other: Owner) -> bool:
        """Whether ``other`` runs where this owner's pid means the same process (host, boot, pid namespace)."""
        return bool(self.boot_id) and (self.host, self.boot_id, self.pidns) == (
            other.host,
            other.boot_id,
            other.pidns,
        )

    def describe(self) -> str:
        return f"save {self.token} pid {self.pid} on {self.host}"


def _read_small(path: str) -> str:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            return f.read(256).strip()
    except OSError:
        return ""


#: :func:`process_start` of a process that exists but whose start this process may not read (``/proc`` mounted
#: with ``hidepid``, common on shared HPC nodes, hides other users' processes): never judged gone
HIDDEN = -1


def process_start(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None when there is no such process, or
    :data:`HIDDEN` when it exists but its ``/proc`` entry cannot be read (``kill(pid, 0)`` decides)."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read(4096)
    except (OSError, ValueError):
        try:
            os.kill(int(pid), 0)
        except PermissionError:
            return HIDDEN  # another user's process
        except (OSError, ValueError, OverflowError):
            return None
        return HIDDEN  # it exists, and its entry is hidden (hidepid) or was unreadable
    fields = raw.rpartition(b")")[2].split()  # after the command name, which may hold spaces and ')'
    try:
        return int(fields[19])  # field 22 of the whole line
    except (IndexError, ValueError):
        return None


def this_owner(token: str, flock: bool = True) -> Owner:
    """The owner document of a lock this process takes now for the save ``token`` (``flock``: whether it
    holds the lock's flock)."""
    try:
        pidns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pidns = ""
    pid = os.getpid()
    return Owner(
        token=token,
        host=socket.gethostname(),
        boot_id=_read_small("/proc/sys/kernel/random/boot_id"),
        pidns=pidns,
        pid=pid,
        start=max(process_start(pid) or 0, 0),
        heartbeat=heartbeat_seconds(),
        flock=flock,
    )


def owner_document(owner: Owner) -> bytes:
    return json.dumps({"arraycheckpoint_lock": 1, **asdict(owner)}, sort_keys=True).encode()


def parse_owner(raw: bytes) -> Owner | None:
    """The owner ``raw`` (a lock file's bytes) names, or None when it is not a valid owner document (an
    older version's lock, a lock being written, anything hostile): every field is type- and size-checked."""
    if len(raw) > MAX_LOCK_BYTES:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("arraycheckpoint_lock") != 1:
        return None
    texts = ("token", "host", "boot_id", "pidns")
    if not all(isinstance(doc.get(k), str) and len(doc[k]) <= 256 for k in texts):
        return None
    numbers = (doc.get("pid"), doc.get("start"))
    if not all(type(n) is int and 0 <= n < 1 << 63 for n in numbers):
        return None
    beat = doc.get("heartbeat")
    try:  # a 400-digit integer is valid JSON but has no float
        beat = float(beat) if type(beat) in (int, float) else None
    except OverflowError:
        beat = None
    if beat is None or not 0 < beat < float("inf"):
        return None
    flock = doc.get("flock", True)
    if type(flock) is not bool:
        return None
    return Owner(*(doc[k] for k in texts), doc["pid"], doc["start"], min(beat, _MAX_HEARTBEAT), flock)


def token_of(raw: bytes) -> str:
    """The save token a lock file names: its owner document's, else (an older version's lock text
    ``<token> pid <pid> on <host>``) its first word."""
    owner = parse_owner(raw)
    if owner is not None:
        return owner.token
    parts = raw.decode(errors="replace").split()
    return parts[0] if parts else ""


def read_lock(fd: int) -> bytes:
    """At most :data:`MAX_LOCK_BYTES` (+1, to tell a longer file) of the lock file open at ``fd``."""
    return os.pread(fd, MAX_LOCK_BYTES + 1, 0)


def open_lock(path: str | Path, flags: int = os.O_RDONLY) -> int | None:
    """``path`` opened when it is a regular file (never through a link, never blocking on a FIFO); None
    when it is absent, not a regular file, or cannot be opened."""
    try:
        fd = os.open(path, flags | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def not_a_lock_file(path: str | Path) -> str | None:
    """What is at ``path`` when it is neither absent nor a regular file (a link, a FIFO, a directory, ...),
    in words; None otherwise."""
    try:
        mode = os.lstat(path).st_mode
    except OSError:
        return None
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    return "a FIFO" if stat.S_ISFIFO(mode) else "a special file (a socket or a device)"


def holder(lock: str | Path) -> str:
    """Who holds ``lock``, for messages (its owner, else its first 200 characters, else ``?``)."""
    fd = open_lock(lock)
    if fd is None:
        return "?"
    try:
        raw = read_lock(fd)
    except OSError:
        return "?"
    finally:
        os.close(fd)
    owner = parse_owner(raw)
    if owner is not None:
        return owner.describe()
    return raw[:200].decode(errors="replace").strip() or "?"


def flock_state(fd: int) -> str:
    """Try an exclusive ``flock`` on ``fd`` (open for writing: NFS emulates it with a POSIX write lock)
    without waiting: ``"taken"``, ``"held"`` (another open file holds it), or ``"none"`` (the file system has
    no flock, or :data:`NO_FLOCK_ENV` says not to trust it). Any other error counts as held."""
    if os.environ.get(NO_FLOCK_ENV, "") not in ("", "0"):
        return "none"
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return "taken"
    except BlockingIOError:
        return "held"
    except OSError as e:
        return "none" if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL) else "held"


def _fs_now_ns(directory: Path) -> int:
    """The file system's clock now (the mtime of a file created and removed in ``directory``): what a lock's
    mtime, set by the holder's heartbeat on that file system, compares with across hosts."""
    probe = directory / f".acp-clock-{uuid.uuid4().hex}"
    try:
        fd = os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
    except OSError:
        return time.time_ns()
    try:
        return os.fstat(fd).st_mtime_ns
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(probe)


def crashed_without_flock(lock: Path, st: os.stat_result, owner: Owner | None) -> str | None:
    """Why ``lock`` (stat ``st``, owner ``owner``) is a crashed save's on a file system without flock, or
    None when it may be live (module docstring)."""
    start = process_start(owner.pid) if owner is not None and owner.same_machine(this_owner("")) else HIDDEN
    if owner is not None and start != HIDDEN:
        if start is None:
            return f"its process {owner.pid} is gone"
        if start != owner.start:
            return f"pid {owner.pid} is another process now"
        return None
    # another machine's save, or one whose process this one may not see: judged by its heartbeat
    interval = max(heartbeat_seconds(), owner.heartbeat if owner is not None else 0.0)
    bound = lease_intervals() * interval
    age = (_fs_now_ns(lock.parent) - st.st_mtime_ns) / 1e9
    if age > bound:
        return f"not refreshed for {age:.0f} s, its lease is {bound:.0f} s"
    if age < -bound:
        return _future(lock, age)
    return None


def _future(path: Path, age: float) -> str:
    """Why a file whose mtime lies ``-age`` seconds in the future (further than a lease: no refresh writes
    that, a clock or a hand did) counts as stale: else it would never age."""
    log.warning("%s has a modification time %.0f s in the future; it is judged stale", path, -age)
    return f"its modification time is {-age:.0f} s in the future"


@dataclass
class Crashed:
    """A crashed save's lock, open: ``flocked`` when this process now holds its flock."""

    fd: int
    st: os.stat_result
    owner: Owner | None
    why: str
    flocked: bool

    def describe(self, lock: str | Path) -> str:
        who = self.owner.describe() if self.owner is not None else holder(lock)
        return f"{who}: {self.why}"


def open_crashed(lock: str | Path) -> Crashed | None:
    """``lock`` opened when it is a crashed save's and still the file at that path; None when a save in
    flight may hold it, it is gone, or this process may not open it (never judged crashed then)."""
    lock = Path(lock)
    fd = open_lock(lock, os.O_RDWR)
    if fd is None:
        return None
    try:
        st = os.fstat(fd)
        state = flock_state(fd)
        if state != "held":
            owner = parse_owner(read_lock(fd))
            now = os.stat(lock, follow_symlinks=False)
            same = (now.st_ino, now.st_dev) == (st.st_ino, st.st_dev)  # not released or replaced meanwhile
            if same and state == "taken":
                if owner is None or owner.flock:
                    return Crashed(fd, st, owner, "nobody holds its flock", True)
                # its holder runs without flock (its mount has none, or NO_FLOCK_ENV): a free flock tells
                # nothing, its owner and lease do
                why = crashed_without_flock(lock, st, owner)
                if why is not None:
                    return Crashed(fd, st, owner, why, True)
                fcntl.flock(fd, fcntl.LOCK_UN)
                os.close(fd)
                return None
            why = crashed_without_flock(lock, st, owner) if same else None
            if why is not None:
                return Crashed(fd, st, owner, why, False)
    except OSError:
        pass
    os.close(fd)
    return None


def _marker(lock: Path) -> int | None:
    """The takeover marker of ``lock`` (``O_EXCL``): its descriptor when this process won it, None when
    another taker holds it. A marker older than a lease (its taker crashed mid-way) is moved aside first,
    by a rename only one of several takers wins."""
    marker = lock.with_name(lock.name + ".takeover")
    for _attempt in range(2):
        try:
            return os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileExistsError:
            try:
                st = os.stat(marker, follow_symlinks=False)
                age = (_fs_now_ns(lock.parent) - st.st_mtime_ns) / 1e9
                bound = lease_intervals() * heartbeat_seconds()
                if age < -bound:
                    _future(marker, age)
                elif age <= bound and stat.S_ISREG(st.st_mode):
                    return None
                # a marker no taker made (not a regular file) goes at once, by the same rename
                aside = marker.with_name(f"{marker.name}-{uuid.uuid4().hex[:8]}")
                os.rename(marker, aside)  # one taker wins; the others find it gone and race to create
                _remove(aside)
            except FileNotFoundError:
                continue
            except OSError:
                return None
        except OSError:
            return None
    return None


def _remove(path: Path) -> None:
    """Remove ``path``, moved aside by this process: a file, a link, or a directory with what it holds."""
    if stat.S_ISDIR(os.stat(path, follow_symlinks=False).st_mode):
        import shutil

        shutil.rmtree(path)
    else:
        os.unlink(path)


def replace_crashed(lock: Path, crashed: Crashed, remove_only: bool = False) -> int | None:
    """Replace the crashed lock ``crashed`` (no flock held: exactly one taker may) with a fresh file created
    with ``O_EXCL``; its descriptor, or None when another save took it over or created it first, or it
    changed since it was judged (refreshed: live). ``remove_only``: remove it (returns -1 when removed)."""
    mfd = _marker(lock)
    if mfd is None:
        return None
    marker = lock.with_name(lock.name + ".takeover")
    try:
        now = os.stat(lock, follow_symlinks=False)
        judged = (crashed.st.st_ino, crashed.st.st_dev, crashed.st.st_mtime_ns)
        if (now.st_ino, now.st_dev, now.st_mtime_ns) != judged:
            return None
        os.unlink(lock)
        if remove_only:
            return -1
        return os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    except OSError:
        return None
    finally:
        os.close(mfd)
        with contextlib.suppress(OSError):
            os.unlink(marker)


def take_crashed(lock: Path) -> int | None:
    """The descriptor of ``lock`` now held by this process when it was a crashed save's (a warning names
    the lock and its owner); None when it is not, or another save took it first."""
    crashed = open_crashed(lock)
    if crashed is None:
        return None
    if crashed.flocked:
        fd: int | None = crashed.fd
    else:
        os.close(crashed.fd)
        fd = replace_crashed(lock, crashed)
    if fd is not None:
        log.warning(
            "taking over %s, left by a save that is no longer running (%s)", lock, crashed.describe(lock)
        )
    return fd


def remove_crashed(path: str) -> bool:
    """Remove a crashed save's lock file (holding its flock, or its takeover marker, meanwhile: a save
    taking it over between a probe and the removal would lose its lock); whether it was removed."""
    crashed = open_crashed(path)
    if crashed is None:
        return False
    if not crashed.flocked:
        os.close(crashed.fd)
        return replace_crashed(Path(path), crashed, remove_only=True) == -1
    try:
        os.remove(path)
        return True
    except OSError as e:
        log.warning("cleanup: could not remove %s (%s); it is kept", path, e)
        return False
    finally:
        os.close(crashed.fd)


def is_live(path: str) -> bool:
    """Whether the lock file ``path`` may be a save's in flight (not judged crashed)."""
    crashed = open_crashed(path)
    if crashed is None:
        return True
    os.close(crashed.fd)
    return False


def still_held(lock: Path, token: str) -> bool:
    """Whether this process's save ``token`` still holds ``lock`` (the file at its path is the one it
    took: false when another save took it over after its lease ran out)."""
    with _HELD_LOCK:
        fd = _HELD.get((str(lock), token))
        if fd is None:
            return True  # not taken by this process's acquire (a caller of commit alone)
        try:
            mine, now = os.fstat(fd), os.stat(lock, follow_symlinks=False)
            if (mine.st_ino, mine.st_dev) != (now.st_ino, now.st_dev):
                return False
            # the same file, but a taker holding its flock rewrites it in place: the token it names decides
            return token_of(read_lock(fd)) == token
        except OSError:
            return False


# The heartbeat: one thread per process while it holds a lock ------------------------------------------------
def _refresh_held() -> None:
    """Refresh every held lock's mtime (under the lock of the table, so a descriptor is never closed, and its
    number reused, meanwhile)."""
    with _HELD_LOCK:
        for (path, _token), fd in _HELD.items():
            try:
                os.utime(fd)
            except OSError as e:
                log.debug("could not refresh the lock %s: %s", path, e)


_BEAT = Heartbeat("acp-lock-heartbeat", _HELD_LOCK, lambda: bool(_HELD), _refresh_held, heartbeat_seconds)


def hold(lock: Path, token: str, fd: int) -> None:
    """Record ``fd`` as this process's hold on ``lock`` for ``token`` and keep its lease fresh."""
    with _HELD_LOCK:
        _HELD[(str(lock), token)] = fd
        _BEAT.ensure()


def unhold(lock: Path, token: str) -> int | None:
    """Forget this process's hold on ``lock`` for ``token``; its descriptor (the caller closes it)."""
    with _HELD_LOCK:
        return _HELD.pop((str(lock), token), None)
