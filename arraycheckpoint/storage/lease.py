"""Leases on object stores: the lock object ``<target>/.acp-lock`` of a save in flight is refreshed by its
holder, so that a crashed save's lock (not refreshed for ``ARRAYCHECKPOINT_LOCK_LEASE_INTERVALS`` times
``ARRAYCHECKPOINT_LOCK_HEARTBEAT_SECONDS``, 60 s by default: the intervals of :mod:`.locks`) can be told from
a live one and taken over.

The lock object is a JSON document (:func:`body`): the save's token, the holder's host and pid, its heartbeat
interval and the time of its last refresh (the holder's clock). Creating it is a conditional write (S3:
``If-None-Match: *``), and so are the refreshes and a takeover (``If-Match`` the generation read): of two
writers racing for one lock object exactly one succeeds. The document is untrusted input (bounded, every
field type-checked); one that cannot be read as one counts as refreshed never (its age is unknown: it is not
taken over).

A refresh refused (412) or unanswered is not proof of a takeover (a conditional write that landed but whose
answer was lost, retried, is refused): the lock is read, and while it names the holder its generation is
adopted. Only a lock naming another save, or none, marks the lease lost (:func:`lost`): the save's writers
stop, its coordinator writes neither metadata nor marker, and its abort deletes nothing (docs/storage.md).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

from .locks import heartbeat_seconds, lease_intervals

log = logging.getLogger("arraycheckpoint")

#: the most of a lock object that is parsed
MAX_BODY_BYTES = 1 << 16


def body(token: str) -> bytes:
    """The lock object of the save ``token``, as refreshed now."""
    doc = {
        "token": token,
        "time": time.time(),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "heartbeat": heartbeat_seconds(),
    }
    return json.dumps(doc).encode()


def parse(raw: bytes | None) -> dict[str, Any] | None:
    """The lock document ``raw`` holds, or None when it is not one (every field checked)."""
    if raw is None or len(raw) > MAX_BODY_BYTES:
        return None
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or not isinstance(doc.get("token"), str):
        return None
    for key in ("time", "heartbeat"):
        value = doc.get(key)
        if type(value) not in (int, float) or not 0 <= value < float("inf"):
            doc[key] = None
    for key in ("host", "pid"):
        if not isinstance(doc.get(key), (str, int)) or len(str(doc[key])) > 256:
            doc[key] = "?"
    return doc


def describe(doc: dict[str, Any] | None, raw: bytes | None) -> str:
    """The holder, for messages."""
    if doc is None:
        return "save " + (raw or b"?")[:200].decode(errors="replace")
    return f"save {doc['token'][:200]} pid {doc.get('pid', '?')} on {doc.get('host', '?')}"


def stale_reason(doc: dict[str, Any] | None, now: float | None = None) -> str | None:
    """Why the lock ``doc`` is a crashed save's (not refreshed for its lease), or None."""
    if doc is None or doc.get("time") is None:
        return None
    interval = max(heartbeat_seconds(), min(float(doc.get("heartbeat") or 0.0), 3600.0))
    bound = lease_intervals() * interval
    age = (time.time() if now is None else now) - float(doc["time"])
    if age > bound:
        return f"not refreshed for {age:.0f} s, its lease is {bound:.0f} s"
    return None


# The holders' refreshes: one thread per process while it holds a lease ---------------------------------------
_held: dict[tuple[int, str, str], tuple[weakref.ref[Any], bytes]] = {}
_guard = threading.Lock()
_thread: threading.Thread | None = None
_wake = threading.Event()
_sleeping = [0.0]  # the interval the thread sleeps for now
#: the leases found taken over (held by another token, or gone) while their save ran: its writers stop
_lost: set[tuple[int, str, str]] = set()


def keep(storage: Any, final: str, token: str, generation: bytes) -> None:
    """Refresh ``storage``'s lock of ``final`` (held by ``token``, stored as ``generation``) until
    :func:`drop`: a conditional write each heartbeat interval, which fails once another save took it over."""
    global _thread
    with _guard:
        _held[(id(storage), final, token)] = (weakref.ref(storage), generation)
        _lost.discard((id(storage), final, token))
        if heartbeat_seconds() < _sleeping[0]:  # the thread sleeps for longer than the interval now is
            _wake.set()
        if _thread is None:
            _thread = threading.Thread(target=_refresh_all, name="acp-lease-heartbeat", daemon=True)
            _thread.start()


def drop(storage: Any, final: str, token: str) -> None:
    """Stop refreshing the lock (the save ended); forget that it was lost."""
    with _guard:
        _held.pop((id(storage), final, token), None)
        _lost.discard((id(storage), final, token))


def lost(storage: Any, final: str, token: str) -> bool:
    """Whether the lease of the save ``token`` to ``final`` was found taken over by another save (or its lock
    gone) while the save ran: no I/O, for the writers to check before each write batch."""
    with _guard:
        return (id(storage), final, token) in _lost


def _refresh_all() -> None:
    global _thread
    while True:
        _sleeping[0] = heartbeat_seconds()
        _wake.wait(_sleeping[0])  # or woken by a holder whose interval is shorter
        _wake.clear()
        with _guard:
            if not _held:
                _thread = None
                return
            held = list(_held.items())
        for key, (ref, generation) in held:
            storage, (_id, final, token) = ref(), key
            if storage is None:
                drop_key(key)
                continue
            try:
                new = storage._refresh_lock(final, body(token), generation)
            except Exception as e:  # noqa: BLE001 - its answer was lost: what is stored decides (below)
                log.debug("could not refresh the lock of %s: %s", final, e)
                new = b""
            holder, raw = None, None
            if not new:
                # A refused refresh (412) or one without an answer is not proof of a takeover: a conditional
                # PUT that landed but whose answer was lost, retried, is refused too. The lock as stored decides.
                try:
                    raw, stored = storage._lock_state(final, retry=False)
                except Exception as e:  # noqa: BLE001 - the store does not answer: tried again next interval
                    log.debug("could not read the lock of %s: %s", final, e)
                    continue
                doc = parse(raw)
                holder = None if doc is None else doc["token"]
                if holder == token:
                    new = stored  # still ours (the refresh landed, or never did): its generation is adopted
            with _guard:
                if key not in _held:
                    continue
                if new:
                    _held[key] = (ref, new)
                    continue
                _held.pop(key, None)
                _lost.add(key)
            log.warning(
                "the lock %s/.acp-lock of save %s was taken over by another save (it names %s now: this process "
                "did not refresh it for its lease); this save stops writing and will not commit",
                final, token, holder or ("no save, it was removed" if raw is None else "no save: it was overwritten"),
            )  # fmt: skip


def drop_key(key: tuple[int, str, str]) -> None:
    with _guard:
        _held.pop(key, None)
        _lost.discard(key)


# Ranks other than the coordinator ---------------------------------------------------------------------------
# They write in place under a lock rank 0 took, and hold no lease of their own: each reads the lock itself
# before its first write and then at most once a heartbeat interval, so a save whose lock was taken over stops
# writing on every rank, not only on rank 0.
_followed: dict[tuple[int, str], tuple[str, float]] = {}  # (id(storage), final) -> (token, last read)


def follow(storage: Any, final: str, token: str) -> None:
    """Make :func:`check_follower` read the lock of ``final`` for ``token`` (on this rank's ``storage``)."""
    with _guard:
        _followed[(id(storage), final)] = (token, -float("inf"))


def unfollow(storage: Any, final: str) -> None:
    with _guard:
        _followed.pop((id(storage), final), None)


def check_follower(storage: Any, final: str) -> None:
    """Raise when a read of the lock of ``final`` (due at most once a heartbeat interval) names another save
    than the one this rank writes for; an unanswered read decides nothing (rank 0's lease does)."""
    from ..errors import StorageError

    key = (id(storage), final)
    now = time.monotonic()
    with _guard:
        entry = _followed.get(key)
        if entry is None or now - entry[1] < heartbeat_seconds():
            return
        _followed[key] = (entry[0], now)
    token = entry[0]
    try:
        holder = storage._lock_token(final)
    except Exception as e:  # noqa: BLE001 - read again next interval
        log.debug("could not read the lock of %s: %s", final, e)
        return
    if holder != token:
        raise StorageError(
            f"save {token} to {final} stopped: its lock {final}/.acp-lock names {holder or 'no save'} now (it was "
            "taken over by another save); this rank writes nothing more there"
        )
