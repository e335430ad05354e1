"""A rank writing under rank 0's lease stops when that lease is dated further in the future than its safe part
(rank 0's clock is ahead of this host's, or the lock document was edited): any save starting now takes such a
lock over at once, as a wrong clock's (:func:`arraycheckpoint.storage.lease.stale_reason`).

Before: the follower trusted the lease until its future date plus the safe part (here ten minutes and more),
so it kept writing into the target while a save that had taken the target over cleared and wrote it."""

from __future__ import annotations

import pytest

from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage import lease, locks

TOKEN = "job-0"
AHEAD = 600.0  # rank 0's clock, ten minutes ahead of this host's


@pytest.fixture(autouse=True)
def default_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(locks.HEARTBEAT_ENV, raising=False)
    monkeypatch.delenv(locks.LEASE_ENV, raising=False)


def test_a_granted_lease_dated_in_the_future_is_not_written_under() -> None:
    now = 1_000_000.0
    stored = lease.body(TOKEN, now + AHEAD)
    assert lease.stale_reason(lease.parse(stored), now) is not None  # a taker starting now takes it over
    grant = lease.granted((int((now + AHEAD) * 1e6), 60_000_000, 10_000_000))
    follower = lease.Follower(TOKEN, grant, 0.5, lambda: now)
    with pytest.raises(StorageError, match="in the future"):
        follower.check(lambda: stored, "s3://b/ck")


def test_a_lease_read_dated_in_the_future_is_not_written_under() -> None:
    now = 1_000_000.0
    stored = lease.body(TOKEN, now + AHEAD)
    follower = lease.Follower(TOKEN, None, 0.5, lambda: now)  # nothing granted: it reads the lock first
    with pytest.raises(StorageError, match="in the future"):
        follower.check(lambda: stored, "s3://b/ck")
    assert follower.reads == 1


def test_a_lease_a_little_ahead_is_written_under() -> None:
    now = 1_000_000.0
    stored = lease.body(TOKEN, now + 5.0)  # clocks 5 s apart: within the safe part, no taker takes it
    follower = lease.Follower(TOKEN, None, 0.5, lambda: now)
    follower.check(lambda: stored, "s3://b/ck")
