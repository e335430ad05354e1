"""The one future type of arraycheckpoint: two phases, snapshot taken and checkpoint committed."""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

_pending: set[CheckpointFuture] = set()
_pending_lock = threading.Lock()
_hook_registered = False


class CheckpointFuture:
    """Handle of an asynchronous save.

    ``staged`` completes once the snapshot is taken (the caller may mutate its tensors again);
    :meth:`result` returns once the checkpoint is committed on every rank, or raises the save's error
    (naming the failing rank) on every rank.
    """

    def __init__(self, path: str) -> None:
        self.path = path
        self.staged: Future[None] = Future()
        self._committed: Future[Any] = Future()
        _track(self)

    def result(self, timeout: float | None = None) -> Any:
        """Wait for the commit; returns the committed metadata. Raises the save's error."""
        return self._committed.result(timeout)

    def done(self) -> bool:
        return self._committed.done()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        return self._committed.exception(timeout)

    def add_done_callback(self, fn: Callable[[CheckpointFuture], Any]) -> None:
        self._committed.add_done_callback(lambda _f: fn(self))

    # engine side ------------------------------------------------------------------------------------
    def _set_staged(self, error: BaseException | None = None) -> None:
        if not self.staged.done():
            if error is None:
                self.staged.set_result(None)
            else:
                self.staged.set_exception(error)

    def _set_committed(self, value: Any = None, error: BaseException | None = None) -> None:
        self._set_staged(error)
        if error is None:
            self._committed.set_result(value)
        else:
            self._committed.set_exception(error)
        with _pending_lock:
            _pending.discard(self)

    def __repr__(self) -> str:
        state = "committed" if self.done() else ("staged" if self.staged.done() else "snapshotting")
        return f"CheckpointFuture({self.path!r}, {state})"


def _track(future: CheckpointFuture) -> None:
    """Remember ``future`` until it completes, so that interpreter exit finishes it (:func:`finish_pending`)."""
    global _hook_registered
    with _pending_lock:
        _pending.add(future)
        if _hook_registered:
            return
        _hook_registered = True
    # threading's exit hooks run before its threads are joined and in reverse order of registration: this
    # one, registered after concurrent.futures' own, runs while executors still accept work (a save's
    # background writes submit to them; after concurrent.futures' hook they fail "cannot schedule new
    # futures after interpreter shutdown" and the save is lost without a word)
    from .exithook import at_thread_shutdown

    at_thread_shutdown(_finish_at_exit)  # exithook.FINISH_SAVES: before the other hooks, whenever registered


def finish_pending() -> list[str]:
    """Wait for every save still in flight (called at interpreter exit): a script whose last call is
    ``save_async`` (or ``CheckpointManager.save``) gets its checkpoint; a save that fails is reported on
    stderr, naming its path. Returns the paths of the saves that failed."""
    failed: list[str] = []
    while True:
        with _pending_lock:
            futures = sorted(_pending, key=lambda f: f.path)
        if not futures:
            return failed
        for fut in futures:
            error = fut.exception()
            with _pending_lock:
                _pending.discard(fut)
            if error is not None:
                failed.append(fut.path)
                print(
                    f"arraycheckpoint: the save to {fut.path} still in flight at exit FAILED and was not "
                    f"committed: {type(error).__name__}: {error}",
                    file=sys.stderr,
                    flush=True,
                )


def _finish_at_exit() -> None:
    """The exit hook: :func:`finish_pending`, and when a save failed, the process exits with status 1.

    An exit hook cannot change the exit status by raising (Python ignores ``SystemExit`` there), so after a
    failure the remaining ``atexit`` handlers run now, stdio is flushed, and the process ends with
    ``os._exit(1)``: a script (or a scheduler watching it) never reads a lost checkpoint as success.
    """
    if not finish_pending():
        return
    import atexit
    import os

    try:
        atexit._run_exitfuncs()  # what the interpreter would still run (logging's flush, user hooks)
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a closed or broken stream: nothing more to say on it
                pass
        os._exit(1)
