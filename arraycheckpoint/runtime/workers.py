"""What the save's threads are writing or waiting for, so that interpreter exit never waits on a stalled one.

At exit the library finishes the saves still in flight (:mod:`.future`, :mod:`.exithook`). A write stuck in
the kernel (a stalled network file system, a close that never returns, a FIFO without a reader) or in a
storage callback would hold that wait, and after it the interpreter's join of the pools' threads, forever.
Each write (and each wait of the save's thread for one, the flush, the coordinator's metadata and commit)
runs inside :func:`busy`, naming the path; at exit a watchdog (:func:`exit_stall`, run by :mod:`.exithook`)
ends the process with status 1 once one has been running for :func:`stall_seconds` while nothing progressed
meanwhile, saying on stderr which path it was writing and what became of the save.

Progress is any :func:`busy` block that finished, or a change of the machine's write counters (the pages it
dirtied and wrote back, the bytes its network interfaces sent: :func:`machine_counters`): a healthy flush of
gigabytes to a slow disk or NFS, or a long upload, moves them, so only a save whose machine writes nothing at
all for the whole bound is given up on. Losing a healthy checkpoint is worse than a hang, so the signal errs
towards waiting.
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
_running: dict[int, tuple[float, str, bool]] = {}  # token -> (started, path, committing)
_last_done = [time.monotonic()]
_last_counters: list[tuple[int, ...] | None] = [None]
_tokens = itertools.count()


def _forget_in_child() -> None:
    """A forked child runs none of its parent's writes."""
    global _lock
    _lock = threading.Lock()
    _running.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


@contextlib.contextmanager
def busy(path: str, committing: bool = False) -> Iterator[None]:
    """Mark the calling thread as writing (or waiting for the write of) ``path`` until the block ends;
    ``committing``: the block commits the save (given up on, the save may or may not be committed)."""
    token = next(_tokens)
    with _lock:
        _running[token] = (time.monotonic(), path, committing)
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


def machine_counters() -> tuple[int, ...]:
    """Counters that move while this machine writes anywhere: the pages it dirtied and wrote back since boot
    (a flush in progress, NFS) and the bytes its network interfaces sent (an object store upload); () where
    the system does not say (not Linux)."""
    out: list[int] = []
    try:
        with open("/proc/vmstat", "rb") as f:  # pages dirtied and written back since boot
            out += [int(line.split()[1]) for line in f if line.startswith((b"nr_dirtied ", b"nr_written "))]
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/proc/net/dev", "rb") as f:
            out.append(sum(int(line.split(b":", 1)[1].split()[8]) for line in f.readlines()[2:]))
    except (OSError, ValueError, IndexError):
        pass
    return tuple(out)


def _note_machine_progress() -> None:
    """A change of :func:`machine_counters` since the last look counts as progress."""
    now = machine_counters()
    if now and _last_counters[0] is not None and now != _last_counters[0]:
        _last_done[0] = time.monotonic()
    _last_counters[0] = now


def stalled(bound: float) -> tuple[str, float, bool] | None:
    """The oldest write running for more than ``bound`` seconds (its path, for how long, whether it commits),
    when nothing progressed within the last ``bound`` seconds (writes queued behind a slow one still finish;
    a slow flush still moves the machine's counters); else None."""
    now = time.monotonic()
    with _lock:
        if not _running or now - _last_done[0] <= bound:
            return None
        started, path, committing = min(_running.values())
    return (path, now - started, committing) if now - started > bound else None


def exit_stall() -> str | None:
    """The exit watchdog's probe (called every fraction of a second at exit): what to say on stderr before
    the process gives up on a stalled write, naming its path and the saves still in flight; None while
    nothing is stalled."""
    _note_machine_progress()
    found = stalled(stall_seconds())
    if found is None:
        return None
    path, seconds, committing = found
    from .future import _pending, _pending_lock  # the saves still in flight (read only)

    with _pending_lock:
        saves = sorted(f.path for f in _pending)
    which = f"the save to {', '.join(saves)}" if saves else "the save in flight"
    if committing:
        outcome = (
            f"{which} may or may not have been committed (it was being committed: it is if its "
            "`.acp/committed` marker exists and it loads)"
        )
    else:
        outcome = (
            f"{which} was NOT committed (CheckpointManager removes its leftovers on its next start; committed "
            "checkpoints are untouched)"
        )
    return (
        f"arraycheckpoint: exiting without waiting for a write of {path} that has not returned for "
        f"{seconds:.0f} s while this machine wrote nothing (a stalled file system or storage backend; bound: "
        f"${STALL_ENV}, {stall_seconds():g} s): {outcome}"
    )
