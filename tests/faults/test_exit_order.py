"""The library's exit hooks run in a fixed order whatever order they were registered in.

A single-process ``save_async`` before ``torch.distributed`` is initialized registers the hook that finishes
saves before the one that stops heartbeats; hooks registered with ``threading`` run in reverse order, so the
heartbeats were stopped first while the save was still finishing at exit, and its peers could judge the rank
stalled. ``runtime/exithook`` now runs them by their order: saves, abandoned collectives, heartbeats.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from arraycheckpoint.runtime import exithook


def test_hooks_run_by_order_not_registration(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(exithook, "_hooks", [])
    monkeypatch.setattr(exithook, "_registered", [True])  # the runner is not registered again here
    ran: list[str] = []

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("boom")

    exithook.at_thread_shutdown(lambda: ran.append("heartbeats"), exithook.STOP_HEARTBEATS)
    exithook.at_thread_shutdown(lambda: ran.append("abandoned"), exithook.END_ABANDONED)
    exithook.at_thread_shutdown(failing)
    exithook.at_thread_shutdown(lambda: ran.append("saves"), exithook.FINISH_SAVES)
    exithook.run_hooks()
    assert ran == ["failing", "saves", "abandoned", "heartbeats"]
    assert exithook._hooks == []


def test_order_at_a_real_exit() -> None:
    """In a real interpreter exit: a hook registered first with a later order runs after one registered
    later, both before the interpreter joins its threads (an executor still accepts work in the first)."""
    script = textwrap.dedent(
        """
        import concurrent.futures
        from arraycheckpoint.runtime import exithook

        pool = concurrent.futures.ThreadPoolExecutor(1)
        exithook.at_thread_shutdown(lambda: print("heartbeats stopped", flush=True), exithook.STOP_HEARTBEATS)
        exithook.at_thread_shutdown(
            lambda: print(pool.submit(lambda: "save finished").result(), flush=True), exithook.FINISH_SAVES
        )
        print("main done", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:3] == ["main done", "save finished", "heartbeats stopped"], out.stdout


def test_a_forked_child_runs_none_of_the_parents_hooks() -> None:
    """A child forked while a save_async is in flight (a DataLoader worker) exits at once: it waited forever
    on the parent's save, whose threads do not exist in it (the same for a collective given up after a
    stall, whose gloo wait then blocked the child and aborted the parent)."""
    script = textwrap.dedent(
        """
        import multiprocessing as mp, sys, tempfile, threading, time
        import numpy as np
        import arraycheckpoint as acp
        from arraycheckpoint.engine import packwrite

        release = threading.Event()
        real = packwrite.Packs.add

        def held(self, w, data):  # the save stays in flight until the child has exited
            release.wait(60)
            return real(self, w, data)

        packwrite.Packs.add = held
        fut = acp.save_async(tempfile.mkdtemp() + "/ck", {"m": {"a": np.arange(4, dtype=np.float32)}})
        child = mp.get_context("fork").Process(target=lambda: None)
        child.start()
        child.join(20)
        print("child", child.exitcode, flush=True)
        if child.exitcode is None:
            child.kill()
        release.set()
        fut.result()
        print("saved", flush=True)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:2] == ["child 0", "saved"], out.stdout
