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

from ..errors import CheckpointExistsError, MetadataError, StorageError
from ..format.metadata import COMMIT_MARKER, CONTROL, CONTROL_DIR, CONTROL_LAYOUTS, ControlFiles
from . import lease, leftovers
from .retry import DEFAULT_POLICY, RetryPolicy, is_transient, retry_call

log = logging.getLogger("arraycheckpoint")

#: No request counts as stalled sooner (a tiny ``timeout=`` must not fail a healthy store's requests).
_MIN_STALL_SECONDS = 1.0
#: how many times :meth:`Storage.release` reads the lock it deletes (a refresh landing between read and delete)
_RELEASE_READS = 4
#: Object-store lock key, inside the checkpoint root (only present while a save runs or after a crash).
LOCK_KEY = ".acp-lock"
#: tensorstore's storage generation meaning "no value": a conditional write with it creates only if absent.
_NO_VALUE = b"\x02"
#: How many keys of a save's target a refusal names (the target check lists one more, in one bounded listing).
SHOWN_KEYS = 10
#: Keys only a checkpoint of ours holds (committed, or left by a crashed save): control files and the lock.
_OUR_KEYS = frozenset(
    {LOCK_KEY, *(f.metadata for f in CONTROL_LAYOUTS), *(f.committed for f in CONTROL_LAYOUTS)}
)


class Storage(ABC):
    """One storage backend, bound to one URL scheme."""

    #: "rename" or "marker"; see the module docstring.
    commit_strategy: str = "marker"
    #: Bounded retries of the small-object operations.
    retry_policy: RetryPolicy = DEFAULT_POLICY
    #: Seconds one small-object request may go unanswered, and after which an operation starts no new attempt
    #: (so one operation ends within about twice this); a save sets it from its ``timeout=``. None: the
    #: liveness default (``ACP_LIVENESS_TIMEOUT``, else 300 s).
    stall_timeout: float | None = None
    #: The ranks of the save that takes the next lock (a save sets it before :meth:`acquire`); its lock says
    #: so: only a one-rank save's lock is a crashed save's at once when its process is gone (others write under
    #: a wider save's lease until it runs out).
    save_world: int = 1
    #: ``(final, state)`` found by the last :meth:`check_target` (marker strategy), for :meth:`acquire`.
    _checked_target: tuple[str, str] | None = None
    #: The commit marker's write failed without an answer (it may land later); :meth:`abort` keeps the objects.
    _marker_in_doubt: bool = False
    #: The token of the save holding this backend's lock (:meth:`acquire`), checked again before the commit.
    _lease_token: str | None = None
    #: The target a claim (:meth:`acquire`) of this instance was refused (another save's, the user's
    #: objects): :meth:`abort` deletes nothing there (the other ranks' failure is reported through it).
    _refused: str | None = None
    #: The target whose clearing failed part way (:func:`.leftovers.clear_target`): its lock stays.
    _kept_lock: str | None = None

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

    def target_state(self, final: str) -> str:
        """What a save to ``final`` (marker strategy: written in place) finds there: ``"committed"`` (a
        committed checkpoint), ``"leftover"`` (our own crashed save: its lock or control files), or
        ``"empty"``. A few exact-key lookups and at most one bounded listing (:meth:`sample`).

        Raises:
            CheckpointExistsError: ``final`` holds objects that are none of these (the user's); the message
                names the path and the first keys found.
        """
        if self.is_committed(final):
            return "committed"
        if any(self.exists(final, key) for key in (LOCK_KEY, *(f.metadata for f in CONTROL_LAYOUTS))):
            return "leftover"
        keys = self.sample(final, SHOWN_KEYS + 1)
        if not keys:
            return "empty"
        if any(k in _OUR_KEYS or k.startswith(CONTROL_DIR + "/") for k in keys):
            return "leftover"
        shown = ", ".join(keys[:SHOWN_KEYS]) + (" and more" if len(keys) > SHOWN_KEYS else "")
        raise CheckpointExistsError(
            f"cannot save to {final}: objects that are not a checkpoint are stored there ({shown}); a save "
            "replaces only a committed checkpoint (with overwrite=True) and never deletes other objects: choose "
            "a new path (e.g. a sub-prefix) or move those objects away"
        )

    def check_target(self, final: str, overwrite: bool) -> None:
        """Refuse to save over a committed checkpoint unless ``overwrite``, and (marker strategy) over objects
        that are not a checkpoint of ours (see :meth:`target_state`)."""
        self._refused = final  # until acquire claims it (a refused target is never this save's to delete)
        if self.commit_strategy == "marker":
            state = self.target_state(final)
            self._checked_target = (final, state)  # acquire, next, need not look again
            committed = state == "committed"
        else:
            committed = self.is_committed(final)
        if committed and not overwrite:
            raise CheckpointExistsError(
                f"a committed checkpoint already exists at {final}; pass overwrite=True to replace it "
                "or save to a new path (CheckpointManager uses one directory per step)"
            )

    def acquire(self, final: str, token: str) -> None:
        """Claim ``final`` for one save; raise :class:`CheckpointExistsError` if another save holds it.

        Default (object stores, memory): a lock object ``<final>/.acp-lock`` created with a conditional
        write that succeeds only if the key is absent, then read back to confirm the token. Marker strategy
        writes in place, so what is already under ``final`` is removed next, its commit marker first (the old
        checkpoint never appears committed with mixed contents), but only a checkpoint of ours (committed and
        being overwritten, or left by a crashed save: :meth:`target_state`, checked before the lock is
        taken); objects of anyone else are refused, never deleted.
        """
        self._marker_in_doubt, self._kept_lock = False, None  # a new save: not an earlier one's state
        self._refused = final  # until this claim succeeds, nothing under final is this save's to delete
        at, mono = lease.stamp()  # when the lock document is made: the lease's age counts from there
        body = lease.body(token, at, self.save_world)
        checked, self._checked_target = getattr(self, "_checked_target", None), None
        if self.commit_strategy != "marker":
            state = "empty"
        else:
            state = checked[1] if checked is not None and checked[0] == final else self.target_state(final)

        self._retry("lock", f"{final}/{LOCK_KEY}", lambda: self._create_lock(final, body))
        # Decide by what is stored, not by the create call: a retried create whose first attempt landed
        # reports "exists" although the lock is ours.
        raw, generation = self._lock_state(final) if self._leases() else (self.read(final, LOCK_KEY), b"")
        if self._token_in(final, raw) != token:
            generation = self._take_stale_lock(final, token, body, raw, generation)
        self._lease_token = token
        if self._leases():
            lease.keep(self, final, token, generation, at, mono, self.save_world)
        if state != "committed" and self.is_committed(final):
            # another save committed here between the check and this claim (the target was empty, or held that
            # save's lock, which looked like a crashed save's): never write into it, nor delete it
            self.release(final, token)
            raise CheckpointExistsError(
                f"another save committed a checkpoint at {final} while this one was starting; save to a new "
                "path, or again with overwrite=True"
            )
        if state != "empty":
            leftovers.clear_target(self, final, token, state)  # never other objects; the markers first
        self._refused = None

    def _leases(self) -> bool:
        """Whether this backend's lock is a lease (:mod:`.lease`): its lock object is created, refreshed and
        taken over by conditional writes (tensorstore's key-value stores: S3, memory). A backend with its own
        lock creation (fsspec: check-then-write) has no lease."""
        return type(self)._create_lock is Storage._create_lock

    def _lock_state(self, final: str, retry: bool = True) -> tuple[bytes | None, bytes]:
        """The lock object's bytes (None when absent) and its storage generation (one attempt unless
        ``retry``: the lease thread must not wait out one store's retries)."""

        def op() -> tuple[bytes | None, bytes]:
            result = self._wait(self._kv(final).read(LOCK_KEY))
            value = bytes(result.value) if result.state == "value" else None
            return value, bytes(result.stamp.generation)

        return self._retry("lock", f"{final}/{LOCK_KEY}", op) if retry else op()

    def _refresh_lock(self, final: str, body: bytes, generation: bytes) -> bytes:
        """Replace the lock object with ``body`` only if it is still ``generation``: the new generation, or
        b"" when it is not (another save took it over)."""
        stamp = self._wait(self._kv(final).write(LOCK_KEY, body, if_equal=generation))
        return bytes(stamp.generation)

    def _take_stale_lock(
        self, final: str, token: str, body: bytes, raw: bytes | None, generation: bytes
    ) -> bytes:
        """Take over the lock of ``final`` (``raw`` as stored, at ``generation``) when it is a crashed save's
        lease (not refreshed for its lease; one conditional write: of several takers one wins), with a warning
        naming it and its holder; the lock's new generation.

        Raises:
            CheckpointExistsError: a live save holds it (or this backend has no lease), naming the target and
                the holder.
        """
        doc = lease.parse(raw)
        why = lease.stale_reason(doc) if self._leases() else None
        who = lease.describe(doc, raw)
        if why is not None and raw is not None:
            new = self._refresh_lock(final, body, generation)
            if new and self._lock_token(final) == token:
                log.warning(
                    "taking over %s/%s, left by a save that is no longer running (%s: %s)",
                    final,
                    LOCK_KEY,
                    who,
                    why,
                )
                return new
            who = "another save taking over a crashed one's lock"
        elif not self._leases() and raw is not None:
            gone = lease.holder_gone(doc)
            if gone is not None and self._replace_dead_lock(final, token, body, raw):
                log.warning("taking over %s/%s, left by a save that is no longer running (%s: %s)",
                            final, LOCK_KEY, who, gone)  # fmt: skip
                return b""
        bound = lease.lease_intervals() * lease.heartbeat_seconds()
        raise CheckpointExistsError(
            f"another save to {final} is in progress (lock {final}/{LOCK_KEY} held by {who}); wait for it, or "
            "point each job at its own root. "
            + (
                f"A crashed save's lock is taken over once it was not refreshed for its lease ({bound:.0f} s)"
                if self._leases()
                else "If no save is running, a crashed run left the lock (one on another host, or a save of "
                "several ranks, is never taken over here: its other ranks may still write): remove the object "
                f"{final}/{LOCK_KEY} (from Python: arraycheckpoint.storage.storage_for(path), then "
                f"storage.delete_key(root, {LOCK_KEY!r})), or let CheckpointManager clean up on start"
            )
        )

    def _replace_dead_lock(self, final: str, token: str, body: bytes, raw: bytes) -> bool:
        """Replace the lock ``raw`` of a save whose process is gone (a backend without leases) with this save's
        ``body``: deleted only while it is still ``raw``, then created as :meth:`acquire` creates it (of
        several takers, one wins where the store creates exclusively); whether this save holds it now."""
        if self.read(final, LOCK_KEY) != raw:
            return False
        self.delete_key(final, LOCK_KEY)
        self._retry("lock", f"{final}/{LOCK_KEY}", lambda: self._create_lock(final, body))
        return self._lock_token(final) == token

    def _create_lock(self, final: str, body: bytes) -> bool:
        """Create ``<final>/.acp-lock`` only if it is absent; True if this call created it."""
        stamp = self._wait(self._kv(final).write(LOCK_KEY, body, if_equal=_NO_VALUE))
        return bool(stamp.generation)

    def _lock_token(self, final: str) -> str | None:
        return self._token_in(final, self.read(final, LOCK_KEY))

    def _token_in(self, final: str, raw: bytes | None) -> str | None:
        """The save token the lock object ``raw`` names (None when absent)."""
        if raw is None:
            return None
        from ..checks.bounds import load_json_bounded

        try:
            return str(load_json_bounded(raw, max_bytes=1 << 16, what=f"{final}/{LOCK_KEY}")["token"])
        except (ValueError, KeyError, TypeError):  # MetadataError is a ValueError
            return raw.decode(errors="replace")

    def release(self, final: str, token: str) -> None:
        """Drop the claim taken by :meth:`acquire` (idempotent; a lock held by another token stays). Under a
        lease the delete is conditional on the lock's generation read with its token: a release delayed past
        the lease (its host frozen) never deletes the lock of a save that took the target over meanwhile."""
        lease.drop(self, final, token)
        self._lease_token = None
        if self._kept_lock == final:
            return
        if not self._leases():
            if self._lock_token(final) == token:
                self.delete_key(final, LOCK_KEY)
            return
        for _attempt in range(_RELEASE_READS):
            raw, generation = self._lock_state(final)
            if raw is None or self._token_in(final, raw) != token:
                return
            if self._retry(
                "lock", f"{final}/{LOCK_KEY}", lambda g=generation: self._delete_lock_if(final, g)
            ):
                return
            # refused: another generation is stored now. A refresh of ours that landed after the read (it was
            # on its way) stored it, while the lock still names this save: read it again and delete that one
        log.warning(
            "could not release %s/%s: it kept changing while named by save %s", final, LOCK_KEY, token
        )

    def stalled(self) -> str | None:
        """A request of this save that timed out but may still land (named), or None: the coordinator then
        keeps the save's lock (:mod:`.stalls`). None here: tensorstore's requests are not left running."""
        return None

    def open_flush(self, root: str) -> None:
        """Called on every rank before its first write under ``root``: a backend whose :meth:`flush` can only
        report errors that happened after some point (Linux ``syncfs(2)`` reports a write-back error only to a
        descriptor opened before it) takes that point now. Paired with :meth:`close_flush`. No-op here."""
        return None

    def close_flush(self, root: str) -> None:
        """Release what :meth:`open_flush` took for ``root`` (idempotent; called on every path once the save
        ended, after the coordinator's last :meth:`flush`); here: stop following its lock (:meth:`follow_lease`)."""
        lease.unfollow(self, root)

    def lease_grant(self, final: str) -> tuple[int, int, int]:
        """What the coordinator tells the other ranks of its lease of ``final`` (:func:`.lease.grant`)."""
        return lease.grant(self, final, self._lease_token) if self._leases() else lease.NO_GRANT

    def follow_lease(
        self, staging: str, final: str, token: str, grant: Any = None, rank: int = 1, world: int = 2
    ) -> None:
        """On a rank (``rank`` of ``world``) that did not take the lock: when it writes in place under a
        lease, :meth:`check_lease` stops it once the lease may be taken over, reading the lock about once a
        lease period from the time the coordinator's ``grant`` (:meth:`lease_grant`) says (:mod:`.lease`)."""
        if staging == final and self._lease_token is None and self._leases():
            lease.follow(self, final, token, grant, rank, world)

    def flush(self, root: str) -> None:
        """Make this rank's writes under ``root`` durable (one batched flush; a no-op where writes are)."""
        return None

    def check_lease(self, final: str) -> None:
        """Raise if this save's lease of ``final`` was found taken over, or is old enough that it may be soon
        (:func:`.lease.check_holder`, :class:`.lease.Follower`): the writers call it before each write batch
        (no I/O but a follower's rare read), so a save stops writing before another save can own the target."""
        lease.check_follower(self, final)
        if self._lease_token is not None:
            lease.check_holder(self, final, self._lease_token)

    def verify_lease(self, final: str) -> None:
        """Raise unless the lock of ``final`` still names this save (one read): the coordinator calls it
        before it writes the metadata, and :meth:`commit` before the marker (a save whose lease ran out, and
        was taken over, writes neither)."""
        token = self._lease_token
        if token is None or not self._leases():
            return
        self.check_lease(final)
        holder = self._lock_token(final)
        if holder != token:
            raise StorageError(
                f"storage commit of {final} refused: this save's lock {final}/{LOCK_KEY} is held by save "
                f"{holder} now (it was taken over: this save did not refresh it for its lease)"
            )
        self.check_lease(final)  # again: a slow read may have answered from before the lease ran out

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

    def _delete_lock_if(self, final: str, generation: bytes) -> bool:
        """Delete the lock object of ``final`` only if it is still ``generation``; whether it was."""
        stamp = self._wait(self._kv(final).write(LOCK_KEY, None, if_equal=generation))
        return bool(stamp.generation)  # b"" when it was not (another generation now)


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
    if key in _CONTROL_KEYS or key.startswith(CONTROL_DIR + "/"):
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
