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

    from arraycheckpoint.runtime import workers

    # this machine's other work (the test suite, other jobs) moves its write counters: only this process's
    # writes count here, so the stalled one is seen as stalled
    workers.machine_counters = lambda: ()
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
    monkeypatch.setattr(workers, "_running", {1: (now - 50, "/ck/a", False), 2: (now - 5, "/ck/b", False)})
    monkeypatch.setattr(workers, "_last_done", [now - 2])
    assert workers.stalled(10) is None  # b's neighbour finished 2 s ago
    workers._last_done[0] = now - 20
    path, seconds, committing = workers.stalled(10)
    assert path == "/ck/a" and seconds >= 50 and not committing
    assert workers.stalled(60) is None
    monkeypatch.setenv(workers.STALL_ENV, "7.5")
    assert workers.stall_seconds() == 7.5
    monkeypatch.setenv(workers.STALL_ENV, "soon")
    assert workers.stall_seconds() == workers.DEFAULT_STALL_SECONDS
    with workers.busy("/ck/c"):
        assert "/ck/c" in [p for _t, p, _c in workers._running.values()]
    assert len(workers._running) == 2 and workers._last_done[0] > now


SLOW_FLUSH = textwrap.dedent(
    """
    import os, sys, time
    import numpy as np
    import arraycheckpoint as acp
    from arraycheckpoint import storage
    from arraycheckpoint.storage import LocalStorage

    class SlowFlush(LocalStorage):  # a healthy flush that takes 3 s: the machine keeps writing meanwhile
        def normalize(self, url):
            return super().normalize(url.removeprefix("slowflush://"))

        def flush(self, root):
            super().flush(root)
            with open(sys.argv[2], "wb") as f:
                end = time.monotonic() + 3.0
                while time.monotonic() < end:
                    f.write(os.urandom(1 << 20))
                    f.flush()
                    os.fsync(f.fileno())
                    time.sleep(0.05)

    storage.register_scheme("slowflush", SlowFlush)
    acp.save_async("slowflush://" + sys.argv[1], {"model": {"w": np.arange(1 << 16, dtype=np.float32)}})
    print("exiting", flush=True)
    """
)


STALLED_COMMIT = textwrap.dedent(
    """
    import os, sys
    import numpy as np
    import arraycheckpoint as acp
    from arraycheckpoint import storage
    from arraycheckpoint.runtime import workers
    from arraycheckpoint.storage import LocalStorage

    workers.machine_counters = lambda: ()  # as above: only this process's writes count
    fifo, where = sys.argv[2], sys.argv[3]

    class StallAtCommit(LocalStorage):
        # "metadata": the coordinator flushes the metadata itself before the commit (as storage whose commit
        # does not flush does), and that flush stalls
        flushes_at_commit = where != "metadata"

        def normalize(self, url):
            return super().normalize(url.removeprefix("stallcommit://"))

        def flush(self, root):
            super().flush(root)
            if where == "metadata" and os.path.exists(os.path.join(root, ".acp", "metadata.json")):
                os.open(fifo, os.O_WRONLY)  # the coordinator's flush of the metadata never returns

        def commit(self, staging, final, overwrite):
            if where == "commit":
                os.open(fifo, os.O_WRONLY)  # the commit's rename / fsync never returns
            super().commit(staging, final, overwrite)

    storage.register_scheme("stallcommit", StallAtCommit)
    acp.save_async("stallcommit://" + sys.argv[1], {"model": {"w": np.arange(16, dtype=np.float32)}})
    print("exiting", flush=True)
    """
)


def _run_at_exit(script: str, *args: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "ARRAYCHECKPOINT_EXIT_STALL_SECONDS": "1",  # stands for the default 300 s
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=60, env=env
    )


def test_a_slow_flush_that_keeps_the_machine_writing_is_not_given_up_at_exit(tmp_path: Path) -> None:
    """The flush outlasts the bound while no write of the save finishes; the machine's dirty pages move, so
    the save is not given up on (it was: status 1, the checkpoint lost)."""
    run = _run_at_exit(SLOW_FLUSH, str(tmp_path / "ck"), str(tmp_path / "busy.bin"))
    assert run.returncode == 0, (run.returncode, run.stderr[-2000:])
    assert (tmp_path / "ck" / ".acp" / "committed").is_file()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs a FIFO")
@pytest.mark.parametrize("where", ["metadata", "commit"])
def test_exit_with_the_coordinators_commit_stalled_is_bounded_and_says_what_it_knows(
    tmp_path: Path, where: str
) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    run = _run_at_exit(STALLED_COMMIT, str(tmp_path / "ck"), str(fifo), where)  # it hung forever
    assert run.returncode == 1, (run.returncode, run.stderr[-2000:])
    if where == "metadata":  # before the commit: certainly not committed
        assert "(the metadata)" in run.stderr and "NOT committed" in run.stderr, run.stderr
    else:
        assert "(its commit)" in run.stderr and "may or may not have been committed" in run.stderr, run.stderr
    assert not (tmp_path / "ck" / ".acp" / "committed").exists()
