"""One background thread per process that keeps held locks alive: the skeleton the lock files' heartbeat
(:mod:`.locks`, one ``futimens`` per held lock) and the object stores' leases (:mod:`.lease`, one conditional
write per held lock) share.

The thread sleeps one heartbeat interval (read anew each round: a holder started with a shorter interval
wakes it), then, while its owner still holds anything, calls ``beat``; it ends when nothing is held, and the
next hold starts a new one. ``held`` is asked under the owner's ``guard``, and :meth:`Heartbeat.ensure` is
called under it too, so a hold never slips between the thread's last look and its end.
"""

from __future__ import annotations

import threading
from collections.abc import Callable


class Heartbeat:
    """The thread ``name`` that calls ``beat`` every ``interval()`` seconds while ``held()``."""

    def __init__(
        self,
        name: str,
        guard: threading.Lock,
        held: Callable[[], bool],
        beat: Callable[[], None],
        interval: Callable[[], float],
    ) -> None:
        self.name, self._guard, self._held, self._beat, self._interval = name, guard, held, beat, interval
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()
        self._sleeping = 0.0  # the interval the thread sleeps for now

    def ensure(self) -> None:
        """Make the thread run (call under ``guard``, after recording a hold): started when none runs, woken
        when it sleeps longer than the interval is now."""
        if self._interval() < self._sleeping:
            self._wake.set()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def running(self) -> bool:
        """Whether the thread runs (for tests)."""
        return self._thread is not None

    def _run(self) -> None:
        while True:
            self._sleeping = self._interval()
            self._wake.wait(self._sleeping)
            self._wake.clear()
            with self._guard:
                if not self._held():
                    self._thread = None
                    return
            self._beat()
