"""A save's release of its lock, delayed past its lease (its host frozen between reading the lock and
deleting it), never deletes the lock of the save that took the target over meanwhile: the delete is
conditional on the generation it read.

Before (review23a P3): the release read the lock's token, then deleted it unconditionally; A, resuming after
B took the lock over, deleted B's lock, so a third save C claimed the target while B still wrote (two holders:
B's next write landed in C's committed checkpoint)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from lease_helpers import fresh_url, short_leases  # noqa: F401 - a fixture

from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import lease, storage_for
from arraycheckpoint.storage.base import LOCK_KEY
from arraycheckpoint.storage.memory import MemoryStorage


def _claim(url: str, token: str) -> tuple[Any, str]:
    storage, final = storage_for(url)
    storage.check_target(final, overwrite=False)
    storage.acquire(final, token)
    return storage, final


def _freeze_lock_deletes(storage: Any, resume: threading.Event) -> None:
    """``storage``'s host stops right before it deletes its lock (whichever call deletes it), until ``resume``."""
    plain, conditional = storage.delete_key, storage._delete_lock_if

    def delete_key(root: str, key: str, guard: Any = None) -> None:
        if key == LOCK_KEY:
            resume.wait(30)
        plain(root, key, guard)

    def delete_lock_if(final: str, generation: bytes) -> bool:
        resume.wait(30)
        return bool(conditional(final, generation))

    storage.delete_key, storage._delete_lock_if = delete_key, delete_lock_if


@pytest.mark.usefixtures("short_leases")
def test_a_late_release_leaves_the_new_holders_lock() -> None:
    url = fresh_url()
    a, final = _claim(url, "A")
    a.write(final, "w/zarr.json", b"{}")  # save A fails and releases its claim
    resume = threading.Event()
    _freeze_lock_deletes(a, resume)
    releasing = threading.Thread(target=a.release, args=(final, "A"))
    releasing.start()
    deadline = time.monotonic() + 30
    while True:  # A's lease runs out: B takes the lock over
        try:
            b, _ = _claim(url, "B")
            break
        except CheckpointExistsError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    try:
        resume.set()
        releasing.join(30)
        raw = MemoryStorage().read(final, LOCK_KEY)
        assert raw is not None and lease.parse(raw)["token"] == "B"  # before: A deleted it
        with pytest.raises(CheckpointExistsError, match="in progress"):
            _claim(url, "C")  # so no third save claims the target B writes to
        b.check_lease(final)
    finally:
        resume.set()
        b.release(final, "B")
    assert MemoryStorage().read(final, LOCK_KEY) is None  # B's own release removes it
