"""POSIX file systems: tensorstore's ``file`` kvstore, atomic rename commit, a lock file per target, syncfs.

Layout of one save of ``<dir>/<name>`` (:mod:`.localnames`: no name of ours beside the target holds its name,
so no framework scanning ``<dir>`` for ``step-N`` takes one for a step):

* ``<dir>/.acp-lock-<h>``: created with ``O_EXCL`` by the coordinator, held until the save ends; names its
  owner (the save's token, host, pid, ...: :mod:`.locks`, which also says when a crashed save's is taken over);
* ``<dir>/.acp-staging-<token>/``: every rank writes here; the coordinator adds the metadata and the commit
  marker (``.acp/metadata.json``, ``.acp/committed``) and renames it onto ``<dir>/<name>`` (one atomic
  ``rename(2)``);
* ``<dir>/.acp-old-<token>/<name>``: the replaced checkpoint during an ``overwrite=True`` commit (removed after);
* ``<dir>/.acp-trash-<hex>/``: a checkpoint being deleted by retention (renamed first, so a partial delete is
  never visible under the step's name).

Anything of these left by a crash (or an older version's, named after the target) is invisible to readers and
removed by :meth:`cleanup_leftovers`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..checks.files import open_below
from ..errors import CheckpointExistsError, CorruptCheckpointError, MetadataError, StorageError
from ..format.metadata import COMMIT_MARKER
from . import localnames as names
from . import locks
from .base import Storage, check_read_size, read_limit
from .localtarget import check_parents, put_back, refuse_foreign
from .localtarget import fsync_path as fsync_path

log = logging.getLogger("arraycheckpoint")

_open_below = open_below  # the shared check of every reader (arraycheckpoint.checks.files)
_live_tokens = names.live_tokens  # the saves in flight in a directory (module global: the tests' probe)
_staging_token = names.staging_token


class LocalStorage(Storage):
    """A local or shared POSIX file system (``/path`` or ``file:///path``)."""

    commit_strategy = "rename"
    #: :meth:`commit` makes everything under the staging directory durable before publishing it, so the
    #: coordinator's metadata needs no flush of its own first (:mod:`arraycheckpoint.engine.coordinate`)
    flushes_at_commit = True

    @property
    def _sync_fds(self) -> dict[str, int]:
        """Per staging root, the descriptor :meth:`flush` syncs on (:meth:`open_flush`); per instance (a
        subclass need not call ``__init__``)."""
        return self.__dict__.setdefault("_sync_fds_", {})

    def normalize(self, url: str) -> str:
        if url.startswith("file://"):
            url = url[len("file://") :]
        # abspath, not Path.absolute(): ``..`` is resolved here (tensorstore's file driver refuses it)
        return os.path.abspath(os.path.expanduser(url))

    def kvstore_spec(self, root: str) -> dict[str, Any]:
        return {"driver": "file", "path": root.rstrip("/") + "/"}

    def join(self, root: str, name: str) -> str:
        return os.path.join(root, name)

    def parent(self, root: str) -> tuple[str, str]:
        p = Path(root)
        return str(p.parent), p.name

    def staging_root(self, final: str, token: str) -> str:
        return names.staging_path(final, token)

    def _lock(self, final: str) -> Path:
        return names.lock_path(final)

    def acquire(self, final: str, token: str) -> None:
        """Take ``final``'s lock file for this save (``O_EXCL``), and hold it until :meth:`release`: an
        ``flock`` the kernel drops when the process ends however it ends, so a lock nobody holds is a crashed
        save's and is taken over with a warning naming it and its owner; where the file system has no flock,
        the owner its file names and its lease decide (:mod:`.locks`)."""
        names.refuse_ours(final)
        lock = self._lock(final)
        check_parents(lock.parent)
        with locks._HELD_LOCK:
            held_here = any(path == str(lock) for path, _t in locks._HELD)
        if held_here:  # a save of this process holds it (an async save in flight): never a takeover
            raise CheckpointExistsError(
                f"another save to {final} is in progress in this process (lock {lock}); wait for it"
            )
        legacy = names.legacy_lock_path(final)  # an older version's save (its lock named after the target)
        if os.path.isfile(legacy) and not os.path.islink(legacy) and locks.is_live(str(legacy)):
            raise CheckpointExistsError(f"another save to {final} is in progress (lock {legacy}); wait")
        fd: int | None
        try:
            lock.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
            if locks.flock_state(fd) == "held":  # a newcomer took the fresh file as stale meanwhile
                os.close(fd)
                fd = None
        except FileExistsError:
            fd = locks.take_crashed(lock)
        except OSError as e:
            raise StorageError(f"storage lock of {lock} failed: {e}") from e
        if fd is None:
            odd = locks.not_a_lock_file(lock)
            if odd is not None:  # no save holds it, none takes it over: waiting would never end
                raise CheckpointExistsError(
                    f"cannot save to {final}: its lock path {lock} is {odd}, not a lock file of ours; no save "
                    "holds it and none takes it over or removes it: remove it yourself (nothing else there is "
                    "touched)"
                )
            raise CheckpointExistsError(
                f"another save to {final} is in progress (lock {lock} held by {locks.holder(lock)}); wait for "
                "it. A crashed save's lock is taken over: with flock at once, without flock once its process "
                f"is gone (same host) or its lease ran out ({locks.LEASE_ENV} x {locks.HEARTBEAT_ENV})"
            )
        try:
            os.ftruncate(fd, 0)
            flocked = locks.flock_state(fd) == "taken"  # held already: taken again, no wait
            os.pwrite(fd, locks.owner_document(locks.this_owner(token, flocked)), 0)
        except OSError as e:
            os.close(fd)
            raise StorageError(f"storage lock of {lock} failed: {e}") from e
        locks.hold(lock, token, fd)

    def release(self, final: str, token: str) -> None:
        lock = self._lock(final)
        fd = locks.unhold(lock, token)
        try:
            probe = locks.open_lock(lock)
            if probe is not None:
                try:
                    ours = locks.token_of(locks.read_lock(probe)) == token
                finally:
                    os.close(probe)
                if ours:
                    lock.unlink()
        except FileNotFoundError:
            pass
        finally:
            if fd is not None:
                os.close(fd)  # drops the flock, after the file is gone

    def open_flush(self, root: str) -> None:
        """Open the descriptor :meth:`flush` will ``syncfs`` on, now, before this rank writes under ``root``
        (created here if absent, as the first write would): Linux reports a write-back error to ``syncfs(2)``
        only when it happened after the descriptor was opened (the file system's error sequence is sampled at
        ``open``), so a descriptor opened at the flush misses an error from write-back started earlier (the
        writer starts it per large file) and the save would commit data the disk never took. One descriptor
        per save and rank, closed by :meth:`close_flush`."""
        if root in self._sync_fds:
            return
        try:
            os.makedirs(root, exist_ok=True)
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StorageError(f"cannot open {root} to flush it later: {e}") from e
        self._sync_fds[root] = fd

    def close_flush(self, root: str) -> None:
        fd = self._sync_fds.pop(root, None)
        if fd is not None:
            try:
                os.close(fd)
            except OSError:  # nothing to report: the flush already reported what it could
                pass

    def flush(self, root: str) -> None:
        """``syncfs`` the file system holding ``root`` on the descriptor :meth:`open_flush` opened (errors of
        every write-back since then, of any file there); a caller that did not call it gets one opened now
        (errors from before are not seen then).

        Raises:
            StorageError: a write did not reach the disk (``EIO``, ``ENOSPC``, ...), naming ``root``.
        """
        own = self._sync_fds.get(root)
        if own is None:
            path = root if os.path.isdir(root) else os.path.dirname(root)
            if not os.path.isdir(path):
                return
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        else:
            path, fd = root, own
        try:
            if _syncfs(fd) != 0:
                err = ctypes.get_errno()
                if err not in (0, errno.ENOSYS, errno.EINVAL, errno.EPERM):  # EIO, ENOSPC: a write was lost
                    raise StorageError(
                        f"flush of {path} failed: {os.strerror(err)} (a write did not reach the disk)"
                    )
                os.sync()  # no syncfs here
        finally:
            if own is None:
                os.close(fd)

    def check_target(self, final: str, overwrite: bool) -> None:
        """Refuse a target that is not a directory, or that holds anything but a committed checkpoint.

        Only a committed checkpoint is ever replaced (and only with ``overwrite``): a directory of the user's
        (``notes.txt``, ``tb_logs/``) is refused, naming what is in it, and kept as it is.
        """
        names.refuse_ours(final)
        super().check_target(final, overwrite)
        refuse_foreign(final, self.is_committed)

    def commit(self, staging: str, final: str, overwrite: bool) -> None:
        token = _staging_token(os.path.basename(staging))
        if token is not None and not locks.still_held(self._lock(final), token):
            raise StorageError(
                f"storage commit of {final} refused: this save's lock {self._lock(final)} was taken over by "
                f"{locks.holder(self._lock(final))} (this process was stopped past the lock's lease?)"
            )
        # into the save's own staging: never recreated around a marker (a staging removed under this save
        # would otherwise commit as a checkpoint of nothing)
        marker = os.path.join(staging, COMMIT_MARKER)
        try:
            try:
                os.mkdir(os.path.dirname(marker))
            except FileExistsError:
                pass
            fd = os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except OSError as e:
            raise StorageError(f"storage commit of {final} failed: its marker {marker}: {e}") from e
        try:
            os.write(fd, b"committed\n")
        finally:
            os.close(fd)
        # one syncfs makes the marker, its directory entry and everything written under the staging
        # directory since the last flush (the coordinator's metadata: :attr:`flushes_at_commit`) durable
        # before the rename publishes them: one device flush instead of three (~4 ms each here)
        self.flush(staging)
        old = None
        if os.path.lexists(final):
            if not overwrite and self.is_committed(final):
                raise CheckpointExistsError(f"{final} was committed by someone else during this save")
            if refuse_foreign(final, self.is_committed):  # appeared during this save: refused, kept
                os.rmdir(final)  # empty: nothing of anyone's is lost
            else:  # aside, in a holder named after this save (the entry in it says where it goes back)
                holder = names.old_holder(final, token)
                os.mkdir(holder)
                old = os.path.join(holder, os.path.basename(final))
                os.rename(final, old)
        try:
            os.rename(staging, final)
        except OSError as e:
            if old is not None:
                put_back(old, final, e)
            raise StorageError(f"storage commit (rename {staging} -> {final}) failed: {e}") from e
        try:  # committed now: a failure from here on must not report it as not committed
            fsync_path(os.path.dirname(final))
        except PermissionError as e:  # a parent this process may write to but not open (mode 0300)
            log.warning(
                "%s is committed, but its parent could not be opened to make that durable: %s", final, e
            )
        if old is not None:
            shutil.rmtree(os.path.dirname(old), ignore_errors=True)

    def abort(self, staging: str, final: str) -> None:
        if staging != final:
            shutil.rmtree(staging, ignore_errors=True)

    # Small-object and manager operations with plain POSIX calls -----------------------------------------
    def read(self, root: str, key: str, limit: int | None = None) -> bytes | None:
        """The regular file ``root/key`` (never through a symlink at or below ``root``, never a FIFO) of at most
        ``limit`` bytes (:meth:`Storage.read`), or None when absent."""
        limit = read_limit(limit)
        path = os.path.join(root, key)
        fd = _open_below(root, key)
        if fd is None:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise CorruptCheckpointError(
                    f"{path} is not a regular file; a checkpoint holds only regular files"
                )
            if st.st_size > limit:
                raise MetadataError(
                    f"{path} is {st.st_size} bytes, above the limit of {limit} for that file of a checkpoint; "
                    "the checkpoint is damaged or hostile"
                )
            return check_read_size(path, f.read(limit + 1), limit)

    def exists(self, root: str, key: str) -> bool:
        """Whether ``root/key`` is a file, by a stat of the descriptor (never a read; links refused as in
        :meth:`read`)."""
        fd = _open_below(root, key)
        if fd is None:
            return False
        try:
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        finally:
            os.close(fd)
        if not regular:
            raise CorruptCheckpointError(
                f"{os.path.join(root, key)} is not a regular file; a checkpoint holds only regular files"
            )
        return True

    def delete(self, root: str) -> None:
        try:
            shutil.rmtree(root)
        except FileNotFoundError:
            pass
        except NotADirectoryError:
            os.remove(root)
        except OSError as e:
            raise StorageError(f"storage delete of {root} failed: {e}") from e

    def delete_key(self, root: str, key: str, guard: Callable[[], None] | None = None) -> None:
        if guard is not None:
            guard()
        try:
            os.remove(os.path.join(root, key))
        except FileNotFoundError:
            pass
        except OSError as e:
            raise StorageError(f"storage delete of {root}/{key} failed: {e}") from e

    def children(self, root: str) -> list[str]:
        try:
            return sorted(os.listdir(root))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise StorageError(f"storage list of {root} failed: {e}") from e

    def remove_checkpoint(self, root: str) -> None:
        """Rename ``root`` aside (atomic: the step disappears at once), then delete it."""
        trash = names.trash_path(root)
        try:
            os.rename(root, trash)
        except FileNotFoundError:
            return
        except OSError as e:
            if e.errno not in (errno.EXDEV, errno.EBUSY):
                raise StorageError(f"storage delete of {root} failed: {e}") from e
            trash = root
        shutil.rmtree(trash, ignore_errors=True)

    def cleanup_leftovers(self, parent: str) -> list[str]:
        """Remove staging directories, lock files, replaced (``.acp-old-``) and ``.acp-trash-`` leftovers in
        ``parent``, an older version's too (:mod:`.localnames`); returns what was removed.

        A committed replaced copy whose step is gone is put back instead: a save replacing a committed step
        (``overwrite``) moves the old one aside before moving its own in, and a crash between the two renames
        leaves the old one the step's only committed copy. Every copy of a save whose lock is live stays (it
        may be between those renames). What cannot be removed (another user's directory) is kept, with a
        warning naming it, and not reported removed.
        """
        removed = []
        entries = self.children(parent)
        live = _live_tokens(parent, entries)  # saves in flight (another job's): their lock and staging stay
        # a step's replaced copies newest first: the newest committed one is put back, the older are removed
        for name in sorted(entries, key=lambda n: -names.replaced_time(parent, n)):
            found = names.classify(name)
            if found is None or names.in_flight(found, name, live, parent):
                continue
            path = os.path.join(parent, name)
            if found.kind == "lock":  # a crashed save's: removed holding its flock (a newcomer may take it)
                if locks.remove_crashed(path):
                    removed.append(path)
                continue
            if os.path.isdir(path) and not os.path.islink(path):
                if any(self._restored(old, final) for old, final in names.replaced_copies(parent, name)):
                    if found.step is None:  # restored out of its holder (gone), or kept in it
                        with contextlib.suppress(OSError):
                            os.rmdir(path)
                    continue  # restored, or kept as maybe the step's one copy: not removed
                shutil.rmtree(path, ignore_errors=True)
            else:
                try:
                    os.remove(path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("cleanup: could not remove %s (%s); it is kept", path, e)
                    continue
            if os.path.lexists(path):
                log.warning("cleanup: could not remove all of %s (not ours to delete?); it is kept", path)
                continue
            removed.append(path)
        return removed

    def _restored(self, old: str, final: str) -> bool:
        """Put the committed ``old`` back at ``final`` when nothing is there (a save that replaced it crashed
        between its two renames); whether it was, or is kept: while a save of ``final`` is in flight, or when
        ``old`` was committed after what ``final`` holds now (an overwrite whose put-back failed: its error
        named this copy)."""
        try:
            if os.path.lexists(final):
                if names.committed_time(old) <= names.committed_time(final):
                    return False  # older than the step's copy: removed
                log.warning("cleanup: kept %s: it was committed after what %s holds now; move it back "
                            "yourself if it is the copy you want", old, final)  # fmt: skip
                return True
            if not self.is_committed(old):
                return False
            if names.step_locked(final):  # a save in flight (started since the cleanup looked) replaces it
                log.info("cleanup: kept %s: a save of %s is in flight", old, final)
                return True
            os.rename(old, final)
        except (OSError, StorageError, CorruptCheckpointError) as e:
            log.warning("cleanup: kept %s, which may be the only committed copy of %s: %s", old, final, e)
            return True  # never deleted when it might be the one copy
        log.warning("cleanup: restored %s from %s (a save replacing it did not finish)", final, old)
        fsync_path(os.path.dirname(final))
        return True


_HELD, _HELD_LOCK = locks._HELD, locks._HELD_LOCK  # this process's held locks (for the conformance suite)


_libc: Any = None


def _syncfs(fd: int) -> int:
    """``syncfs(2)`` on the file system holding ``fd``: one flush for every file this rank wrote there."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syncfs.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return -1
    return int(_libc.syncfs(fd))
