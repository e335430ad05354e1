"""Exit hooks that run before the interpreter joins its threads and finalizes, in a fixed order.

Three hooks exist, and their order matters whatever order they were registered in (a single-process
``save_async`` before ``torch.distributed`` is initialized registers the first before the others):

1. :data:`FINISH_SAVES`: saves still in flight are finished (their writes need the executors, their
   collectives the process group, their peers' liveness the heartbeats);
2. :data:`END_ABANDONED`: collectives given up after a stall have their waiting threads ended (which closes
   the process group's connections: only once no save needs them);
3. :data:`STOP_HEARTBEATS`: heartbeat threads are stopped (last: a save finishing at exit is judged by its
   peers through them).
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Callable

FINISH_SAVES = 0
END_ABANDONED = 10
STOP_HEARTBEATS = 20

_hooks: list[tuple[int, int, Callable[[], None]]] = []
_lock = threading.Lock()
_registered = [False]


def _forget_in_child() -> None:
    """A forked child (a DataLoader worker) owns none of its parent's saves, collectives or heartbeats:
    their hooks would wait forever in it on threads that do not exist there (a gloo wait copied from the
    parent), and what the child then does to the sockets it shares with the parent aborts the parent."""
    global _lock
    _lock = threading.Lock()  # possibly held by another of the parent's threads at the fork
    _hooks.clear()
    _registered[0] = False


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
    """Run (and forget) the registered hooks in their order (the registered exit hook itself)."""
    with _lock:
        hooks = sorted(_hooks)
        _hooks.clear()
        _registered[0] = False  # a hook registered from now on registers the runner again
    for _order, _n, fn in hooks:
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - every hook runs; the interpreter is exiting
            print(f"arraycheckpoint: exit hook {getattr(fn, '__name__', fn)} failed: {e}", file=sys.stderr)
