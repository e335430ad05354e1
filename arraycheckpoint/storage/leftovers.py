"""What a manager's start-up cleanup removes on stores that write in place (the marker strategy), and what it
keeps: a save in flight of another job on the same root.

A lock object whose lease is live (:func:`.lease.stale_reason` finds it not stale: refreshed within its
lease) is a save in flight: it stays, and so does that save's step, objects and all. A lock that
is no lock document, or whose lease ran out, is a crashed save's: it is removed with a conditional delete
(``If-Match`` the generation judged), so a save that took it over meanwhile keeps it. An uncommitted step is
removed under a lock of the cleanup's own (created only if absent, or taken over from a crashed save), so a
save starting there meanwhile is refused rather than emptied; it is kept when a live save holds it. Stores
without leases (fsspec: check-then-write locks) cannot tell a live save from a crashed one: there every lock
and uncommitted step goes, as before (docs/storage.md: run one job per root there).
"""

from __future__ import annotations

import logging
import uuid
from typing import Any

from ..errors import StorageError
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
    """Delete the uncommitted checkpoint at ``root`` unless a save in flight holds it; whether it was."""
    if storage.commit_strategy != "marker" or not storage._leases():
        storage.delete(root)
        return True
    token = f"cleanup-{uuid.uuid4().hex[:12]}"
    body = lease.body(token)
    if not storage._retry("lock", f"{root}/{LOCK_KEY}", lambda: storage._create_lock(root, body)):
        raw, generation = storage._lock_state(root)
        if raw is None or crashed(raw) is None:  # a save in flight (or one just ending): not a leftover
            return False
        if not storage._refresh_lock(root, body, generation):  # another taker came first
            return False
    try:
        for key in storage.list(root):
            if key != LOCK_KEY:
                storage.delete_key(root, key)
    finally:
        if storage._lock_token(root) == token:
            storage.delete_key(root, LOCK_KEY)
    return True
