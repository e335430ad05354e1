"""Exit hooks that run before the interpreter joins its threads and finalizes."""

from __future__ import annotations

import threading
from collections.abc import Callable


def at_thread_shutdown(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the interpreter exits, before ``threading`` joins the non-daemon threads.

    ``threading._register_atexit`` hooks run in reverse order of registration, while executors still accept
    work and daemon threads still run; where it is missing (or the interpreter is already shutting down) the
    hook goes to :mod:`atexit`, which runs later but still before finalization.
    """
    register = getattr(threading, "_register_atexit", None)
    try:
        if register is None:
            raise RuntimeError("no threading._register_atexit")
        register(fn)
    except RuntimeError:
        import atexit

        atexit.register(fn)
