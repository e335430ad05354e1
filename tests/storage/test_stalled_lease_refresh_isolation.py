"""One lease whose refresh hangs (its store stops answering) does not hold up this process's other leases.

Before: one thread refreshed every lease the process holds, one after another, so a refresh that waited for a
stalled store (up to its stall bound: minutes) left the leases of healthy stores unrefreshed behind it; their
saves stopped ("last refreshed ... s ago") and other jobs could take their targets over. Now each lease is
refreshed on a thread of its own; a lease whose refresh is still waiting is not refreshed again meanwhile."""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

import pytest

from arraycheckpoint.storage import lease, locks, storage_for


@pytest.fixture
def quick_leases(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(locks.HEARTBEAT_ENV, "0.25")
    monkeypatch.setenv(locks.LEASE_ENV, "16")  # 4 s leases, safe part 3.75 s


def _claim(token: str) -> tuple[Any, str]:
    storage, final = storage_for(f"memory://isolation-{uuid.uuid4().hex[:8]}/step_1")
    storage.check_target(final, False)
    storage.acquire(final, token)
    return storage, final


def test_a_hung_refresh_of_one_store_leaves_another_stores_lease_fresh(quick_leases: None) -> None:
    stalled, stalled_final = _claim("stalled-save")
    healthy, healthy_final = _claim("healthy-save")
    resume = threading.Event()
    hung = threading.Event()

    def hangs(final: str, body: bytes, generation: bytes) -> bytes:  # a store that stops answering
        hung.set()
        resume.wait(60)
        raise OSError("no answer")

    stalled._refresh_lock = hangs
    try:
        assert hung.wait(30), "the stalled store's lease was never refreshed"
        time.sleep(6.0)  # longer than the healthy lease's safe part (3.75 s), with its refreshes every 0.25 s
        lease.check_holder(healthy, healthy_final, "healthy-save")  # before: "last refreshed 6.x s ago"
        doc = lease.parse(healthy._lock_state(healthy_final)[0])
        assert doc is not None and doc["token"] == "healthy-save"
    finally:
        resume.set()
        healthy.release(healthy_final, "healthy-save")
        stalled.release(stalled_final, "stalled-save")
