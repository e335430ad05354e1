"""Claiming a save's target: the lock (or lease) one save holds on its checkpoint path, and the check of
what the path holds first. The half of :class:`~arraycheckpoint.storage.base.Storage` that decides who may
write to a target and until when; the other half (keys, staging, commit) stays in :mod:`.base`.

Object stores and memory: a lock object ``<final>/.acp-lock`` created with a conditional write (only if
absent), refreshed as a lease by rank 0 (:mod:`.lease`), followed by the other ranks, taken over once stale, and
deleted at its own generation on release. File systems override :meth:`TargetClaims.acquire` and
:meth:`TargetClaims.release` with their own locks (:mod:`.locks`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from ..errors import CheckpointExistsError, StorageError
from ..format.metadata import CONTROL_DIR, CONTROL_LAYOUTS
from . import lease, leftovers

log = logging.getLogger("arraycheckpoint")

#: how many times :meth:`Storage.release` reads the lock it deletes (a refresh landing between read and delete)
_RELEASE_READS = 4
#: Object-store lock key, inside the checkpoint root (only present while a save runs or after a crash).
LOCK_KEY = ".acp-lock"
#: tensorstore's storage generation meaning "no value": a conditional write with it creates only if absent.
_NO_VALUE = b"\x02"
#: How many keys of a save's target a refusal names (the target check lists one more, in one bounded listing).
SHOWN_KEYS = 10
#: The sentinel a taker of a crashed save's lock holds (stores without leases), and the prefix of the next
#: ones made when one is left stale (:meth:`TargetClaims._take_sentinel`).
TAKEOVER_KEY = LOCK_KEY + ".takeover"
#: How many stale sentinels a takeover passes before it gives up (each was left by a taker that crashed).
_TAKEOVER_LINKS = 4
#: Keys only a checkpoint of ours holds (committed, or left by a crashed save): control files and the lock.
_OUR_KEYS = frozenset(
    {LOCK_KEY, *(f.metadata for f in CONTROL_LAYOUTS), *(f.committed for f in CONTROL_LAYOUTS)}
)


class TargetClaims:
    """Who may write to a save's target, and until when (see the module docstring)."""

    #: The ranks of the save that takes the next lock (a save sets it before :meth:`acquire`); its lock says
    #: so: only a one-rank save's lock is a crashed save's at once when its process is gone (others write under
    #: a wider save's lease until it runs out).
    save_world: int = 1
    #: ``(final, state)`` found by the last :meth:`check_target` (marker strategy), for :meth:`acquire`.
    _checked_target: tuple[str, str] | None = None
    #: The token of the save holding this backend's lock (:meth:`acquire`), checked again before the commit.
    _lease_token: str | None = None
    #: The target a claim (:meth:`acquire`) of this instance was refused (another save's, the user's
    #: objects): :meth:`abort` deletes nothing there (the other ranks' failure is reported through it).
    _refused: str | None = None
    #: The target whose clearing failed part way (:func:`.leftovers.clear_target`): its lock stays.
    _kept_lock: str | None = None

    if TYPE_CHECKING:
        commit_strategy: str
        _marker_in_doubt: bool

        def _kv(self, root: str) -> Any: ...
        def _retry(self, operation: str, path: str, fn: Any) -> Any: ...
        def _wait(self, future: Any) -> Any: ...
        def read(self, root: str, key: str, limit: int | None = None) -> bytes | None: ...
        def exists(self, root: str, key: str) -> bool: ...
        def delete_key(self, root: str, key: str, guard: Callable[[], None] | None = None) -> None: ...
        def is_committed(self, root: str) -> bool: ...
        def sample(self, root: str, limit: int) -> list[str]: ...

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
        if any(k in _OUR_KEYS or k.startswith((CONTROL_DIR + "/", TAKEOVER_KEY)) for k in keys):
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
        return type(self)._create_lock is TargetClaims._create_lock

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
        ``body``, holding a takeover sentinel meanwhile (:meth:`_take_sentinel`: of several takers one holds
        it, where the store creates exclusively): the lock is read again under it and deleted only while it is
        still ``raw``, so a taker that judged it dead before another took it over never deletes that one's
        live lock; whether this save holds it now."""
        held = self._take_sentinel(final, token)
        if not held:
            return False
        try:
            if self.read(final, LOCK_KEY) != raw:
                return False
            self.delete_key(final, LOCK_KEY)
            self._retry("lock", f"{final}/{LOCK_KEY}", lambda: self._create_lock(final, body))
            return self._lock_token(final) == token
        finally:
            for key in reversed(held):
                try:
                    self.delete_key(final, key)
                except StorageError as e:  # kept: ours (target_state knows it), the next taker passes it
                    log.warning("could not remove the takeover sentinel %s/%s: %s", final, key, e)

    def _take_sentinel(self, final: str, token: str) -> list[str]:
        """Create the takeover sentinel of ``final``'s lock for the save ``token``; the keys to remove once the
        takeover is done (the sentinel, and the stale ones passed on the way), or [] when another taker holds
        it. A stale sentinel (its taker's process gone, or older than a lease: :func:`.leftovers.crashed`) is
        not deleted (two takers judging it at once would each delete the other's): the next one's name is made
        from its contents, so every taker that judged the same one races for the same exclusive create."""
        key, passed = TAKEOVER_KEY, []
        for _link in range(_TAKEOVER_LINKS):
            mine = lease.body(token)
            if self._retry("lock", f"{final}/{key}", lambda k=key, b=mine: self._create_key(final, k, b)):
                return [*passed, key]
            seen = self.read(final, key)
            if seen is None:
                continue  # removed meanwhile (its takeover is done): create it again
            if leftovers.crashed(seen) is None:
                return []  # another taker is at it
            passed.append(key)
            key = f"{TAKEOVER_KEY}-{hashlib.sha256(seen).hexdigest()[:16]}"
        stale = ", ".join(f"{final}/{k}" for k in passed)
        raise CheckpointExistsError(
            f"cannot take over the lock of {final}: its holder is gone, but {len(passed)} takers of it crashed "
            f"in turn and left their takeover sentinels ({stale}); no live save holds them. Delete them and "
            f"{final}/{LOCK_KEY} (storage, root = arraycheckpoint.storage.storage_for(path); "
            "storage.delete_key(root, key) for each), then save again"
        )

    def _create_lock(self, final: str, body: bytes) -> bool:
        """Create ``<final>/.acp-lock`` only if it is absent; True if this call created it."""
        return self._create_key(final, LOCK_KEY, body)

    def _create_key(self, final: str, key: str, body: bytes) -> bool:
        """Create ``<final>/<key>`` only if it is absent; True if this call created it."""
        stamp = self._wait(self._kv(final).write(key, body, if_equal=_NO_VALUE))
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

    def _delete_lock_if(self, final: str, generation: bytes) -> bool:
        """Delete the lock object of ``final`` only if it is still ``generation``; whether it was."""
        stamp = self._wait(self._kv(final).write(LOCK_KEY, None, if_equal=generation))
        return bool(stamp.generation)  # b"" when it was not (another generation now)
