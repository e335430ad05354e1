"""A commit whose read of its lock answers only once the lease is past its safe part (the read served before,
the answer slow: a host frozen, a read retried) writes no marker: the lease is checked again after the read.

Before (review23a, Storage.commit): the lease's age was checked before the lock was read, then the marker
written on the read's answer whenever it came, so a save whose lease another save could take over by then
committed anyway."""

from __future__ import annotations

import time
from typing import Any

import pytest
from lease_helpers import fresh_url, frozen, short_leases  # noqa: F401 - a fixture

from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage import storage_for


@pytest.mark.usefixtures("short_leases")
def test_a_commit_after_a_slow_lock_read_past_the_lease_is_refused() -> None:
    storage, final = storage_for(fresh_url())
    storage.check_target(final, overwrite=False)
    storage.acquire(final, "A")
    storage.write(final, "w/zarr.json", b"{}")
    read = storage._lock_token

    def slow_read(root: str) -> Any:
        token = read(root)  # the lock still names this save when the store answers the read ...
        frozen(storage)  # ... then the host stops past its lease's safe part (0.8 s of 1 s) before it goes on
        time.sleep(1.5)
        return token

    storage._lock_token = slow_read
    with pytest.raises(StorageError, match="stopped"):
        storage.commit(final, final, False)
    assert not storage.is_committed(final)
    storage.abort(final, final)
