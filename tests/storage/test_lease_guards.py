"""Object-store leases guard every delete and judge only what they can know (``storage/lease.py``,
``storage/leftovers.py``, ``Storage.abort``): a save's abort and its clearing of an old checkpoint stop deleting
once their lease is lost or run out, so a save that took the target over keeps its committed objects; a rank
following rank 0's lease judges its age by the clock after its lock read returns; a lock dated more than a
lease in the future is a crashed save's; a lock document holding a 400-digit number is refused as one, never
an OverflowError; a lock of a multi-rank save whose process on this host is gone waits out its lease (its
other ranks may still write under it), a one-rank save's is taken over at once. In process, ``memory://``,
heartbeats of 0.2 s (leases of 1 s)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import uuid

import pytest
from lease_helpers import fresh_url, frozen, short_leases, stalling_deletes, take_over_and_commit  # noqa: F401

from arraycheckpoint.errors import CheckpointExistsError, StorageError
from arraycheckpoint.manager import CheckpointManager
from arraycheckpoint.storage import lease, locks, storage_for
from arraycheckpoint.storage.base import LOCK_KEY

HUGE = "1" + "0" * 400  # valid JSON, a Python int, no float


@pytest.mark.usefixtures("short_leases")
def test_an_abort_resumed_after_a_takeover_deletes_nothing_more() -> None:
    url = fresh_url()
    saver, final = storage_for(url)
    saver.check_target(final, False)
    saver.acquire(final, "failed-save")
    for i in range(6):
        saver.write(final, f"a/c.{i}", b"failed-save")
    frozen(saver)
    resume = threading.Event()
    deleted = stalling_deletes(saver, 2, resume)
    abort = threading.Thread(target=saver.abort, args=(final, final))
    abort.start()  # its lock still names it: it starts deleting, then stops (frozen) after two keys
    taker = take_over_and_commit(url, 6)
    resume.set()
    abort.join(30)
    assert len(deleted) == 2
    assert [taker.read(final, f"a/c.{i}") for i in range(6)] == [b"taker"] * 6 and taker.is_committed(final)


@pytest.mark.usefixtures("short_leases")
def test_clearing_resumed_after_a_takeover_deletes_nothing_more() -> None:
    url = fresh_url()
    first, final = storage_for(url)
    first.check_target(final, False)
    first.acquire(final, "first")
    for i in range(6):
        first.write(final, f"a/c.{i}", b"first")
    first.commit(final, final, False)
    first.release(final, "first")
    overwriter, _ = storage_for(url)
    frozen(overwriter)
    resume = threading.Event()
    deleted = stalling_deletes(overwriter, 3, resume)  # the marker(s), then a chunk or two
    errors: list[BaseException] = []

    def overwrite() -> None:
        try:
            overwriter.check_target(final, True)
            overwriter.acquire(final, "overwriter")
        except BaseException as e:  # noqa: BLE001 - asserted below
            errors.append(e)

    clearing = threading.Thread(target=overwrite)
    clearing.start()
    taker = take_over_and_commit(url, 6)
    resume.set()
    clearing.join(30)
    assert len(deleted) == 3
    assert errors and isinstance(errors[0], StorageError)  # the overwriting save fails: it stopped clearing
    assert [taker.read(final, f"a/c.{i}") for i in range(6)] == [b"taker"] * 6 and taker.is_committed(final)


def test_a_follower_judges_the_lease_by_the_clock_after_a_slow_read() -> None:
    """The lock read is answered 2.5 s late (the lease's time in it is as old as it was): the rank stops, since
    the lease is older than its safe part by the time the answer is there."""
    clock = [1000.0]
    terms = lease.Terms(1.0, 6.0)  # safe 5 s
    follower = lease.Follower("save", (999.0, terms), 0.0, clock=lambda: clock[0])
    doc = {**json.loads(lease.body("save", 999.0)), "heartbeat": 1.0, "lease": 6.0}

    def slow_read() -> bytes:
        clock[0] += 2.5
        return json.dumps(doc).encode()

    clock[0] = 1000.0 + terms.period  # its read is due; the lease is 4 s old then: still within its safe part
    with pytest.raises(StorageError, match="last refreshed 6.5 s ago"):
        follower.check(slow_read, "memory://x")

    clock[0] = 1000.0
    timed_out = lease.Follower("save", (999.0, terms), 0.0, clock=lambda: clock[0])
    clock[0] = 1000.0 + terms.period

    def no_answer() -> bytes:
        clock[0] += 2.5
        raise TimeoutError("no answer")

    with pytest.raises(StorageError, match="last refreshed 6.5 s ago"):
        timed_out.check(no_answer, "memory://x")


def test_a_lock_dated_far_in_the_future_is_a_crashed_saves() -> None:
    root = f"memory://future-{uuid.uuid4().hex[:8]}"
    storage, r = storage_for(root)
    step, other = storage.join(r, "step_00000001"), storage.join(r, "step_00000002")
    doc = {"token": "clock-wrong", "time": time.time() + 30 * 86400, "host": "elsewhere", "pid": 1}
    storage.write(step, LOCK_KEY, json.dumps(doc).encode())
    storage.write(other, LOCK_KEY, json.dumps(doc).encode())
    assert "in the future" in (lease.stale_reason(lease.parse(json.dumps(doc).encode())) or "")
    CheckpointManager(root)  # its cleanup removes it
    assert not storage.exists(step, LOCK_KEY)
    storage.write(other, LOCK_KEY, json.dumps(doc).encode())
    saver, final = storage_for(other)
    saver.check_target(final, False)
    saver.acquire(final, "next")  # taken over
    assert saver._lock_token(final) == "next"
    saver.release(final, "next")


@pytest.mark.parametrize("field", ["time", "heartbeat", "lease"])
def test_a_lock_document_with_a_huge_number_is_refused_not_an_overflow(field: str) -> None:
    doc = {
        "token": "other",
        "time": time.time(),
        "host": "elsewhere",
        "pid": 1,
        "heartbeat": 10.0,
        "lease": 60.0,
    }
    raw = json.dumps(doc).replace(json.dumps(doc[field]), HUGE, 1).encode()
    parsed = lease.parse(raw)
    assert parsed is not None and parsed[field] is None
    assert lease.stale_reason(parsed) is None  # unknown age (time), or this process's terms: a live lock
    follower = lease.Follower("other", None, 0.5)
    if field == "time":
        with pytest.raises(StorageError, match="could not be read"):  # the lease's age is unknown: no write
            follower.check(lambda: raw, "memory://x")
    else:
        follower.check(lambda: raw, "memory://x")  # this process's terms
    root = f"memory://hostile-{uuid.uuid4().hex[:8]}"
    storage, r = storage_for(root)
    step = storage.join(r, "step_00000001")
    storage.write(step, LOCK_KEY, raw)
    saver, final = storage_for(step)
    if field != "time":
        saver.check_target(final, False)
        with pytest.raises(CheckpointExistsError, match="in progress"):  # a live lease (60 s by default)
            saver.acquire(final, "new")
    CheckpointManager(root)  # starts: its cleanup reads the lock
    owner = json.loads(locks.owner_document(locks.this_owner("t")))
    assert locks.parse_owner(json.dumps(owner).replace(json.dumps(owner["heartbeat"]), HUGE).encode()) is None


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.mark.parametrize("world", [1, 2])
def test_a_lock_whose_process_is_gone_is_taken_over_at_once_only_for_a_one_rank_save(world: int) -> None:
    """Rank 0 of a two-rank save is gone (SIGKILL, OOM); rank 1, elsewhere, still writes under the lease it
    was granted: its lock waits out the lease. A one-rank save's lock is a crashed save's at once."""
    me = locks.this_owner("x")
    if not me.boot_id:
        pytest.skip("no boot id on this host: a holder's process is never known to be gone")
    doc = {**json.loads(lease.body("crashed")), "world": world, "pid": _dead_pid()}
    raw = json.dumps(doc).encode()
    gone = lease.stale_reason(lease.parse(raw))
    storage, final = storage_for(fresh_url())
    storage.write(final, LOCK_KEY, raw)
    storage.check_target(final, False)
    if world == 1:
        assert gone is not None and "is gone" in gone
        storage.acquire(final, "next")
        assert storage._lock_token(final) == "next"
        storage.release(final, "next")
    else:
        assert gone is None
        with pytest.raises(CheckpointExistsError):
            storage.acquire(final, "next")
        doc["time"] -= 3600  # its lease ran out
        assert "not refreshed" in (lease.stale_reason(lease.parse(json.dumps(doc).encode())) or "")


@pytest.mark.usefixtures("short_leases")
def test_a_multi_rank_saves_lock_says_its_world_after_every_refresh() -> None:
    """The refreshes rewrote the lock as a one-rank save's (``world`` 1): after the first heartbeat a dead
    rank 0's lock was taken over at once while its other ranks still wrote under their granted lease."""
    storage, final = storage_for(fresh_url())
    storage.check_target(final, False)
    storage.save_world = 8
    storage.acquire(final, "eight")
    try:
        first = json.loads(storage.read(final, LOCK_KEY))
        deadline = time.monotonic() + 10
        while json.loads(storage.read(final, LOCK_KEY))["time"] == first["time"]:  # a refresh landed
            assert time.monotonic() < deadline, "the lease was never refreshed"
            time.sleep(0.05)
        assert first["world"] == 8 and json.loads(storage.read(final, LOCK_KEY))["world"] == 8
    finally:
        storage.release(final, "eight")


def test_a_guarded_delete_is_not_sent_again_once_its_guard_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    """A delete under a lease (abort, clearing, cleanup) whose first attempt got no answer is retried only
    while its lease holds: the retry checks it first (a retried DELETE landed after another save took the
    step over and deleted that save's committed metadata)."""
    storage, final = storage_for(fresh_url())
    storage.write(final, "a/c.0", b"the next save's chunk")
    real_wait, sent, lease_ok = storage._wait, [], [True]

    def no_answer_once(future):  # the first DELETE is lost on its way; the lease runs out meanwhile
        sent.append(1)
        if len(sent) == 1:
            lease_ok[0] = False
            raise TimeoutError("no answer from the store")
        return real_wait(future)

    def guard() -> None:
        if not lease_ok[0]:
            raise StorageError("the lease may be taken over: this save deletes nothing more")

    monkeypatch.setattr(storage, "_wait", no_answer_once)
    with pytest.raises(StorageError, match="deletes nothing more"):
        storage.delete_key(final, "a/c.0", guard)
    assert len(sent) == 1
    monkeypatch.setattr(storage, "_wait", real_wait)
    assert storage.read(final, "a/c.0") == b"the next save's chunk"
