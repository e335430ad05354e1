"""The one future type of arraycheckpoint: two phases, snapshot taken and checkpoint committed."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


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

    def __repr__(self) -> str:
        state = "committed" if self.done() else ("staged" if self.staged.done() else "snapshotting")
        return f"CheckpointFuture({self.path!r}, {state})"
