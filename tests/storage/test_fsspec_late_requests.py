"""A request to an fsspec file system that timed out cannot be stopped: it may land after its save failed.

fsspec's in-memory file system, one call held on a gate (the store stalls) until the test opens it: a save
whose upload timed out keeps its lock and defers its abort until the upload ends (then what landed is deleted
and the lock released); a save to the same target meanwhile is refused naming the stalled request, never
corrupted by it. A lock create that timed out and lands after its save failed is removed when it lands."""

from __future__ import annotations

import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import ArrayCheckpointError, CheckpointExistsError
from arraycheckpoint.storage import register_scheme, stalls
from arraycheckpoint.storage.fsspec_store import FsspecStorage

pytest.importorskip("fsspec")


class _Gated(FsspecStorage):
    """fsspec's memory file system; the first call of kind ``stall`` (``"pipe"`` or ``"lock"``) blocks until
    ``gate`` is set."""

    stall = "pipe"
    gate = threading.Event()
    armed = [True]

    def __init__(self) -> None:
        super().__init__("memory", {})
        pipe, open_ = self.fs.pipe, self.fs.open
        cls = type(self)

        def hold() -> None:
            cls.armed[0] = False
            assert cls.gate.wait(60), "the test never opened the gate"

        def gated_pipe(batch: Any, *a: Any, **k: Any) -> Any:
            if cls.stall == "pipe" and cls.armed[0]:
                hold()
            elif cls.stall == "rank 1" and cls.armed[0] and any("/packs/1." in p for p in batch):
                hold()
            return pipe(batch, *a, **k)

        def gated_open(path: str, mode: str = "rb", *a: Any, **k: Any) -> Any:
            if cls.stall == "lock" and mode == "xb" and path.endswith(".acp-lock") and cls.armed[0]:
                hold()
            return open_(path, mode, *a, **k)

        self.fs.pipe, self.fs.open = gated_pipe, gated_open


@pytest.fixture
def gated() -> Iterator[type[_Gated]]:
    class Store(_Gated):
        gate = threading.Event()
        armed = [True]

    register_scheme("memory", Store)
    yield Store
    Store.gate.set()
    register_scheme("memory", None)


def _settled(url: str) -> None:
    end = time.monotonic() + 30  # generous: the held call ends as soon as the gate opens
    while any(k.rstrip("/").endswith(url.split("://", 1)[1]) for k in list(stalls._stalled)):
        assert time.monotonic() < end, "the stalled request's cleanup never ran"
        time.sleep(0.05)


def test_a_stalled_upload_never_lands_in_the_next_saves_checkpoint(gated: Any) -> None:
    url = f"memory://late-{uuid.uuid4().hex[:8]}/ck"
    with pytest.raises(ArrayCheckpointError):
        acp.save(url, {"w": np.arange(64.0)}, timeout=1)  # its upload stalls
    with pytest.raises(CheckpointExistsError, match="timed out and has not ended; it may still land"):
        acp.save(url, {"w": np.arange(64.0) * 2}, timeout=30)
    gated.gate.set()  # the stalled upload lands now; the save's deferred abort and release follow
    _settled(url)
    store = gated()
    assert store.list(store.normalize(url)) == []  # what landed late was deleted, the lock released
    acp.save(url, {"w": np.arange(64.0) * 3}, timeout=30)
    back = {"w": np.zeros(64)}
    acp.load(url, back)
    assert np.array_equal(back["w"], np.arange(64.0) * 3)


def test_a_lock_create_that_lands_after_its_save_failed_is_removed(gated: Any) -> None:
    gated.stall = "lock"
    url = f"memory://late-{uuid.uuid4().hex[:8]}/ck"
    with pytest.raises(ArrayCheckpointError):
        acp.save(url, {"w": np.arange(8.0)}, timeout=1)  # its lock create stalls
    gated.gate.set()  # the create lands after the save failed
    _settled(url)
    store = gated()
    assert not store.exists(store.normalize(url), ".acp-lock")
    acp.save(url, {"w": np.arange(8.0) + 1}, timeout=30, overwrite=True)
    back = {"w": np.zeros(8)}
    acp.load(url, back)
    assert np.array_equal(back["w"], np.arange(8.0) + 1)


def test_a_ranks_stalled_upload_keeps_the_coordinators_lock(gated: Any, caplog: Any) -> None:
    """Rank 1's stalled upload (its own process in a real job) may land after the coordinator's abort: the
    coordinator keeps the lock, so a later save there is refused rather than given those bytes."""
    sys.path.insert(0, str(Path(__file__).parent.parent))
    from simworld import run_ranks

    gated.stall = "rank 1"
    url = f"memory://late-{uuid.uuid4().hex[:8]}/ck"

    def save(comm: Any) -> str:
        try:
            acp.save(url, {"w": acp.PerRank(np.arange(64.0) + comm.rank)}, comm=comm, timeout=1)
        except ArrayCheckpointError as e:
            return str(e)
        return "committed"

    outcome = run_ranks(2, save)
    assert all("not committed" in o for o in outcome), outcome
    assert "the lock of" in caplog.text and "a request of rank 1" in caplog.text and "is kept" in caplog.text
    gated.gate.set()  # rank 1's upload lands after the save ended
    _settled(url)
    with pytest.raises(CheckpointExistsError, match="in progress"):
        acp.save(url, {"w": np.arange(64.0) * 2}, timeout=30)


def test_a_failed_deferred_cleanup_step_runs_the_others_and_frees_the_target() -> None:
    """The deferred abort raising (the store still flaky when the stalled request ends) neither skips the
    release nor leaves the target refused in this process."""
    from arraycheckpoint.storage import stalls

    final = "memory://late-cleanup/T"
    tracker = stalls.StallTracker(final, "tokA")
    ended = tracker.stalled(f"upload of {final}/a")
    ran: list[str] = []

    def abort() -> None:
        ran.append("abort")
        raise OSError("delete failed")

    assert tracker.defer(abort) and tracker.defer(lambda: ran.append("release"))
    ended()  # what call_within's thread does when the request ends
    assert ran == ["abort", "release"]
    assert tracker.alive() is None and final not in stalls._stalled
    stalls.refuse_if_stalled(final, "tokB")  # not refused
