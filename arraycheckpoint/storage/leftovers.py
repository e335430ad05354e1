"""What a manager's start-up cleanup removes on stores that write in place (the marker strategy), and what it
keeps: a save in flight of another job on the same root.

A lock object whose lease is live (:func:`.lease.stale_reason` finds it not stale: refreshed within its
lease) is a save in flight: it stays, and so does that save's step, objects and all. A lock that
is no lock document, or whose lease ran out, is a crashed save's: it is removed with a conditional delete
(``If-Match`` the generation judged), so a save that took it over meanwhile keeps it. An uncommitted step is
removed under a lock of the cleanup's own (created only if absent, or taken over from a crashed save), so a
save starting there meanwhile is refused rather than emptied; it is kept when a live save holds it, or when
a save committed it meanwhile (looked at again once the cleanup holds the lock). That lock is a lease like a
save's, refreshed while the cleanup deletes, and each delete waits on it being neither lost nor near its
end, so a save taking a stalled cleanup's lock over loses nothing. Stores
without leases (fsspec: check-then-write locks) cannot tell a live save from a crashed one: there every lock
and uncommitted step goes, as before (docs/storage.md: run one job per root there).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from ..errors import CheckpointExistsError, StorageError
from . import lease

log = logging.getLogger("arraycheckpoint")

LOCK_KEY = ".acp-lock"


def crashed(raw: bytes | None) -> str | None:
    """Why the lock object ``raw`` is a crashed save's (none, no lock document, or its lease ran out), or
    None when a save in flight may hold it."""
    if raw is None:
        return "it is gone"
    doc = lease.parse(raw)
    if doc is None or doc.get("time") is None:  # every lease of ours says when it was refreshed
        return "it is no lock document"
    return lease.stale_reason(doc)


def clear_locks(storage: Any, parent: str) -> list[str]:
    """Remove the crashed saves' lock objects of the children of ``parent`` (module docstring); what was
    removed."""
    removed = []
    for name in storage.children(parent):
        child = storage.join(parent, name)
        if not storage.exists(child, LOCK_KEY):
            continue
        try:
            if storage._leases():
                raw, generation = storage._lock_state(child)
                why = crashed(raw)
                if why is None:
                    log.info("cleanup: kept %s/%s: a save in flight holds it (%s)", child, LOCK_KEY,
                             lease.describe(lease.parse(raw), raw))  # fmt: skip
                    continue
                if raw is None or not storage._delete_lock_if(child, generation):
                    continue  # gone, or taken over meanwhile: not ours to remove
            else:
                storage.delete_key(child, LOCK_KEY)
        except StorageError as e:  # read-only credentials: kept, as a local leftover is
            log.warning("cleanup: could not remove %s/%s (%s); it is kept", child, LOCK_KEY, e)
            continue
        removed.append(f"{child}/{LOCK_KEY}")
    return removed


def remove_uncommitted(storage: Any, root: str) -> bool:
    """Delete the uncommitted checkpoint at ``root`` unless a save in flight holds it, or committed it since the
    caller looked; whether it was deleted.

    The cleanup's lock is a lease like a save's (refreshed by this process's heartbeat): each delete is made
    only while it is neither lost nor old enough to be taken over (:func:`.lease.check_holder`), so a save
    taking a stalled cleanup's lock over never has its objects deleted; a cleanup that stops so raises
    :class:`StorageError` (the step is kept, the next cleanup removes the rest)."""
    if storage.commit_strategy != "marker" or not storage._leases():
        storage.delete(root)
        return True
    token = f"cleanup-{uuid.uuid4().hex[:12]}"
    at, mono = lease.stamp()
    body = lease.body(token, at)
    if not storage._retry("lock", f"{root}/{LOCK_KEY}", lambda: storage._create_lock(root, body)):
        raw, generation = storage._lock_state(root)
        doc = lease.parse(raw)
        if doc is not None and doc["token"] == token:  # its create landed, its answer was lost: it holds it
            pass
        elif raw is None or crashed(raw) is None:  # a save in flight (or one just ending): not a leftover
            return False
        elif not storage._refresh_lock(root, body, generation):  # another taker came first
            return False
    raw, generation = storage._lock_state(root)
    doc = lease.parse(raw)
    if doc is None or doc["token"] != token:  # taken over meanwhile
        return False
    lease.keep(storage, root, token, generation, at, mono)
    try:
        # a save committed there (and released its lock) since the caller looked
        if storage.is_committed(root):
            log.info("cleanup: kept %s: a save committed it meanwhile", root)
            return False
        for key in storage.list(root):
            if key != LOCK_KEY:
                lease.check_holder(storage, root, token)  # no I/O
                storage.delete_key(root, key, lambda: lease.check_holder(storage, root, token))
    finally:
        lease.drop(storage, root, token)
        raw, generation = storage._lock_state(root)
        if raw is not None and storage._token_in(root, raw) == token:
            storage._delete_lock_if(root, generation)  # never a lock a save took over meanwhile
    return True


def clear_target(storage: Any, final: str, token: str, state: str) -> None:
    """Empty ``final`` for the save ``token``, which holds its lock: writing in place starts from an empty
    prefix, so nothing of an older checkpoint (``state`` "committed", being overwritten, or "leftover" of a
    crashed save) mixes with this one. A committed checkpoint is replaced whole, as a rename replaces a
    directory (overwrite=True); of leftovers, only keys a save of ours writes are removed: one control file (or
    a stale lock) beside the user's objects does not make them ours (every key is looked at before any goes).
    The commit markers go first, so a partial clearing never reads as committed.

    A clearing that fails part way (the store refuses a delete) leaves part of the old checkpoint, uncommitted,
    and keeps the lock, no longer refreshed (the save's release leaves it): the save's abort deletes nothing
    there, and after one lease the next save to ``final`` takes the lock over as a crashed save's and clears
    what remains (every key there was judged a save's), as a manager's start-up cleanup does. Releasing it
    instead would leave remains that need not hold a control file, which the next save refuses as not a
    checkpoint.

    Raises:
        CheckpointExistsError: objects a save never writes are there (nothing deleted; the lock released).
    """
    from .base import SHOWN_KEYS, is_checkpoint_key

    keys = [key for key in storage.list(final) if key != LOCK_KEY]
    foreign = [] if state == "committed" else [key for key in keys if not is_checkpoint_key(key)]
    if foreign:
        storage.release(final, token)
        shown = ", ".join(foreign[:SHOWN_KEYS]) + (" and more" if len(foreign) > SHOWN_KEYS else "")
        raise CheckpointExistsError(
            f"cannot save to {final}: besides a checkpoint's files, objects a save never writes are stored "
            f"there ({shown}); a save never deletes other objects: choose a new path (e.g. a sub-prefix) or "
            "move those objects away"
        )
    try:
        lease.check_holder(storage, final, token)
        storage._delete_markers(final)
        for key in keys:
            lease.check_holder(storage, final, token)  # no I/O: a lease lost or run out (a host frozen) stops
            storage.delete_key(final, key, lambda: lease.check_holder(storage, final, token))
    except BaseException as e:
        storage._kept_lock = final
        lease.drop(storage, final, token)
        log.warning(
            "save %s could not clear %s of the old checkpoint's objects (%s): what remains is uncommitted; its "
            "lock %s/%s is kept, and the next save there takes it over once its lease ran out and clears them "
            "(so does a manager's start-up cleanup)", token, final, e, final, LOCK_KEY,
        )  # fmt: skip
        raise
