"""Stalled-rank detection for checkpoint collectives: heartbeats through the torch.distributed c10d store.

A collective timeout cannot tell a stalled rank from a slow one: a healthy save whose ranks wait minutes in
the commit gather for the slowest writer looks exactly like one whose peer stopped. So arraycheckpoint never
bounds a collective by time. Instead every rank runs a small heartbeat thread that bumps its counter in the
job's c10d store every ``interval`` seconds, and a rank waiting in a checkpoint collective polls the counters:

* the coordinator (rank 0) watches every rank; the others watch the coordinator and the job's abort key;
* a rank whose counter has not moved for ``timeout`` seconds is *stalled* (stopped, frozen, crashed, its
  host or network gone); the rank that notices raises :class:`StalledRankError` naming it and publishes the
  verdict under the abort key, so every waiting rank fails within about ``timeout`` seconds with the same
  message, and a stalled rank that resumes fails at its next collective instead of pairing with strangers;
* staleness compares the *peer's* counter, never clocks across hosts, so a rank that was itself stopped does
  not blame the others when it resumes.

The one bound in time is on *arriving*: before a checkpoint group exists there is no heartbeat to watch, so
:func:`join_world` names the ranks that did not reach its creation within the timeout (a save called on one
rank only). Once it exists, every rank publishes with its heartbeat how many saves and loads it has entered
(:meth:`Liveness.enter_call`) and its timeout: a watched rank that keeps beating but stays a call behind for
the larger of the two timeouts (it never called this save: ``if rank == 0: acp.save(...)``) is named the same
way. A rank inside the same call, however slow, is never blamed.

The heartbeat threads are stopped and joined when the interpreter exits, before it finalizes: a daemon thread
still inside a store call then would abort the process (see :func:`_stop_heartbeats`).

What it deliberately does not do: judge progress inside a rank. A rank whose writes are slow keeps beating
and is waited for. Storage that stops answering is bounded by the storage layer itself: each small-object
request waits at most the save's ``timeout=`` (:meth:`arraycheckpoint.storage.base.Storage.stall_bound`), and
the S3 backend's transfers abort when no byte moves for ``low_speed_seconds``; the rank then fails the save
with an error naming the path, and every rank learns it through the commit.
The store master is the process that created the store (usually rank 0's); if that process stalls, the store
itself stops answering and torch's store timeout applies.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import weakref
from typing import Any

from ..errors import StalledRankError  # also importable from here (its old home)

__all__ = ["DEFAULT_TIMEOUT", "Liveness", "StalledRankError", "default_timeout", "join_world"]

log = logging.getLogger("arraycheckpoint")

#: Seconds without a heartbeat after which a rank counts as stalled (``ACP_LIVENESS_TIMEOUT`` overrides).
DEFAULT_TIMEOUT = 300.0


def default_timeout() -> float:
    raw = os.environ.get("ACP_LIVENESS_TIMEOUT")
    return float(raw) if raw else DEFAULT_TIMEOUT


class Liveness:
    """Heartbeats of one rank and its view of the others', in the c10d ``store`` under ``prefix``.

    Args:
        store: a ``torch.distributed.Store`` every rank shares (the default group's).
        prefix: key prefix agreed by all ranks (the communicator's session).
        rank, world: this rank and the number of ranks.
        timeout: seconds without a heartbeat after which a rank is stalled.
    """

    def __init__(self, store: Any, prefix: str, rank: int, world: int, timeout: float) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world
        self.timeout = 0.0
        self.interval = 0.0
        self.generation = 0
        self._joined = -1
        self._seen: dict[int, tuple[bytes, float]] = {}
        self._next_check = 0.0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._beats = 0
        self.calls = 0  # saves and loads this rank has entered (published with every beat)
        self._behind: dict[int, tuple[int, float]] = {}  # watched rank -> (its calls, since when seen behind)
        self.set_timeout(timeout)
        self._beat()
        self._thread = threading.Thread(target=self._run, name="acp-heartbeat", daemon=True)
        self._thread.start()
        _stop_at_exit(self)

    def set_timeout(self, timeout: float) -> None:
        """Judge peers stalled after ``timeout`` seconds without a heartbeat from now on (every rank sets the
        same value at the same collective point: the ``timeout=`` of a save or load).

        The heartbeat interval follows (``timeout / 20``, between 0.05 and 5 s) and takes effect at once. A peer
        that has not switched yet still beats at its old interval, which it publishes with every beat; it is
        judged by the larger of the two bounds until it switches, so a healthy rank is never blamed for it.
        """
        if not timeout > 0:
            raise ValueError(f"liveness timeout must be > 0 seconds, got {timeout}")
        timeout = float(timeout)
        if timeout == self.timeout:
            return
        self.timeout = timeout
        self.interval = min(5.0, max(0.05, timeout / 20))
        self._seen.clear()  # staleness restarts from the next observation under the new bound
        self._next_check = 0.0
        self._wake.set()  # the heartbeat thread beats at once and then at the new interval

    # Heartbeats --------------------------------------------------------------------------------------
    def _key(self, rank: int) -> str:
        return f"{self.prefix}/hb/{rank}"

    def _abort_key(self) -> str:
        return f"{self.prefix}/abort/{self.generation}"

    def _beat(self) -> None:
        self._beats += 1
        self.store.set(self._key(self.rank), f"{self._beats}:{self.interval:g}:{self.calls}:{self.timeout:g}")

    def enter_call(self) -> bool:
        """Count one more save or load on this rank (before its first collective; every rank enters the same
        calls in the same order) and publish it at once. Returns whether a rank gave up a collective of this
        group (:meth:`aborted`): the caller rebuilds the group before its first collective, as the rank that
        gave up does (a rank that was never in that call, ``if rank == 0: acp.save``, learns it here)."""
        self.calls += 1
        self._behind.clear()
        self._beat()
        return self.aborted()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(self.interval)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._beat()
            except Exception:  # noqa: BLE001 - the store is gone (process group destroyed): stop beating
                return

    def close(self) -> None:
        """Stop the heartbeat thread (it finishes the store call it may be in)."""
        self._stop.set()
        self._wake.set()

    def join(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for the heartbeat thread to end (after :meth:`close`)."""
        self._thread.join(timeout)

    # Checks ------------------------------------------------------------------------------------------
    def check(self, what: str, peers: tuple[int, ...] = ()) -> None:
        """Raise :class:`StalledRankError` if a watched rank (and any of ``peers``: the ranks this one waits
        for) has stalled, or another rank found one.

        Cheap to call in a polling loop: the store is read at most once per ``interval``.
        """
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + self.interval
        self.check_abort(what)
        self.check_stale(what, publish=True, peers=peers)

    def aborted(self) -> bool:
        """Whether a rank gave up a collective of this group's generation (the group must be rebuilt before
        its next collective: the others may still have one in flight)."""
        return bool(self.store.check([self._abort_key()]))

    def check_abort(self, what: str) -> None:
        """Raise if a rank published a stall verdict for this generation (one store round trip)."""
        abort = self._abort_key()
        if self.store.check([abort]):
            verdict = self.store.get(abort).decode(errors="replace")
            raise StalledRankError(f"rank {self.rank}: {what} abandoned: {verdict}")

    def check_stale(self, what: str, publish: bool = False, peers: tuple[int, ...] = ()) -> None:
        """Raise if a watched rank's heartbeat has not moved for ``timeout`` (``publish``: tell the others).

        Rank 0 watches every rank, the others rank 0 and ``peers``."""
        now = time.monotonic()
        abort = self._abort_key()
        if self.rank == 0:
            watched = [r for r in range(self.world) if r != self.rank]
        else:
            watched = sorted({0, *peers} - {self.rank})
        values = self.store.multi_get([self._key(r) for r in watched])
        stalled, absent = [], []
        for r, value in zip(watched, values):
            seen = self._seen.get(r)
            if seen is None or seen[0] != value:
                self._seen[r] = (bytes(value), now)
            elif now - seen[1] > max(self.timeout, 2 * _peer_interval(value) + 1.0):
                stalled.append((r, now - seen[1]))
            calls, bound = _peer_calls(value)
            if calls is None or calls >= self.calls:
                self._behind.pop(r, None)
                continue
            behind = self._behind.get(r)
            if behind is None or behind[0] != calls:
                self._behind[r] = (calls, now)
            elif now - behind[1] > max(self.timeout, bound):  # a late rank is not judged by a bound it has
                absent.append((r, calls, now - behind[1]))  # not seen yet: the larger of the two
        if stalled:
            names = ", ".join(f"rank {r} (no heartbeat for {age:.0f} s)" for r, age in stalled)
            verdict = (
                f"{names} stalled during {what}: alive but not progressing, or gone; the liveness timeout is "
                f"{self.timeout:g} s (timeout= of save/load, or ACP_LIVENESS_TIMEOUT). Check that rank's host and "
                "logs"
            )
        elif absent:
            names = ", ".join(f"rank {r} ({calls} calls, {age:.0f} s)" for r, calls, age in absent[:8])
            more = f" and {len(absent) - 8} more" if len(absent) > 8 else ""
            verdict = (
                f"{names}{more} alive but never entered this checkpoint call ({what}; this rank's call "
                f"{self.calls}): every rank must call acp.save/save_async/load at the same point, e.g. not only "
                f"under `if rank == 0:` as with torch.save; the liveness timeout is {self.timeout:g} s (timeout= "
                "of save/load, or ACP_LIVENESS_TIMEOUT)"
            )
        if stalled or absent:
            if publish:
                try:
                    self.store.set(abort, f"rank {self.rank} found {verdict}")
                except Exception:  # noqa: BLE001 - the verdict still reaches this rank's caller
                    pass
            raise StalledRankError(f"rank {self.rank}: {verdict}")

    def rebuild_barrier(self, generation: int) -> None:
        """Wait until every rank is ready to rebuild the group for ``generation`` (each rank joins once).

        Raises :class:`StalledRankError` (without publishing) while a watched rank is still stalled; a later
        call resumes waiting for the same generation.
        """
        key = f"{self.prefix}/rebuild/{generation}"
        if self._joined != generation:
            # each rank gets a fresh timeout to join: a rank that was stalled and has just been resumed
            # (SIGCONT, a VM unpaused) still shows its old heartbeat until its beating thread runs again
            self._seen.clear()
            self.store.add(key, 1)
            self._joined = generation
        delay = 1e-3
        while self.store.add(key, 0) < self.world:
            self.check_stale("rebuilding the checkpoint group after a stalled rank")
            time.sleep(delay)
            delay = min(delay * 2, self.interval)
        self.generation = generation
        # every rank rebuilds at the first collective of the call it is in, the same call on every rank: the
        # count of calls restarts there (a call one rank entered alone no longer puts it ahead)
        self.calls = 1
        self._behind.clear()
        self._beat()


#: seconds the interpreter's exit waits for heartbeat threads that are inside a store call
EXIT_JOIN_TIMEOUT = 5.0
#: the heartbeats to stop before the interpreter finalizes (see :func:`_stop_heartbeats`)
_RUNNING: weakref.WeakSet[Liveness] = weakref.WeakSet()
_HOOKED = [False]


def _stop_at_exit(live: Liveness) -> None:
    """Have ``live``'s heartbeat stopped by :func:`_stop_heartbeats` when the interpreter exits."""
    _RUNNING.add(live)
    if _HOOKED[0]:
        return
    _HOOKED[0] = True
    from .exithook import STOP_HEARTBEATS, at_thread_shutdown

    at_thread_shutdown(_stop_heartbeats, STOP_HEARTBEATS)  # after the saves finishing at exit


def _stop_heartbeats() -> None:
    """Stop every heartbeat thread before the interpreter finalizes (the exit hook).

    A daemon thread inside a c10d store call (which releases the GIL) when finalization begins is ended by
    Python as soon as the call returns, from inside torch's C++ binding: the unwinding meets a ``noexcept``
    frame and the process aborts (SIGABRT, "terminate called without an active exception") after the program
    itself succeeded, at random (a heartbeat spends a store round trip per interval in such a call). So each
    heartbeat is told to stop and waited for, at most :data:`EXIT_JOIN_TIMEOUT` seconds in all (a store call
    stuck longer, its server frozen, is left).
    """
    running = list(_RUNNING)
    for live in running:
        live.close()
    deadline = time.monotonic() + EXIT_JOIN_TIMEOUT
    for live in running:
        live.join(max(0.0, deadline - time.monotonic()))


def _peer_calls(value: bytes) -> tuple[int | None, float]:
    """The saves and loads a peer has entered and its liveness timeout, published with its counter
    (``b"<beats>:<interval>:<calls>:<timeout>"``; None and 0 when it publishes none)."""
    try:
        _beats, _interval, calls, timeout = bytes(value).split(b":")
        return int(calls), float(timeout)
    except ValueError:
        return None, 0.0


def _peer_interval(value: bytes) -> float:
    """The heartbeat interval a peer publishes with its counter (``b"<beats>:<interval>[:...]"``)."""
    try:
        return float(bytes(value).split(b":")[1])
    except (IndexError, ValueError):
        return 5.0  # the longest interval any rank uses


_JOINED = [0]  # group creations this process completed, in order (the same on every rank)
#: Seconds a rank waits for the others at a group creation before it logs which ranks have not arrived.
JOIN_WARN_AFTER = 30.0


def join_world(store: Any, rank: int, world: int, timeout: float, what: str) -> None:
    """Wait in the c10d ``store`` until every rank of the world reaches this group creation (``what``).

    Creating a process group (``new_group``) is collective and has no heartbeat yet: a rank that never gets
    there (a save called on rank 0 only, as ``torch.save`` is) would leave the others blocked for torch's
    store timeout, 30 minutes, saying nothing. Here each waiting rank logs the missing ranks after
    :data:`JOIN_WARN_AFTER` seconds and raises :class:`StalledRankError` naming them after ``timeout``. One
    counter and one key per rank; a waiting rank polls one key (with backoff), so the store sees O(ranks).
    A rank that gave up joins the same creation again on its next call (counted once), so the job goes on
    once the others call too.
    """
    prefix = f"acp-join/{_JOINED[0]}"
    if not store.check([f"{prefix}/{rank}"]):
        store.set(f"{prefix}/{rank}", b"1")
        if store.add(f"{prefix}/count", 1) == world:
            store.set(f"{prefix}/all", b"1")
    start, delay, warned = time.monotonic(), 1e-3, False
    while not store.check([f"{prefix}/all"]):
        waited = time.monotonic() - start
        if waited > timeout or (not warned and waited > min(JOIN_WARN_AFTER, timeout / 2)):
            absent = world - int(store.add(f"{prefix}/count", 0))
            named = [r for r in range(min(world, 1000)) if not store.check([f"{prefix}/{r}"])][:8]
            ranks = ", ".join(map(str, named)) + (
                f" and {absent - len(named)} more" if absent > len(named) else ""
            )
            message = (
                f"rank {rank}: {absent} rank(s) ({ranks}) did not reach {what} within {waited:.0f} s: every rank "
                "must call acp.save/save_async/load (and construct a CheckpointManager) at the same point, e.g. "
                "not only under `if rank == 0:` as with torch.save"
            )
            if waited > timeout:
                raise StalledRankError(
                    f"{message}; the liveness timeout is {timeout:g} s (timeout= of save/load, or "
                    "ACP_LIVENESS_TIMEOUT)"
                )
            log.warning("%s; still waiting", message)
            warned = True
        time.sleep(delay)
        delay = min(delay * 2, 0.5)
    _JOINED[0] += 1
