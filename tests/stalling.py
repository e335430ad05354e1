"""A local storage backend that stops its own process (SIGSTOP) inside a save, for the stalled-rank tests.

Usage in a test body (any process, torch or JAX)::

    stall = register_stalling_scheme("stall")   # stall:///path is local storage
    stall["armed"] = rank == 1                   # the next flush on rank 1 stops that process
    acp.save("stall:///tmp/ck", state, timeout=3)

The process stops right after its writes were flushed, so it is alive but not progressing while the other
ranks wait for it in the commit; another process wakes it with SIGCONT.
"""

from __future__ import annotations

import os
import signal
import time

from arraycheckpoint import storage
from arraycheckpoint.storage import LocalStorage


def register_stalling_scheme(scheme: str) -> dict[str, bool]:
    """Register ``<scheme>://`` as local storage whose next flush stops this process while ``armed``."""
    stall = {"armed": False}

    class StallingLocal(LocalStorage):
        def normalize(self, url: str) -> str:
            return super().normalize(url.removeprefix(f"{scheme}://"))

        def flush(self, root: str) -> None:
            super().flush(root)
            if stall["armed"]:
                stall["armed"] = False
                os.kill(os.getpid(), signal.SIGSTOP)
                # the stop may take effect a moment after kill() returns: this thread must not go on into the
                # commit meanwhile (its status would reach rank 0, which then rightly commits)
                time.sleep(1.0)

    storage.register_scheme(scheme, StallingLocal)
    return stall
