"""The storage seam: where checkpoint bytes live and how a checkpoint becomes visible (commit).

A :class:`Storage` resolves a checkpoint root to a tensorstore kvstore spec (the engine opens arrays on it),
offers small-object reads/writes for metadata (through tensorstore by default, so every kvstore-backed
backend shares one code path, with bounded retries, see :mod:`.retry`), and implements a commit strategy:

* ``rename`` (POSIX file systems): ranks write into a private staging root; the coordinator writes the
  metadata and commit marker there and renames the staging root onto the final path. A crash leaves only a
  staging directory that no reader looks at.
* ``marker`` (object stores, memory, fsspec): ranks write in place; the commit marker ``.acp/committed`` is
  written last. Readers treat a root without the marker as absent.

Control files (metadata, marker, metrics) live where :data:`~arraycheckpoint.format.metadata.CONTROL` says; a
checkpoint of format 1 or 2 keeps them in its root (:data:`~arraycheckpoint.format.metadata.LEGACY_CONTROL`), and
:meth:`Storage.control_files` tells which layout a checkpoint uses.

Call order (the engine's): ``check_target`` and ``acquire`` on the coordinator at snapshot time, then every rank
calls ``open_flush`` before its first write under ``staging_root``, writes, calls ``flush`` on what it wrote and
``close_flush`` once the save ended (on every path), while the coordinator writes metadata and calls ``commit``
(or ``abort`` on failure) and finally ``release``. One :class:`Storage` instance serves one save or
one load (``storage_for`` makes a fresh one), so a backend may keep per-save state on ``self``.

The checkpoint manager additionally uses :meth:`children`, :meth:`remove_checkpoint` and
:meth:`cleanup_leftovers`.

This module does not decide *where* a checkpoint goes (the caller's URL does) and never retries bulk array
I/O (tensorstore does that per request where the transport needs it).
"""

from __future__ import annotations

import dataclasses
import logging
import re
import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from ..errors import MetadataError, StorageError
from ..format.metadata import COMMIT_MARKER, CONTROL, CONTROL_DIR, CONTROL_LAYOUTS, ControlFiles
from . import lease, leftovers
from .claims import LOCK_KEY as LOCK_KEY
from .claims import SHOWN_KEYS as SHOWN_KEYS
from .claims import TAKEOVER_KEY, TargetClaims
from .retry import DEFAULT_POLICY, RetryPolicy, is_transient, retry_call

log = logging.getLogger("arraycheckpoint")

#: No request counts as stalled sooner (a tiny ``timeout=`` must not fail a healthy store's requests).
_MIN_STALL_SECONDS = 1.0


class Storage(TargetClaims, ABC):
    """One storage backend, bound to one URL scheme."""

    #: "rename" or "marker"; see the module docstring.
    commit_strategy: str = "marker"
    #: Bounded retries of the small-object operations.
    retry_policy: RetryPolicy = DEFAULT_POLICY
    #: Seconds one small-object request may go unanswered, and after which an operation starts no new attempt
    #: (so one operation ends within about twice this); a save sets it from its ``timeout=``. None: the
    #: liveness default (``ACP_LIVENESS_TIMEOUT``, else 300 s).
    stall_timeout: float | None = None
    #: The commit marker's write failed without an answer (it may land later); :meth:`abort` keeps the objects.
    _marker_in_doubt: bool = False

    @abstractmethod
    def kvstore_spec(self, root: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of the directory/prefix ``root`` (with trailing slash semantics)."""

    def object_kvstore_spec(self, root: str, key: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of the one object ``key`` below ``root`` (a pack file, which
        tensorstore's ``zip`` driver takes as its ``base``)."""
        head, _, leaf = key.rpartition("/")
        spec = dict(self.kvstore_spec(self.join(root, head) if head else root))
        spec["path"] = str(spec.get("path", "")) + leaf
        return spec

    def normalize(self, url: str) -> str:
        """The canonical root string of ``url`` for this backend."""
        return url.rstrip("/")

    def join(self, root: str, name: str) -> str:
        """The root of child ``name`` under ``root``."""
        return f"{root.rstrip('/')}/{name}"

    def parent(self, root: str) -> tuple[str, str]:
        """``(parent root, last component)`` of ``root``."""
        head, _, name = root.rstrip("/").rpartition("/")
        return head, name

    # Small objects through tensorstore --------------------------------------------------------------
    def _kv(self, root: str) -> Any:
        import tensorstore as ts

        from ..runtime.tscontext import context

        return self._wait(ts.KvStore.open(self.kvstore_spec(root), context=context()))

    def stall_bound(self) -> float:
        """Seconds one request may go unanswered (:attr:`stall_timeout`, else the liveness default; 1 s at
        least)."""
        from ..runtime.liveness import default_timeout

        return max(_MIN_STALL_SECONDS, float(self.stall_timeout or default_timeout()))

    def _wait(self, future: Any) -> Any:
        """``future.result()`` within :meth:`stall_bound` seconds: a request a stalled store never answers
        raises ``TimeoutError`` (transient: retried while the operation's time lasts) instead of hanging."""
        bound = self.stall_bound()
        try:
            return future.result(timeout=bound)
        except TimeoutError as e:
            raise TimeoutError(f"no answer from the store within {bound:.3g} s (it stalls)") from e

    def _retry(self, operation: str, path: str, fn: Any) -> Any:
        return retry_call(operation, path, fn, self.retry_policy, deadline=self.stall_bound())

    def read(self, root: str, key: str, limit: int | None = None) -> bytes | None:
        """The bytes stored at ``root/key``, or None when absent: a document (metadata, a control file, a
        sidecar) of at most ``limit`` bytes (:data:`~arraycheckpoint.checks.bounds.MAX_METADATA_BYTES` by
        default).

        Raises:
            MetadataError: the object is larger than ``limit`` (a damaged or hostile checkpoint), named."""
        limit = read_limit(limit)

        def op() -> bytes | None:
            result = self._wait(self._kv(root).read(key))
            return bytes(result.value) if result.state == "value" else None

        return check_read_size(f"{root}/{key}", self._retry("read", f"{root}/{key}", op), limit)

    def write(self, root: str, key: str, data: bytes) -> None:
        """Store ``data`` at ``root/key`` (overwriting)."""
        self._retry("write", f"{root}/{key}", lambda: self._wait(self._kv(root).write(key, data)))

    def exists(self, root: str, key: str) -> bool:
        """Whether ``root/key`` holds a value, without reading it: an empty byte range, which tensorstore's
        object-store drivers (s3, gcs, http) send as a HEAD request and its file driver as a stat."""

        def op() -> bool:
            return bool(self._wait(self._kv(root).read(key, byte_range=slice(0, 0))).state == "value")

        return bool(self._retry("exists", f"{root}/{key}", op))

    def list(self, root: str) -> list[str]:
        """Every key below ``root`` (relative, sorted)."""

        def op() -> list[str]:
            keys = self._wait(self._kv(root).list())
            return sorted(k.decode() if isinstance(k, bytes) else k for k in keys)

        return self._retry("list", root, op)

    def delete(self, root: str) -> None:
        """Remove everything below ``root`` (nothing outside it; a missing root is not an error)."""
        import tensorstore as ts

        self._retry("delete", root, lambda: self._wait(self._kv(root).delete_range(ts.KvStore.KeyRange())))

    def delete_key(self, root: str, key: str, guard: Callable[[], None] | None = None) -> None:
        """Remove the single object ``root/key`` (absent is fine); ``guard`` (a lease check, no I/O) runs
        before each attempt, so a delete retried after its lease may be taken over is not sent again."""

        def attempt() -> None:
            if guard is not None:
                guard()
            self._wait(self._kv(root).write(key, None))

        self._retry("delete", f"{root}/{key}", attempt)

    def is_committed(self, root: str) -> bool:
        """Whether ``root`` holds a committed checkpoint (its commit marker exists, in any format's layout)."""
        return self.committed_layout(root) is not None

    def committed_layout(self, root: str) -> ControlFiles | None:
        """The layout whose commit marker is at ``root`` (format 3's first: one lookup for a current
        checkpoint), or None when ``root`` holds no committed checkpoint."""
        return next((files for files in CONTROL_LAYOUTS if self.exists(root, files.committed)), None)

    def control_files(self, root: str) -> ControlFiles:
        """Where the checkpoint at ``root`` keeps its control files: the layout whose commit marker (else
        whose metadata) is there; the current layout when neither is (a new or absent checkpoint)."""
        committed = self.committed_layout(root)
        if committed is not None:
            return committed
        return next((files for files in CONTROL_LAYOUTS if self.exists(root, files.metadata)), CONTROL)

    def children(self, root: str) -> list[str]:
        """Names of the immediate children (files and directories/prefixes) of ``root``, sorted."""
        return sorted({k.split("/", 1)[0] for k in self.list(root)})

    # Commit strategy -----------------------------------------------------------------------------------
    def staging_root(self, final: str, token: str) -> str:
        """Where ranks write before commit. Marker strategy writes in place."""
        return final

    def sample(self, root: str, limit: int) -> list[str]:
        """Up to ``limit`` keys below ``root`` (relative, sorted; a backend listing one level may name a
        directory as ``name/``): one bounded listing where the backend has one. This default lists through
        tensorstore, which has no limit (cheap for ``memory://``; object-store backends override it)."""
        return self.list(root)[:limit]

    def open_flush(self, root: str) -> None:
        """Called on every rank before its first write under ``root``: a backend whose :meth:`flush` can only
        report errors that happened after some point (Linux ``syncfs(2)`` reports a write-back error only to a
        descriptor opened before it) takes that point now. Paired with :meth:`close_flush`. No-op here."""
        return None

    def close_flush(self, root: str) -> None:
        """Release what :meth:`open_flush` took for ``root`` (idempotent; called on every path once the save
        ended, after the coordinator's last :meth:`flush`); here: stop following its lock (:meth:`follow_lease`)."""
        lease.unfollow(self, root)

    def flush(self, root: str) -> None:
        """Make this rank's writes under ``root`` durable (one batched flush; a no-op where writes are)."""
        return None

    def commit(self, staging: str, final: str, overwrite: bool) -> None:
        """Make the checkpoint visible: the marker is written last, and only while this save still holds its
        lock (a save whose lease ran out, and was taken over, never commits)."""
        self.verify_lease(final)
        self._write_marker(final)

    def _write_marker(self, final: str) -> None:
        """Write the commit marker. A write that failed without an answer (timed out, connection dropped,
        5xx) may still land later: :meth:`abort` then keeps the save's objects (see there)."""
        self._marker_in_doubt = False  # this save's marker (an instance may serve several saves)
        try:
            self.write(final, COMMIT_MARKER, b"committed\n")
        except StorageError as e:
            cause = e.__cause__
            self._marker_in_doubt = cause is not None and is_transient(cause)
            raise

    def abort(self, staging: str, final: str) -> None:
        """Remove what a failed save wrote (best effort; never raises).

        Not after a commit marker write whose outcome is unknown: the request may still be stored after this
        abort (a server answering late), and a marker landing on a prefix whose objects were deleted made a
        committed checkpoint without its metadata (``latest_step()`` chose it, ``restore()`` failed). The
        complete objects are kept: a late marker commits a whole checkpoint; otherwise they are an uncommitted
        leftover that the next save to the path, or a manager's start-up cleanup, removes.

        Nor (written in place) once the lock no longer names this save: another save took the target over,
        and what is there may be its committed checkpoint; its lease is checked before each delete (no
        request), so an abort resumed after its host was frozen past the lease stops there."""
        if self._marker_in_doubt:
            log.warning(
                "the commit marker of %s was sent but not acknowledged and may still be stored: the save's "
                "objects are kept whole (a manager's cleanup removes them if it never lands)", final,
            )  # fmt: skip
            return
        if staging == final and self._refused == final:
            log.warning(
                "abort of the save to %s deletes nothing: its claim of the target was refused (what is there is "
                "another save's, or not a checkpoint)", final,
            )  # fmt: skip
            return
        token = self._lease_token
        if token is not None and staging == final:  # written in place: only while the target is still ours
            try:
                holder = self._lock_token(final)
            except Exception as e:  # noqa: BLE001 - unknown holder: nothing is deleted
                log.warning(
                    "abort of save %s to %s deletes nothing: its lock could not be read (%s); the objects are "
                    "an uncommitted leftover (the next save there, or a manager's cleanup, removes them)",
                    token, final, e,
                )  # fmt: skip
                return
            if holder != token:
                log.warning(
                    "abort of save %s to %s deletes nothing: its lock names %s now (another save took the "
                    "target over and may have committed there)", token, final, holder or "no save",
                )  # fmt: skip
                return
        try:
            for key in self.list(staging):
                if key != LOCK_KEY:
                    if token is not None and staging == final:
                        self.check_lease(final)  # no I/O: a lease lost or run out (a frozen host) stops it
                        self.delete_key(staging, key, lambda: self.check_lease(final))
                    else:
                        self.delete_key(staging, key)
        except Exception as e:  # noqa: BLE001 - cleanup must not mask the save's own error
            log.warning("abort of the save to %s stopped deleting (%s); what remains is an uncommitted leftover",
                        final, e)  # fmt: skip

    # Checkpoint manager support ---------------------------------------------------------------------
    def remove_checkpoint(self, root: str) -> None:
        """Delete the checkpoint at ``root``: the commit marker first, so a partial delete reads as absent."""
        self._delete_markers(root)
        self.delete(root)

    def _delete_markers(self, root: str) -> None:
        """Remove the commit marker of every format's layout (an old checkpoint's too)."""
        for files in CONTROL_LAYOUTS:
            self.delete_key(root, files.committed)

    def cleanup_leftovers(self, parent: str) -> list[str]:
        """Remove what crashed saves of this backend's commit protocol left directly under ``parent``.

        Marker strategy: crashed saves' lock objects inside children; a live lease (another job's save in
        flight) stays (:mod:`.leftovers`). (Uncommitted step directories themselves are removed by the
        checkpoint manager, which knows its naming: :meth:`remove_uncommitted`.) Returns what was removed.
        """
        return leftovers.clear_locks(self, parent)

    def remove_uncommitted(self, root: str) -> bool:
        """Delete the uncommitted checkpoint at ``root`` unless a save in flight holds its lock (a live
        lease); whether it was deleted (:func:`.leftovers.remove_uncommitted`)."""
        return leftovers.remove_uncommitted(self, root)


#: a chunk file's name: ``c`` then a ``.``-separated index per dimension (format 3 on), ``c`` alone for 0-d
_CHUNK_LEAF = re.compile(r"c(\.[0-9]+)*")
#: every control file of every layout, and the lock
_CONTROL_KEYS = frozenset(
    {LOCK_KEY, *(k for f in CONTROL_LAYOUTS for k in dataclasses.astuple(f) if k is not None)}
)


def is_checkpoint_key(key: str) -> bool:
    """Whether a save of ours can have written ``key`` (relative to a checkpoint root): a control file or
    the lock, anything under ``.acp/`` (control node, packs), a ``zarr.json`` (array or group), or a chunk
    file (``<name>/c.0.1``; formats 1 and 2: ``<name>/c/0/1``). Entry names never start with ``.``, so a
    user's dot file is never one; a user's own zarr arrays cannot be told apart (never save into a prefix
    holding them)."""
    if key in _CONTROL_KEYS or key.startswith((CONTROL_DIR + "/", TAKEOVER_KEY)):
        return True
    parts = key.split("/")
    if len(parts) < 2 or any(p == "" or p.startswith(".") for p in parts):
        return key == "zarr.json"
    leaf = parts[-1]
    if leaf == "zarr.json" or _CHUNK_LEAF.fullmatch(leaf):
        return True
    for i in range(1, len(parts) - 1):  # formats 1 and 2: <name>/c/<i>/<j>
        if parts[i] == "c" and all(p.isascii() and p.isdigit() for p in parts[i + 1 :]):
            return True
    return False


# Checkpoints being read in this process -------------------------------------------------------------------
_reading: Counter[str] = Counter()
_reading_guard = threading.Lock()


@contextmanager
def reading(storage: Storage, root: str) -> Iterator[None]:
    """Mark ``root`` as being read by this process for the duration (retention skips it)."""
    key = root.rstrip("/")
    with _reading_guard:
        _reading[key] += 1
    try:
        yield
    finally:
        with _reading_guard:
            _reading[key] -= 1
            if _reading[key] <= 0:
                del _reading[key]


def being_read(storage: Storage, root: str) -> bool:
    """Whether a load in this process is reading ``root`` now."""
    with _reading_guard:
        return root.rstrip("/") in _reading


def read_limit(limit: int | None) -> int:
    """The most bytes :meth:`Storage.read` returns: ``limit``, or the metadata bound."""
    from ..checks.bounds import MAX_METADATA_BYTES

    return MAX_METADATA_BYTES if limit is None else limit


def check_read_size(where: str, data: bytes | None, limit: int) -> bytes | None:
    """``data`` (the object ``where`` as read), refused when it is larger than ``limit``."""
    if data is not None and len(data) > limit:
        raise MetadataError(
            f"{where} is larger than {limit} bytes, more than a valid checkpoint stores in that file; the "
            "checkpoint is damaged or hostile"
        )
    return data
