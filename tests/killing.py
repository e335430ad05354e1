"""kill -9 of one rank in the middle of a save, for the failure tests on every backend.

The ranks run as spawned processes (not :func:`dist.run_distributed`: one of them never reports); a rank
announces that it reached the point to die at by creating a file, and the test kills it there.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def wait_for(path: Path, timeout: float, procs: list) -> None:
    """Wait until ``path`` exists; fail if a rank exits first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        dead = [p for p in procs if not p.is_alive()]
        assert not dead, f"a rank exited early (exit codes {[p.exitcode for p in dead]}) before {path.name}"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout} s"
        time.sleep(0.05)


def kill_rank_at(target: Callable[..., None], world: int, args: Callable[[int], tuple], flag: Path,
                 victim: int = 1) -> None:  # fmt: skip
    """Spawn ``target(*args(rank))`` for every rank, SIGKILL rank ``victim`` once ``flag`` exists, give the
    survivors 90 s to finish (they fail: their peer is gone), then stop whatever still runs."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    procs: list[Any] = [ctx.Process(target=target, args=args(r)) for r in range(world)]
    for p in procs:
        p.start()
    try:
        wait_for(flag, 180, procs)
        os.kill(procs[victim].pid, signal.SIGKILL)
        procs[victim].join(30)
        assert procs[victim].exitcode == -signal.SIGKILL
        for p in procs:
            p.join(90)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


def report_outcome(handle: Any, signal_dir: str, rank: int) -> None:
    """In a rank process: wait for the save ``handle``, write ``committed`` or the error to
    ``<signal_dir>/rank<rank>-result`` for the parent, and exit at once (the process group's peer is gone)."""
    try:
        handle.result(timeout=120)
        outcome = "committed"
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        outcome = f"{type(e).__name__}: {e}"
    Path(signal_dir, f"rank{rank}-result").write_text(outcome)
    os._exit(0)
