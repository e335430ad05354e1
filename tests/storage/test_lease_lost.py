"""A save whose lease was lost (its lock taken over by another save) on a store that writes in place
(``memory://``: a lease through tensorstore's conditional writes, as on S3).

Such a save writes no metadata, never commits, and its abort deletes nothing (what is under the target may be
the new holder's committed checkpoint); the lease thread marks the lease lost, and the writers stop. A refresh
whose answer was lost (or that was retried and refused although the first attempt landed) does not drop a
live save's lease: the lock as stored decides."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError, SaveFailedError, StorageError
from arraycheckpoint.storage import lease, locks, register_scheme, storage_for
from arraycheckpoint.storage.base import LOCK_KEY
from arraycheckpoint.storage.memory import MemoryStorage


@pytest.fixture(autouse=True)
def short_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(locks.HEARTBEAT_ENV, "0.1")
    monkeypatch.setenv(locks.LEASE_ENV, "10")  # 1 s: a loaded machine delays a refresh


@pytest.fixture
def url() -> str:
    return f"memory://lease-lost-{uuid.uuid4().hex[:8]}/step_1"


@pytest.fixture
def scheme() -> Iterator[Any]:
    def use(factory: Any) -> None:
        register_scheme("memory", factory)

    yield use
    register_scheme("memory", None)


def _claim(url: str, token: str) -> tuple[Any, str]:
    storage, final = storage_for(url)
    storage.check_target(final, overwrite=False)
    storage.acquire(final, token)
    return storage, final


def _until(cond: Any, what: str) -> None:
    end = time.monotonic() + 30  # generous: the lease thread acts within a few 0.1 s intervals
    while not cond():
        assert time.monotonic() < end, what
        time.sleep(0.05)


def test_a_taken_over_saves_abort_keeps_the_new_holders_checkpoint(url: str, caplog: Any) -> None:
    stale, final = _claim(url, "stale-0")
    stale.write(final, "w/zarr.json", b"{}")
    lease.drop(stale, final, "stale-0")  # its process stops (SIGSTOP, a long pause) past its lease
    time.sleep(1.5)
    acp.save(url, {"w": np.arange(4)})  # takes the lock over and commits
    committed = sorted(storage_for(url)[0].list(final))
    with pytest.raises(StorageError, match="refused"):
        stale.verify_lease(final)  # the coordinator's check before the metadata
    with pytest.raises(StorageError, match="refused"):
        stale.commit(final, final, False)
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        stale.abort(final, final)
    assert "abort of save stale-0" in caplog.text and "deletes nothing" in caplog.text
    assert sorted(storage_for(url)[0].list(final)) == committed
    back = {"w": np.zeros(4, dtype=np.int64)}
    acp.load(url, back)
    assert np.array_equal(back["w"], np.arange(4))


def test_a_lost_lease_is_marked_and_the_writers_stop(url: str, caplog: Any) -> None:
    holder, final = _claim(url, "mine-0")
    holder.check_lease(final)  # held: no error
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        MemoryStorage().write(final, LOCK_KEY, lease.body("other-1"))  # another save took it over
        _until(lambda: lease.lost(holder, final, "mine-0"), "the lease thread never noticed the takeover")
    assert "mine-0" in caplog.text and "other-1" in caplog.text
    with pytest.raises(StorageError, match="stopped: its lock .* was taken over"):
        holder.check_lease(final)
    holder.abort(final, final)  # deletes nothing: the lock is the other save's
    assert lease.parse(MemoryStorage().read(final, LOCK_KEY))["token"] == "other-1"
    holder.release(final, "mine-0")
    assert not lease.lost(holder, final, "mine-0")


def test_a_save_taken_over_before_its_commit_writes_no_metadata(url: str, scheme: Any) -> None:
    class TakenOver(MemoryStorage):
        def flush(self, root: str) -> None:  # the rank's writes are done; meanwhile another save took over
            if self._lease_token is not None:
                lease.drop(self, root, self._lease_token)  # (its heartbeat had stopped)
                MemoryStorage().write(root, LOCK_KEY, lease.body("other-1"))
                MemoryStorage().write(root, "theirs", b"another save's object")
            super().flush(root)

    scheme(TakenOver)
    with pytest.raises(SaveFailedError, match="held by save other-1"):
        acp.save(url, {"w": np.arange(8.0)})
    scheme(None)
    store, final = storage_for(url)
    keys = store.list(final)
    assert ".acp/metadata.json" not in keys and ".acp/committed" not in keys
    assert "theirs" in keys and LOCK_KEY in keys  # the abort deleted nothing of the target's new holder


class _AnswerLost(MemoryStorage):
    """Refreshes land, but the first few answers are lost (a timeout, a dropped connection) or the retried
    request is refused (412: its first attempt had landed)."""

    mode = "lost"
    failures = 3

    def _refresh_lock(self, final: str, body: bytes, generation: bytes) -> bytes:
        new = super()._refresh_lock(final, body, generation)
        if new and type(self).failures > 0:
            type(self).failures -= 1
            if self.mode == "lost":
                raise ConnectionError("connection reset: the answer was lost")
            return super()._refresh_lock(final, body, generation)  # the retry: 412, b""
        return new


@pytest.mark.parametrize("mode", ["lost", "refused"])
def test_an_ambiguous_refresh_keeps_a_live_saves_lease(url: str, mode: str) -> None:
    class Store(_AnswerLost):
        pass

    Store.mode, Store.failures = mode, 3
    holder, final = Store(), storage_for(url)[1]
    holder.check_target(final, overwrite=False)
    holder.acquire(final, "live-0")
    _until(lambda: Store.failures == 0, "the refreshes never ran")
    time.sleep(1.5)  # past the lease: a dropped lease would be taken over now
    assert not lease.lost(holder, final, "live-0")
    with pytest.raises(CheckpointExistsError, match="in progress"):
        _claim(url, "late-1")
    holder.verify_lease(final)
    holder.release(final, "live-0")
    assert MemoryStorage().read(final, LOCK_KEY) is None


def test_the_writers_of_a_save_whose_lease_was_lost_write_nothing(url: str, scheme: Any) -> None:
    class LostBeforeWriting(MemoryStorage):
        def open_flush(self, root: str) -> None:  # the lease thread found the lock taken over just now
            if self._lease_token is not None:
                lease.drop(self, root, self._lease_token)
                MemoryStorage().write(root, LOCK_KEY, lease.body("other-1"))
                lease._lost.add((id(self), root, self._lease_token))

    scheme(LostBeforeWriting)
    with pytest.raises(SaveFailedError, match="stopped: its lock .* was taken over"):
        acp.save(url, {"w": np.arange(8.0), "b": np.ones(3)})
    scheme(None)
    store, final = storage_for(url)
    assert store.list(final) == [LOCK_KEY]  # no array, pack or document of the lost save


@pytest.mark.parametrize("held_by", ["live save", "committed", "user"])
def test_a_refused_multi_rank_save_deletes_nothing_of_the_target(url: str, held_by: str) -> None:
    """With several ranks a refused claim does not end the save at once: every rank reports through the
    commit, and the coordinator aborts; that abort must not delete what made the claim fail."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from simworld import run_ranks

    store, final = storage_for(url)
    if held_by == "live save":
        other, _ = _claim(url, "other-1")
        store.write(final, "w/zarr.json", b"{}")
    elif held_by == "committed":
        acp.save(url, {"w": np.arange(4)})
    else:
        store.write(final, "notes.txt", b"the user's")

    def stored() -> dict[str, Any]:  # the lock by its holder (its heartbeat rewrites it)
        keys = [k for k in store.list(final) if k != ".acp/metrics.json"]
        return {
            k: lease.parse(store.read(final, k))["token"] if k == LOCK_KEY else store.read(final, k)
            for k in keys
        }

    before = stored()

    def save(comm: Any) -> str:
        try:
            acp.save(url, {"w": acp.PerRank(np.arange(4) + comm.rank)}, comm=comm)
        except (SaveFailedError, CheckpointExistsError) as e:
            return str(e)
        return "committed"

    assert all(o != "committed" for o in run_ranks(2, save))
    assert stored() == before
    if held_by == "live save":
        other.release(final, "other-1")


def test_every_rank_stops_writing_before_its_lease_can_be_taken_over(url: str, scheme: Any) -> None:
    """Rank 0 holds the lease; rank 1 writes in place under it, trusting the lease time rank 0 granted it (no
    read before its first write). Neither rank's refreshes or reads reach the store any more (a partition);
    once the lease ran out another save takes the target over and writes its rank 1's pack. Neither rank of the
    first save writes after that: both stopped once the lease could be taken over soon, without learning of
    the takeover (their pack keys are the new holder's: a write would overwrite it)."""
    import sys
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from simworld import run_ranks

    taken = threading.Event()
    reads: list[int] = []

    class Partitioned(MemoryStorage):
        def _refresh_lock(self, final: str, body: bytes, generation: bytes) -> bytes:
            raise ConnectionError("the store is out of reach")

        def _lock_state(self, final: str, retry: bool = True) -> tuple[bytes | None, bytes]:
            if retry:  # the claim (before the partition)
                return super()._lock_state(final, retry)
            if self._lease_token is None:
                reads.append(1)  # rank 1's: unanswered too, so only the lease's age can stop it
            raise ConnectionError("the store is out of reach")  # and rank 0's lease thread's

        def open_flush(self, root: str) -> None:
            if self._lease_token is not None:  # rank 0: another save takes the target over once it may
                deadline = time.monotonic() + 30
                while True:
                    try:
                        other = MemoryStorage()  # the other save's store is reachable
                        other.check_target(root, overwrite=False)
                        other.acquire(root, "other-1")
                        break
                    except CheckpointExistsError:
                        assert time.monotonic() < deadline, "the lease never ran out"
                        time.sleep(0.05)
                MemoryStorage().write(root, ".acp/packs/1.0.zip", b"B pack")  # the new holder's rank 1
                lease.drop(other, root, "other-1")
                taken.set()
            else:
                assert taken.wait(30)

    scheme(Partitioned)

    def save(comm: Any) -> str:
        try:
            acp.save(
                url, {"w": acp.PerRank(np.arange(1000.0) + comm.rank), "b": np.ones((64, 64))}, comm=comm
            )
        except SaveFailedError as e:
            return str(e)
        return "committed"

    outcomes = run_ranks(2, save)
    assert all(o != "committed" for o in outcomes), outcomes
    assert any("rank 1" in o and "last refreshed" in o for o in outcomes), outcomes
    assert len(reads) <= 1, "rank 1 read the lock more than once"
    scheme(None)
    store, final = storage_for(url)
    assert store.read(final, ".acp/packs/1.0.zip") == b"B pack"
    assert sorted(store.list(final)) == sorted([LOCK_KEY, ".acp/packs/1.0.zip"])
    assert lease.parse(store.read(final, LOCK_KEY))["token"] == "other-1"


def test_a_holder_whose_refreshes_do_not_land_stops_before_its_lease_can_be_taken_over(url: str) -> None:
    """Rank 0's own clock: once its last refresh the store took is older than the safe part of the lease,
    its writers stop and it does not commit, before any save may take the lock over (nobody has yet: the
    lock still names it), and a refresh landing later does not make it write again."""

    class Unreachable(MemoryStorage):
        cut = False

        def _refresh_lock(self, final: str, body: bytes, generation: bytes) -> bytes:
            if self.cut:
                raise ConnectionError("the store is out of reach")
            return super()._refresh_lock(final, body, generation)

        def _lock_state(self, final: str, retry: bool = True) -> tuple[bytes | None, bytes]:
            if self.cut and not retry:
                raise ConnectionError("the store is out of reach")
            return super()._lock_state(final, retry)

    holder, final = Unreachable(), storage_for(url)[1]
    holder.check_target(final, overwrite=False)
    holder.acquire(final, "mine-0")
    holder.check_lease(final)
    holder.cut = True
    _until(lambda: _stops(holder, final), "the holder never stopped")
    assert not lease.lost(holder, final, "mine-0")
    assert lease.parse(MemoryStorage().read(final, LOCK_KEY))["token"] == "mine-0"  # not taken over yet
    with pytest.raises(StorageError, match="last refreshed"):
        holder.verify_lease(final)
    holder.cut = False
    time.sleep(0.3)  # refreshes land again
    with pytest.raises(StorageError, match="last refreshed"):
        holder.check_lease(final)
    assert lease.grant(holder, final, "mine-0") == lease.NO_GRANT  # nor does it grant a lease to its ranks
    holder.release(final, "mine-0")


def _stops(storage: Any, final: str) -> bool:
    try:
        storage.check_lease(final)
    except StorageError as e:
        assert "last refreshed" in str(e), e
        return True
    return False


def test_no_rank_reads_the_lock_before_its_first_write(url: str, scheme: Any) -> None:
    """Rank 0's grant (in the agreement before the writes) tells the other ranks when its lease was refreshed:
    a save shorter than the read period reads the lock on no rank but rank 0 (before: one read per rank
    before its first write, 9,999 at once at 10,000 ranks)."""
    import sys
    import threading
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent.parent))
    from simworld import run_ranks

    reads: list[str] = []
    guard = threading.Lock()

    class Counting(MemoryStorage):
        def _lock_state(self, final: str, retry: bool = True) -> tuple[bytes | None, bytes]:
            if (
                self._lease_token is None and not retry
            ):  # a follower's read (rank 0's claim reads with retries)
                with guard:
                    reads.append(final)
            return super()._lock_state(final, retry)

    scheme(Counting)

    def save(comm: Any) -> str:
        acp.save(url, {"w": acp.PerRank(np.arange(1000.0) + comm.rank), "b": np.ones((64, 64))}, comm=comm)
        return "committed"

    assert run_ranks(4, save) == ["committed"] * 4
    assert reads == []
    scheme(None)
    back = {"w": acp.PerRank(np.zeros(1000)), "b": np.zeros((64, 64))}
    acp.load(url, back)
    assert np.array_equal(back["b"], np.ones((64, 64)))
