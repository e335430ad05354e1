"""An interpreter exit while a save's write is stuck in the kernel ends within a bound, committing nothing.

At exit the library finishes the saves still in flight. A write pool thread stuck in a system call (a close on
a stalled network file system) held that wait, and then the interpreter's join of the pool's threads, forever:
the process never exited. Now a watchdog gives up once a write has not returned for
``$ARRAYCHECKPOINT_EXIT_STALL_SECONDS`` (with no other write finishing), says on stderr which path it was
writing and that the save was not committed, and ends the process with status 1. Here the close of every file
of the second save opens a FIFO that has no reader: a real system call that never returns.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp

SCRIPT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import arraycheckpoint as acp
    from arraycheckpoint.engine import shardfile

    root, fifo, big = sys.argv[1], sys.argv[2], sys.argv[3] == "big"
    n = 1 << 20 if big else 4  # big: its pack (4 MiB) is closed on the write-back thread
    mgr = acp.CheckpointManager(root)
    mgr.save(1, {"model": {"w": np.arange(n, dtype=np.float32)}}).result()
    real_close = shardfile._close

    def stalled_close(fd):
        os.open(fifo, os.O_WRONLY)  # no reader: blocks in the kernel for good (a close on a stalled NFS)
        real_close(fd)

    shardfile._close = stalled_close
    mgr.save(2, {"model": {"w": np.arange(n, dtype=np.float32) + 1}})
    print("exiting", flush=True)
    """
)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
@pytest.mark.parametrize("size", ["small", "big"])
def test_exit_with_a_stalled_write_is_bounded_and_commits_nothing(tmp_path: Path, size: str) -> None:
    root, fifo = tmp_path / "run", tmp_path / "fifo"
    os.mkfifo(fifo)
    env = {
        **os.environ,
        "ARRAYCHECKPOINT_EXIT_STALL_SECONDS": "1",
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    run = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(root), str(fifo), size],
        capture_output=True,
        text=True,
        timeout=60,  # it hung forever
        env=env,
    )
    assert run.returncode == 1 and run.stdout.split() == ["exiting"], (run.returncode, run.stderr[-3000:])
    err = run.stderr
    assert "has not returned" in err and "NOT committed" in err and str(root / "step_00000002") in err, err
    assert f"{root}/" in err.split("a write of ", 1)[1]  # the file being written, in the save's staging
    mgr = acp.CheckpointManager(root)  # removes the stalled save's leftovers
    assert mgr.all_steps() == [1]
    n = 1 << 20 if size == "big" else 4
    state = {"model": {"w": np.zeros(n, np.float32)}}
    mgr.restore(state=state)
    assert np.array_equal(state["model"]["w"], np.arange(n, dtype=np.float32))
    assert sorted(p.name for p in root.iterdir()) == ["step_00000001"]


def test_a_slow_write_is_not_stalled_while_others_finish(monkeypatch: pytest.MonkeyPatch) -> None:
    """A write running past the bound is stalled only when no other write finished within the bound (writes
    queued behind a slow device still progress); the bound comes from the environment."""
    from arraycheckpoint.runtime import workers

    now = workers.time.monotonic()
    monkeypatch.setattr(workers, "_running", {1: (now - 50, "/ck/a"), 2: (now - 5, "/ck/b")})
    monkeypatch.setattr(workers, "_last_done", [now - 2])
    assert workers.stalled(10) is None  # b's neighbour finished 2 s ago
    workers._last_done[0] = now - 20
    path, seconds = workers.stalled(10)
    assert path == "/ck/a" and seconds >= 50
    assert workers.stalled(60) is None
    monkeypatch.setenv(workers.STALL_ENV, "7.5")
    assert workers.stall_seconds() == 7.5
    monkeypatch.setenv(workers.STALL_ENV, "soon")
    assert workers.stall_seconds() == workers.DEFAULT_STALL_SECONDS
    with workers.busy("/ck/c"):
        assert "/ck/c" in [p for _t, p in workers._running.values()]
    assert len(workers._running) == 2 and workers._last_done[0] > now
