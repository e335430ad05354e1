"""Leases on object stores: the lock object ``<target>/.acp-lock`` of a save in flight is refreshed by its
holder, so that a crashed save's lock (not refreshed for ``ARRAYCHECKPOINT_LOCK_LEASE_INTERVALS`` times
``ARRAYCHECKPOINT_LOCK_HEARTBEAT_SECONDS``, 60 s by default: the intervals of :mod:`.locks`) can be told from
a live one and taken over.

The lock object is a JSON document (:func:`body`): the save's token, the holder's host and pid, its heartbeat
interval, its lease, the time of its last refresh (the holder's clock) and the save's number of ranks (only a
one-rank save's lock is a crashed save's as soon as its process, on the reader's machine, is gone: a wider
save's other ranks write under the lease they were granted until it runs out). A lock dated more than its
lease in the future is a crashed save's too (no refresh dates it so: a wrong clock did). Creating it is a conditional write
(S3: ``If-None-Match: *``), and so are the refreshes and a takeover (``If-Match`` the generation read): of two
writers racing for one lock object exactly one succeeds. The document is untrusted input (bounded, every
field type-checked); one that cannot be read as one counts as refreshed never (its age is unknown: it is not
taken over).

A refresh refused (412) or unanswered is not proof of a takeover (a conditional write that landed but whose
answer was lost, retried, is refused): the lock is read, and while it names the holder its generation is
adopted. Only a lock naming another save, or none, marks the lease lost (:func:`lost`): the save's writers
stop, its coordinator writes neither metadata nor marker, and its abort deletes nothing (docs/storage.md).

A lease expires by itself, as Chubby's do: no save takes it over before it is ``bound`` old (:class:`Terms`),
so a save writes under it only while the last refresh it knows of is younger than its safe part
(:attr:`Terms.safe`, all but the last heartbeat interval). The holder measures that with its monotonic clock
from the last refresh the store took (:func:`check_holder`); the other ranks of its save, which write in place
under its lock and hold no lease of their own, learn the lease's time from rank 0 in the agreement they wait
for before writing (:func:`grant`), so none reads the lock before its first write; each then reads it about
once a :attr:`Terms.period` (30 s by default), at a phase its rank sets, so that N ranks read N / period times
a second, evenly (:class:`Follower`).
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import StorageError
from .heartbeat import Heartbeat
from .locks import _MAX_HEARTBEAT, HIDDEN, heartbeat_seconds, lease_intervals, process_start, this_owner

log = logging.getLogger("arraycheckpoint")

#: the most of a lock object that is parsed
MAX_BODY_BYTES = 1 << 16
#: a holder's lease is believed up to this (a document claiming a year would keep its lock a year)
_MAX_LEASE = 6 * _MAX_HEARTBEAT


@dataclass(frozen=True)
class Terms:
    """A lease's timing: its holder refreshes it every ``heartbeat`` seconds; another save may take it over
    once it was not refreshed for ``bound`` seconds."""

    heartbeat: float
    bound: float

    @property
    def safe(self) -> float:
        """How old the lease may be while its save still writes under it: all but its last heartbeat
        interval (50 s of 60 s by default; its last quarter when it is shorter than four intervals), which
        what is in flight then has to land before any takeover."""
        return self.bound - min(self.heartbeat, self.bound / 4)

    @property
    def period(self) -> float:
        """How often a rank writing under rank 0's lease reads it: the safe part less two heartbeat intervals
        (30 s by default), so that a read of a lease refreshed on time trusts it past the next read; a quarter
        of the safe part at least."""
        return max(self.safe - 2 * self.heartbeat, self.safe / 4)


def own_terms() -> Terms:
    """The terms of a lease this process takes now (its environment's)."""
    beat = heartbeat_seconds()
    return Terms(beat, lease_intervals() * beat)


def body(token: str, at: float | None = None, world: int = 1) -> bytes:
    """The lock object of the save ``token`` of ``world`` ranks, as refreshed at ``at`` (wall clock; now by
    default)."""
    terms, me = own_terms(), this_owner(token)
    doc = {
        "token": token,
        "time": time.time() if at is None else at,
        "world": world,  # its other ranks write under this lease: only a one-rank save's ends with its process
        "host": me.host,
        "pid": me.pid,
        "heartbeat": terms.heartbeat,
        "lease": terms.bound,
        "boot_id": me.boot_id,  # with the pid namespace and start time: a holder on the reader's machine
        "pidns": me.pidns,  # whose process is gone is a crashed save's at once
        "start": me.start,
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
    for key in ("time", "heartbeat", "lease"):
        doc[key] = finite(doc.get(key))
    if not (type(doc.get("world")) is int and 0 < doc["world"] < 1 << 31):
        doc["world"] = None  # unknown: ranks elsewhere may write under it
    for key in ("host", "pid"):
        if not isinstance(doc.get(key), (str, int)) or len(str(doc[key])) > 256:
            doc[key] = "?"
    return doc


def finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite non-negative JSON number (a 400-digit integer is not one:
    it has no float), else None."""
    if type(value) not in (int, float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if 0 <= number < math.inf else None


def describe(doc: dict[str, Any] | None, raw: bytes | None) -> str:
    """The holder, for messages."""
    if doc is None:
        return "save " + (raw or b"?")[:200].decode(errors="replace")
    return f"save {doc['token'][:200]} pid {doc.get('pid', '?')} on {doc.get('host', '?')}"


def stale_reason(doc: dict[str, Any] | None, now: float | None = None) -> str | None:
    """Why the lock ``doc`` (as :func:`parse` returns it) is a crashed save's (not refreshed for its lease:
    this process's, or the longer one its holder announced; or dated more than that lease in the future, which
    no refresh does: a broken clock set it; or a one-rank save whose process on this machine is gone), or
    None."""
    if doc is None or doc.get("time") is None:
        return None
    # only a one-rank save ends with its process: a wider save's other ranks write under its lease till it ends
    gone = holder_gone(doc)
    if gone is not None:
        return gone
    interval = max(heartbeat_seconds(), min(doc.get("heartbeat") or 0.0, _MAX_HEARTBEAT))
    bound = max(lease_intervals() * interval, min(doc.get("lease") or 0.0, _MAX_LEASE))
    age = (time.time() if now is None else now) - doc["time"]
    if age > bound:
        return f"not refreshed for {age:.0f} s, its lease is {bound:.0f} s"
    if -age > bound:
        return f"dated {-age:.0f} s in the future, more than its lease ({bound:.0f} s): a wrong clock set it"
    return None


def holder_gone(doc: dict[str, Any] | None) -> str | None:
    """Why the one-rank save holding the lock ``doc`` is known to be gone (it ran on this machine, and its
    process did not survive), or None (a wider save's other ranks may still write under it)."""
    if doc is None or doc.get("world") != 1:
        return None
    fields = [doc.get(k) for k in ("host", "boot_id", "pidns", "pid", "start")]
    if not all(isinstance(v, str) for v in fields[:3]) or not all(
        type(v) is int and v > 0 for v in fields[3:]
    ):
        return None
    me = this_owner("")
    if not me.boot_id or fields[:3] != [me.host, me.boot_id, me.pidns]:
        return None
    start = process_start(fields[3])
    if start is None:
        return f"its process {fields[3]} on this host is gone"
    if start == HIDDEN:  # it exists, this process may not read its start (hidepid): its lease decides
        return None
    return f"pid {fields[3]} is another process now" if start != fields[4] else None


# Holders: one thread per process refreshes every lease it holds -----------------------------------------------
@dataclass
class _Held:
    """A lease this process holds: its lock object's generation, and when the document stored there was made
    (``at``: the wall time written into it, which takers compare with; ``mono``: this process's monotonic
    clock then, which its own expiry compares with)."""

    ref: weakref.ref[Any]
    generation: bytes
    at: float
    mono: float
    terms: Terms
    world: int = 1  # the save's ranks, in every refresh: only a one-rank save's lock ends with its process
    expired: bool = False  # its refreshes stopped for longer than its safe part: the save never writes again


_held: dict[tuple[int, str, str], _Held] = {}
_guard = threading.Lock()
#: the leases found taken over (held by another token, or gone) while their save ran: its writers stop
_lost: set[tuple[int, str, str]] = set()


def stamp() -> tuple[float, float]:
    """Now, as a lock document says it (wall clock) and as this process measures the lease's age
    (monotonic)."""
    return time.time(), time.monotonic()


def keep(
    storage: Any,
    final: str,
    token: str,
    generation: bytes,
    at: float | None = None,
    mono: float | None = None,
    world: int = 1,
) -> None:
    """Refresh ``storage``'s lock of ``final`` (held by ``token`` for a save of ``world`` ranks, stored as
    ``generation``, its document made at ``at``/``mono``: :func:`stamp`) until :func:`drop`: a conditional
    write each heartbeat interval, which fails once another save took it over."""
    if at is None or mono is None:
        at, mono = stamp()
    with _guard:
        _held[(id(storage), final, token)] = _Held(
            weakref.ref(storage), generation, at, mono, own_terms(), world
        )
        _lost.discard((id(storage), final, token))
        _BEAT.ensure()


def drop(storage: Any, final: str, token: str) -> None:
    """Stop refreshing the lock (the save ended); forget that it was lost. A refresh of it already on its way
    (its conditional write in flight on the refresh thread) is waited for, up to what it may take (two of
    ``storage``'s stall bounds: its write and its read of the lock): the lock read after this is the last one
    the refresh stored, and a conditional delete of that generation is not undone by the refresh landing."""
    key = (id(storage), final, token)
    drop_key(key)
    with _settled:
        _settled.wait_for(lambda: key not in _refreshing, timeout=2 * storage.stall_bound())


def drop_key(key: tuple[int, str, str]) -> None:
    with _guard:
        _held.pop(key, None)
        _lost.discard(key)


def lost(storage: Any, final: str, token: str) -> bool:
    """Whether the lease of the save ``token`` to ``final`` was found taken over by another save (or its lock
    gone) while the save ran: no I/O, for the writers to check before each write batch."""
    with _guard:
        return (id(storage), final, token) in _lost


def check_holder(storage: Any, final: str, token: str, clock: Callable[[], float] = time.monotonic) -> None:
    """Raise when the lease of the save ``token`` (this process holds it) was found taken over, or when its
    last refresh the store took is older than its safe part (:attr:`Terms.safe`, by this process's monotonic
    clock): another save may take it over soon, so the save writes nothing more. No I/O."""
    key = (id(storage), final, token)
    with _guard:
        held = _held.get(key)
        if key in _lost:
            age = None
        elif held is None:
            return
        else:
            age = clock() - held.mono
            if age <= held.terms.safe and not held.expired:
                return
            held.expired = True  # for good: a refresh landing later does not make this save write again
    if age is None:
        raise StorageError(
            f"save {token} to {final} stopped: its lock {final}/.acp-lock was taken over by another save (this "
            "save did not refresh it for its lease); it writes nothing more and does not commit"
        )
    assert held is not None
    raise StorageError(
        f"save {token} to {final} stopped: its lock {final}/.acp-lock was last refreshed {age:.1f} s ago (the "
        f"store did not take its refreshes since), and another save may take it over once it is "
        f"{held.terms.bound:.0f} s old; it writes nothing more and does not commit"
    )


#: the leases whose refresh is on its way (one at a time per lease)
_refreshing: set[tuple[int, str, str]] = set()
#: notified when a refresh ended (:func:`drop` waits for one in flight)
_settled = threading.Condition(_guard)


def _refresh_all() -> None:
    """Refresh every held lease, each on a thread of its own: a refresh waiting on a store that stops
    answering (up to its stall bound) holds up no other lease; a lease whose last refresh still waits is
    skipped this round."""
    with _guard:
        due = [(key, entry) for key, entry in _held.items() if key not in _refreshing]
        _refreshing.update(key for key, _entry in due)
    for key, entry in due:
        try:
            threading.Thread(
                target=_refresh_one, args=(key, entry), name="acp-lease-refresh", daemon=True
            ).start()
        except BaseException:  # no thread (a process at its limit): refreshed here, as before
            _refresh_one(key, entry)


def _refresh_one(key: tuple[int, str, str], entry: _Held) -> None:
    try:
        _refresh(key, entry)
    finally:
        with _guard:
            _refreshing.discard(key)
            _settled.notify_all()


def _refresh(key: tuple[int, str, str], entry: _Held) -> None:
    """One conditional refresh of the lease ``key``; marks it lost when the lock names another save, or none."""
    storage, (_id, final, token) = entry.ref(), key
    if storage is None:
        drop_key(key)
        return
    at, mono = stamp()
    landed = True
    try:
        new = storage._refresh_lock(final, body(token, at, entry.world), entry.generation)
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
            return
        doc = parse(raw)
        holder = None if doc is None else doc["token"]
        if holder == token:
            new = stored  # still ours (the refresh landed, or never did): its generation is adopted
            landed = doc is not None and doc.get("time") == at
    with _guard:
        current = _held.get(key)
        if current is None:
            return
        if new:
            current.generation = new
            if landed and not current.expired:
                current.at, current.mono = at, mono
            return
        _held.pop(key, None)
        _lost.add(key)
    log.warning(
        "the lock %s/.acp-lock of save %s was taken over by another save (it names %s now: this process "
        "did not refresh it for its lease); this save stops writing and will not commit",
        final, token, holder or ("no save, it was removed" if raw is None else "no save: it was overwritten"),
    )  # fmt: skip


_BEAT = Heartbeat("acp-lease-heartbeat", _guard, lambda: bool(_held), _refresh_all, heartbeat_seconds)


# Ranks other than the coordinator ---------------------------------------------------------------------------
#: what a rank granting nothing adds to the minimum that carries rank 0's grant (:func:`grant`)
NO_GRANT = (1 << 62, 1 << 62, 1 << 62)


def grant(storage: Any, final: str, token: str | None) -> tuple[int, int, int]:
    """What rank 0 tells the ranks writing under its lease, in the agreement they wait for before writing:
    the time in its lock document as stored, the lease and the heartbeat interval, in microseconds (each
    rounded the safe way); :data:`NO_GRANT` when it holds no live lease."""
    key = (id(storage), final, token or "")
    with _guard:
        held = _held.get(key)
        if held is None or key in _lost or held.expired:
            return NO_GRANT
        return (
            math.floor(held.at * 1e6),
            math.floor(held.terms.bound * 1e6),
            math.ceil(held.terms.heartbeat * 1e6),
        )


def granted(values: Sequence[int] | None) -> tuple[float, Terms] | None:
    """The lease time and terms of a :func:`grant` (None when none was granted, or it makes no sense)."""
    if values is None or len(values) != 3 or any(not 0 < v < NO_GRANT[0] for v in values):
        return None
    at, bound, beat = (v / 1e6 for v in values)
    if not beat <= _MAX_HEARTBEAT or not beat < bound <= _MAX_LEASE:
        return None
    return at, Terms(beat, bound)


class Follower:
    """When a rank writing in place under rank 0's lease reads the lock (module docstring): never before its
    first write (rank 0's grant says when the lease was refreshed), then about once a :attr:`Terms.period`,
    at a phase its rank sets (``phase`` in [0, 1): the ranks' reads spread evenly over the period), plus reads
    halfway to the end of its trust when a read found the lease refreshed late (while that end is more than a
    heartbeat interval away: at most about three more a period), and one when its trust ran out while it did
    not check (a long write): ranks that check all along stop at its end without a read (no burst). Its
    writers stop once the lease it knows of is older than :attr:`Terms.safe`, or dated further than that in
    the future (a taker takes such a lock over at once: :func:`stale_reason`), or a read finds the lock naming
    another save, or none.
    ``clock`` (wall time, what the lock document's time is compared with) is injectable for simulations."""

    def __init__(
        self,
        token: str,
        grant: tuple[float, Terms] | None,
        phase: float,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.token, self.phase, self.clock = token, phase, clock
        self.epoch = clock()
        self.looked = -math.inf  # the last check
        self.reads = 0
        self.holder: str | None = None  # another save the lock named (the lease is lost for good)
        if grant is None:  # nothing known of the lease: read before the first write
            self.refreshed, self.terms, self.due = -math.inf, own_terms(), self.epoch
        else:
            self.refreshed, self.terms = grant
            self.due = self.epoch + phase * self.terms.period

    def check(self, read: Callable[[], bytes | None], final: str) -> None:
        """Raise when this rank must write nothing more under the lease; ``read`` (the lock object's bytes)
        is called only when a read is due."""
        now = self.clock()
        end = self.refreshed + self.terms.safe
        # due; or the trust ran out while this rank did not look (a long write, a late start): one read decides
        if self.holder is None and (
            now >= self.due or (now > end and self.looked < end - self.terms.heartbeat)
        ):
            now = self._read(read, final)  # the lease's age counts to when the read returned (or timed out)
        self.looked = now
        if self.holder is not None:
            raise StorageError(
                f"save {self.token} to {final} stopped: its lock {final}/.acp-lock names {self.holder} now (it "
                "was taken over by another save); this rank writes nothing more there"
            )
        age = now - self.refreshed
        if -age > self.terms.safe:  # a save starting now takes it over as a wrong clock's (stale_reason)
            raise StorageError(
                f"save {self.token} to {final} stopped: its lock {final}/.acp-lock is dated {-age:.1f} s in the "
                "future by this host's clock, more than its lease's safe part (a clock on rank 0's host or on "
                "this one is off), and a save starting now may take it over; this rank writes nothing more there"
            )
        if age > self.terms.safe:
            known = f"was last refreshed {age:.1f} s ago" if age < math.inf else "could not be read"
            raise StorageError(
                f"save {self.token} to {final} stopped: its lock {final}/.acp-lock {known}, and another save "
                f"may take it over once it is {self.terms.bound:.0f} s old; this rank writes nothing more there"
            )

    def _read(self, read: Callable[[], bytes | None], final: str) -> float:
        """Read the lock (its holder, its time and terms), schedule the next read; the time it returned."""
        self.reads += 1
        try:
            raw = read()
        except Exception as e:  # noqa: BLE001 - decides nothing: the lease known so far does
            log.debug("could not read the lock of %s: %s", final, e)
            now = self.clock()
        else:
            now = self.clock()
            doc = parse(raw)
            if doc is None or doc["token"] != self.token:
                self.holder = "no save" if raw is None else describe(doc, raw)
                return now
            if doc.get("time") is not None:
                self.refreshed = max(self.refreshed, doc["time"])
            beat, bound = doc.get("heartbeat"), doc.get("lease")
            if beat and bound and beat <= _MAX_HEARTBEAT and beat < bound <= _MAX_LEASE:
                self.terms = Terms(float(beat), float(bound))  # the holder's, as takers respect them
        period = self.terms.period
        slot = self.epoch + (math.floor((now - self.epoch) / period - self.phase) + 1 + self.phase) * period
        if slot - now < period / 2:  # now was this rank's slot (rounding), or all but: the next one
            slot += period
        deadline = self.refreshed + self.terms.safe
        if slot <= deadline or deadline - now <= self.terms.heartbeat:
            self.due = slot
        else:  # refreshed late: one more read before the trust ends, halfway there (while a refresh may come)
            self.due = now + (deadline - now) / 2
        return now


def phase(rank: int, world: int) -> float:
    """Where in the read period rank ``rank`` (of ``world``; rank 0 holds the lease) reads: evenly spread."""
    others = max(1, world - 1)
    return (((rank - 1) % others) + 0.5) / others


_followed: dict[tuple[int, str], Follower] = {}  # (id(storage), final) -> this rank's reads of its lock


def follow(
    storage: Any, final: str, token: str, grant: Sequence[int] | None = None, rank: int = 1, world: int = 2
) -> None:
    """Make :func:`check_follower` watch the lock of ``final`` for ``token`` (on this rank's ``storage``),
    with rank 0's ``grant`` (:func:`grant`); ``rank`` of ``world`` sets the phase of its reads."""
    follower = Follower(token, granted(grant), phase(rank, world))
    with _guard:
        _followed[(id(storage), final)] = follower


def unfollow(storage: Any, final: str) -> None:
    with _guard:
        _followed.pop((id(storage), final), None)


def check_follower(storage: Any, final: str) -> None:
    """Raise when this rank, writing under rank 0's lease of ``final``, must stop (:class:`Follower`)."""
    with _guard:
        follower = _followed.get((id(storage), final))
    if follower is not None:
        follower.check(lambda: storage._lock_state(final, retry=False)[0], final)
