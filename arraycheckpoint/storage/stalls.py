"""A save's requests that timed out but may still land (fsspec: a call that cannot be stopped).

A request to a Python file system that stops answering is given up on after the save's ``timeout=``
(:func:`.retry.call_within`), but its thread goes on, and the upload, delete or lock create it carries may
still reach the store minutes later. Landing after the save ended, it would write into the next save's
checkpoint (silent wrong values) or leave a lock nobody removes. So while a save has such a request alive:

* its abort and the release of its lock wait (:meth:`StallTracker.defer`): they run when the last one ends,
  so what landed late is deleted and the lock goes after it; until then the lock stays, and a save from
  another process is refused by it as by any held lock;
* a save to the same target in this process is refused at once (:func:`refuse_if_stalled`) with an error
  naming the stalled save and request, rather than waiting on the lock (never silently corrupted).

A request that never ends keeps the target locked: save elsewhere (a manager saves each step to its own
directory), or restart the process and let the manager's start-up cleanup remove the lock.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from ..errors import CheckpointExistsError

log = logging.getLogger("arraycheckpoint")

#: target -> (token, request) of a save of this process whose timed-out request still runs
_stalled: dict[str, tuple[str, str]] = {}
_guard = threading.Lock()


def refuse_if_stalled(final: str, token: str) -> None:
    """Raise :class:`CheckpointExistsError` when an earlier save of this process to ``final`` has a request
    that timed out and still runs (it may land in this save's checkpoint)."""
    with _guard:
        held = _stalled.get(final)
    if held is not None and held[0] != token:
        raise CheckpointExistsError(
            f"cannot save to {final}: a request of the earlier save {held[0]} there ({held[1]}) timed out and has "
            "not ended; it may still land there, so that save's lock and abort wait until it ends. Retry once it "
            "ended, or save to another path"
        )


class StallTracker:
    """The timed-out requests of one save (``final``, ``token``) that still run, and the cleanup that waits
    for them."""

    def __init__(self, final: str, token: str) -> None:
        self.final, self.token = final, token
        self._alive = 0
        self.what = ""  # the last request that timed out
        self._pending: list[Callable[[], None]] = []
        self._lock = threading.Lock()

    def stalled(self, what: str) -> Callable[[], None]:
        """Record that ``what`` timed out and still runs; the callable to call when it ends."""
        with self._lock:
            self._alive += 1
            self.what = what
        with _guard:
            _stalled[self.final] = (self.token, what)
        log.warning(
            "storage: %s timed out but cannot be stopped; save %s keeps its lock of %s until it ends",
            what, self.token, self.final,
        )  # fmt: skip
        return self._ended

    def alive(self) -> str | None:
        """The last timed-out request, while any still runs; else None."""
        with self._lock:
            return self.what if self._alive else None

    def defer(self, fn: Callable[[], None]) -> bool:
        """Keep ``fn`` (an abort, a release) for when the last stalled request ends; False (``fn`` is the
        caller's to run now) when none is alive."""
        with self._lock:
            if self._alive == 0:
                return False
            self._pending.append(fn)
            return True

    def _ended(self) -> None:
        with self._lock:
            self._alive -= 1
            if self._alive:
                return
            pending, self._pending = self._pending, []
        if pending:
            log.warning("storage: the stalled requests of save %s to %s ended; its cleanup runs now",
                        self.token, self.final)  # fmt: skip
        try:
            for fn in pending:
                try:
                    fn()  # may stall again: then deferred anew
                except Exception as e:  # noqa: BLE001 - one failed step must not skip the others
                    log.warning(
                        "storage: a cleanup step of save %s to %s failed after its stalled requests ended (%s); "
                        "if its lock %s/.acp-lock is still there, remove it by hand or start a manager there "
                        "(its start-up cleanup removes it)", self.token, self.final, e, self.final,
                    )  # fmt: skip
        finally:
            with self._lock:
                done = self._alive == 0 and not self._pending
            if done:  # nothing of this save runs any more: later saves there are not refused by this process
                with _guard:
                    if _stalled.get(self.final, ("",))[0] == self.token:
                        del _stalled[self.final]
