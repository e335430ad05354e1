"""What the save's threads are writing or waiting for, so that interpreter exit never waits on a stalled one.

At exit the library finishes the saves still in flight (:mod:`.future`, :mod:`.exithook`). A write stuck in
the kernel (a stalled network file system, a close that never returns, a FIFO without a reader) or in a
storage callback would hold that wait, and after it the interpreter's join of the pools' threads, forever.
Each write (and each wait of the save's thread for one) runs inside :func:`busy`, naming the path; at exit a
watchdog (:func:`exit_stall`, run by :mod:`.exithook`) ends the process with status 1 once one has been
running for :func:`stall_seconds` while none finished meanwhile, saying on stderr which path it was writing
and which saves were not committed (nothing was: the commit comes after every write).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator

#: seconds one write (or wait for one) may run with no other finishing before exit gives up on it
DEFAULT_STALL_SECONDS = 300.0
#: the environment variable overriding :data:`DEFAULT_STALL_SECONDS`
STALL_ENV = "ARRAYCHECKPOINT_EXIT_STALL_SECONDS"

_lock = threading.Lock()
_running: dict[int, tuple[float, str]] = {}  # token -> (started, path)
_last_done = [time.monotonic()]
_tokens = itertools.count()


def _forget_in_child() -> None:
    """A forked child runs none of its parent's writes."""
    global _lock
    _lock = threading.Lock()
    _running.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def busy(path: str) -> Iterator[None]:
    """Mark the calling thread as writing (or waiting for the write of) ``path`` until the block ends."""
    token = next(_tokens)
    with _lock:
        _running[token] = (time.monotonic(), path)
    try:
        yield
    finally:
        with _lock:
            del _running[token]
            _last_done[0] = time.monotonic()


def stall_seconds() -> float:
    """The stall bound: ``$ARRAYCHECKPOINT_EXIT_STALL_SECONDS`` (a positive number), else 300."""
    try:
        value = float(os.environ.get(STALL_ENV, ""))
    except ValueError:
        return DEFAULT_STALL_SECONDS
    return value if value > 0 else DEFAULT_STALL_SECONDS


def stalled(bound: float) -> tuple[str, float] | None:
    """The path of the oldest write running for more than ``bound`` seconds and for how long, when none
    finished within the last ``bound`` seconds (writes queued behind a slow one still progress); else None."""
    now = time.monotonic()
    with _lock:
        if not _running or now - _last_done[0] <= bound:
            return None
        started, path = min(_running.values())
    return (path, now - started) if now - started > bound else None


def exit_stall() -> str | None:
    """The exit watchdog's probe: what to say on stderr before the process gives up on a stalled write,
    naming its path and the saves still in flight; None while nothing is stalled."""
    found = stalled(stall_seconds())
    if found is None:
        return None
    path, seconds = found
    from .future import _pending, _pending_lock  # the saves still in flight (read only)

    with _pending_lock:
        saves = sorted(f.path for f in _pending)
    which = f"the save to {', '.join(saves)}" if saves else "the save in flight"
    return (
        f"arraycheckpoint: exiting without waiting for a write of {path} that has not returned for "
        f"{seconds:.0f} s (a stalled file system or storage backend; bound: ${STALL_ENV}, "
        f"{stall_seconds():g} s): {which} was NOT committed (CheckpointManager removes its leftovers on its "
        "next start; committed checkpoints are untouched)"
    )
