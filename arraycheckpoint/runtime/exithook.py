"""Exit hooks that run before the interpreter joins its threads and finalizes, in a fixed order.

Three hooks exist, and their order matters whatever order they were registered in (a single-process
``save_async`` before ``torch.distributed`` is initialized registers the first before the others):

1. :data:`FINISH_SAVES`: saves still in flight are finished (their writes need the executors, their
   collectives the process group, their peers' liveness the heartbeats);
2. :data:`END_ABANDONED`: collectives given up after a stall have their waiting threads ended (which closes
   the process group's connections: only once no save needs them);
3. :data:`STOP_HEARTBEATS`: heartbeat threads are stopped (last: a save finishing at exit is judged by its
   peers through them).

While they run, and then while the interpreter joins its threads, a watchdog thread ends the process (status
1, after saying why on stderr) once a save's write has stalled (:func:`.workers.exit_stall`): a write stuck
in the kernel would otherwise hold the first hook, and then the join of the pools' threads, forever.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable

FINISH_SAVES = 0
END_ABANDONED = 10
STOP_HEARTBEATS = 20

_hooks: list[tuple[int, int, Callable[[], None]]] = []
_lock = threading.Lock()
_registered = [False]
_watching = [False]  # the exit watchdog runs


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) owns none of its parent's saves, collectives or heartbeats:
    their hooks would wait forever in it on threads that do not exist there (a gloo wait copied from the
    parent), and what the child then does to the sockets it shares with the parent aborts the parent."""
    global _lock
    _lock = threading.Lock()  # possibly held by another of the parent's threads at the fork
    _hooks.clear()
    _registered[0] = False
    _watching[0] = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_in_child)


def at_thread_shutdown(fn: Callable[[], None], order: int = FINISH_SAVES) -> None:
    """Run ``fn`` when the interpreter exits, before ``threading`` joins the non-daemon threads; the hooks
    run by ascending ``order`` (:data:`FINISH_SAVES`, :data:`END_ABANDONED`, :data:`STOP_HEARTBEATS`), then in
    the order they were registered. A hook that raises is reported on stderr; the others still run.

    One hook is registered with ``threading._register_atexit`` (after ``concurrent.futures``' own, so it runs
    before it, while executors still accept work and daemon threads still run); where that is missing (or
    the interpreter is already shutting down) it goes to :mod:`atexit`, which runs later but still before
    finalization.
    """
    with _lock:
        _hooks.append((order, len(_hooks), fn))
        if _registered[0]:
            return
        _registered[0] = True
    import concurrent.futures.thread  # noqa: F401 - its exit hook registered first, so it runs after ours

    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(run_hooks)
    except RuntimeError:
        import atexit

        atexit.register(run_hooks)


def run_hooks() -> None:
    """Run (and forget) the registered hooks in their order (the registered exit hook itself); the exit
    watchdog starts first."""
    _start_watchdog()
    with _lock:
        hooks = sorted(_hooks)
        _hooks.clear()
        _registered[0] = False  # a hook registered from now on registers the runner again
    for _order, _n, fn in hooks:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every hook runs; the interpreter is exiting
            print(f"arraycheckpoint: exit hook {getattr(fn, '__name__', fn)} failed: {e}", file=sys.stderr)


#: how often the exit watchdog looks for a stalled write (seconds)
WATCH_INTERVAL = 0.2


def _start_watchdog() -> None:
    """Start (once) the daemon thread that ends the process when a save's write stalls at exit (only at
    exit: not when a test runs the hooks itself)."""
    if not getattr(threading, "_SHUTTING_DOWN", True):
        return
    with _lock:
        if _watching[0]:
            return
        _watching[0] = True
    threading.Thread(target=_watch, name="acp-exit-watchdog", daemon=True).start()


def _watch() -> None:
    from .workers import exit_stall

    while True:
        time.sleep(WATCH_INTERVAL)
        try:
            message = exit_stall()
        except Exception:  # noqa: BLE001 - the interpreter is finalizing (modules torn down): nothing to watch
            return
        if message is None:
            continue
        try:
            print(message, file=sys.stderr, flush=True)
            sys.stdout.flush()
        finally:
            os._exit(1)  # the stalled thread cannot be ended; what it was writing was never committed
