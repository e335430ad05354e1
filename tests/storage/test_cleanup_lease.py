"""A manager's start-up cleanup on an object store removes an uncommitted step under a lock of its own that is
a lease like a save's (``storage/leftovers.py``): it looks again whether the step is committed once it holds
that lock (a save that committed and released it during the cleanup's listing keeps its checkpoint), it
refreshes the lock while it deletes (a save starting there is refused, not emptied), and a cleanup whose
refreshes stop reaching the store deletes nothing once its lock may be taken over. In process, ``memory://``,
heartbeats of 0.2 s (leases of 1 s)."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest
from lease_helpers import frozen, short_leases, stalling_deletes, take_over_and_commit  # noqa: F401

from arraycheckpoint.errors import CheckpointExistsError, StorageError
from arraycheckpoint.manager import CheckpointManager
from arraycheckpoint.storage import storage_for
from arraycheckpoint.storage.base import LOCK_KEY

LEFTOVER = ("zarr.json", "a/zarr.json", "a/c.0", "a/c.1", "a/c.2", "a/c.3")


def _leftover(url: str) -> tuple[Any, str]:
    """A crashed save's leftovers at ``url``: keys a save writes, no marker, no lock."""
    storage, root = storage_for(url)
    for key in LEFTOVER:
        storage.write(root, key, b"old " + key.encode())
    return storage, root


def test_cleanup_keeps_a_step_committed_during_its_listing(monkeypatch: pytest.MonkeyPatch) -> None:
    root = f"memory://jobs-{uuid.uuid4().hex[:8]}"
    saver, r = storage_for(root)
    step = saver.join(r, "step_00000007")
    saver.check_target(step, False)
    saver.acquire(step, "training-save")  # another job's save in flight: a live lease
    for key in ("zarr.json", "w/zarr.json", "w/c.0"):
        saver.write(step, key, b"training " + key.encode())
    real = CheckpointManager._foreign_entries

    def listing_then_the_save_commits(self: CheckpointManager, path: str, limit: int = 10) -> list[str]:
        found = real(self, path, limit)  # the listing takes a while on a big step ...
        saver.commit(step, step, False)  # ... meanwhile the save commits and releases its lock
        saver.release(step, "training-save")
        return found

    monkeypatch.setattr(CheckpointManager, "_foreign_entries", listing_then_the_save_commits)
    manager = CheckpointManager(root)  # cleanup=True
    assert saver.is_committed(step) and manager.all_steps() == [7]
    assert saver.read(step, "w/c.0") == b"training w/c.0" and not saver.exists(step, LOCK_KEY)


@pytest.mark.usefixtures("short_leases")
def test_a_slow_cleanup_keeps_its_lock_so_a_save_there_is_refused() -> None:
    url = f"memory://cleanup-{uuid.uuid4().hex[:8]}/step_00000005"
    cleaner, root = _leftover(url)
    resume = threading.Event()
    stalling_deletes(cleaner, 2, resume)
    result: dict[str, bool] = {}
    cleanup = threading.Thread(target=lambda: result.setdefault("removed", cleaner.remove_uncommitted(root)))
    cleanup.start()
    time.sleep(1.5)  # longer than the lease (1 s): its lock is refreshed all along
    saver, final = storage_for(url)
    saver.check_target(final, overwrite=False)
    with pytest.raises(CheckpointExistsError, match="in progress"):
        saver.acquire(final, "save-2")
    resume.set()
    cleanup.join(30)
    assert result == {"removed": True} and cleaner.list(root) == []


@pytest.mark.usefixtures("short_leases")
def test_a_cleanup_whose_lock_may_be_taken_over_deletes_nothing_more() -> None:
    url = f"memory://cleanup-{uuid.uuid4().hex[:8]}/step_00000005"
    cleaner, root = _leftover(url)
    frozen(cleaner)  # its refreshes never reach the store: its lock runs out
    resume = threading.Event()
    deleted = stalling_deletes(cleaner, 2, resume)
    errors: list[BaseException] = []

    def cleanup() -> None:
        try:
            cleaner.remove_uncommitted(root)
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    thread = threading.Thread(target=cleanup)
    thread.start()
    taker = take_over_and_commit(url, 4)  # takes the cleanup's lock over as a crashed save's
    resume.set()
    thread.join(30)
    assert len(deleted) == 2 and errors and isinstance(errors[0], StorageError)
    assert [taker.read(root, f"a/c.{i}") for i in range(4)] == [b"taker"] * 4 and taker.is_committed(root)


@pytest.mark.usefixtures("short_leases")
def test_a_cleanup_whose_lock_create_lost_its_answer_holds_the_lock_and_removes_the_leftover() -> None:
    """The conditional create of the cleanup's lock lands but its answer is lost (the retry is refused: the
    lock exists): the lock it finds is its own. It took it for another save in flight, kept the leftover and
    left its lock unrefreshed: every save to the step was refused until the lease ran out."""
    from arraycheckpoint.storage.base import CONTROL

    storage, root = storage_for(f"memory://cleanup-{uuid.uuid4().hex[:8]}/step_3")
    storage.write(root, CONTROL.metadata, b"{}")
    storage.write(root, "a/c.0", b"a crashed save's chunk")
    real, calls = storage._create_lock, []

    def create_answer_lost(final: str, body: bytes) -> Any:
        calls.append(real(final, body))
        if len(calls) == 1:
            raise TimeoutError("no answer from the store (it stalls)")  # it landed
        return calls[-1]

    storage._create_lock = create_answer_lost
    assert storage.remove_uncommitted(root) is True
    assert len(calls) == 2 and storage.list(root) == []
    nxt, _ = storage_for(root)
    nxt.check_target(root, False)
    nxt.acquire(root, "next-save")
    nxt.release(root, "next-save")
