"""The lock reads of the ranks that write in place under rank 0's lease, at 10,000 simulated ranks on a
simulated clock (the followers' real code, :class:`arraycheckpoint.storage.lease.Follower`, with the clock
injected; rank 0 simulated as a holder refreshing every heartbeat interval).

With the default terms (heartbeat 10 s, lease 60 s: trust for 50 s, a read period of 30 s) no rank reads the
lock before its first write, and the 9,999 followers read it 9,999 / 30 s = 333 times a second, evenly: no
second sees more than 340 reads (the rule this replaced: 9,999 reads at once before the first writes, then
about 1,000 a second). When rank 0's refreshes stop, every follower stops writing once the lease is 50 s old,
before any save may take it over (60 s); refreshes that come late but come (30-40 s apart) stop none."""

from __future__ import annotations

import heapq
from collections import Counter

import pytest

from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage import lease, locks

WORLD = 10_000
TOKEN = "job-0"


@pytest.fixture(autouse=True)
def default_terms(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(locks.HEARTBEAT_ENV, raising=False)
    monkeypatch.delenv(locks.LEASE_ENV, raising=False)


class Sim:
    """A clock, rank 0's lock document as the store holds it (refreshed every 10 s at the times
    ``refreshes`` allows), and the followers' reads counted per simulated second."""

    def __init__(self, refreshes=lambda t: True) -> None:
        self.t = 0.0
        self.allowed = refreshes
        self.reads: Counter[int] = Counter()
        self.bodies: dict[float, bytes] = {}

    def last_refresh(self) -> float:
        k = int(self.t // 10)
        while k > 0 and not self.allowed(10.0 * k):
            k -= 1
        return 10.0 * k

    def read(self) -> bytes:
        self.reads[int(self.t)] += 1
        at = self.last_refresh()
        if at not in self.bodies:
            self.bodies[at] = lease.body(TOKEN, at)
        return self.bodies[at]

    def followers(self, world: int, start: float) -> list[lease.Follower]:
        """The followers of a save whose rank 0 took its lease at 0 and granted it at ``start``."""
        self.t = start
        grant = lease.granted((0 + 1, 60_000_000, 10_000_000))  # rank 0's grant: stored at 1 us, 60 s, 10 s
        return [lease.Follower(TOKEN, grant, lease.phase(r, world), lambda: self.t) for r in range(1, world)]

    def run(self, followers: list[lease.Follower], until: float) -> tuple[set[int], float]:
        """Every follower checks whenever a read is due (it writes all along): those that stopped, and the
        last time a check let one write on."""
        due = [(f.due, i) for i, f in enumerate(followers)]
        heapq.heapify(due)
        stopped: set[int] = set()
        last = 0.0
        while due and due[0][0] < until:
            self.t, i = heapq.heappop(due)
            try:
                followers[i].check(self.read, "s3://b/step_1")
            except StorageError:
                stopped.add(i)
                continue
            last = self.t
            heapq.heappush(due, (followers[i].due, i))
        return stopped, last


def test_ten_thousand_followers_read_evenly_and_never_before_their_first_write() -> None:
    sim = Sim()
    followers = sim.followers(WORLD, start=3.0)
    for f in followers:  # the first write of every rank right after the agreement: no read
        f.check(sim.read, "s3://b/step_1")
    assert sum(sim.reads.values()) == 0
    assert sim.run(followers, until=303.0)[0] == set()  # a healthy lease stops nobody
    per_second = [sim.reads[s] for s in range(3, 303)]
    rate = (WORLD - 1) / lease.own_terms().period
    assert lease.own_terms().period == 30.0 and round(rate) == 333
    assert max(per_second) <= 340, max(per_second)  # no burst, at the start or later
    assert min(per_second) >= 325, min(per_second)  # evenly spread
    assert sum(per_second) == pytest.approx(rate * 300, rel=0.01)


def test_followers_stop_before_a_lease_whose_refreshes_stopped_can_be_taken_over() -> None:
    sim = Sim(refreshes=lambda t: t <= 100)  # rank 0 stops refreshing after 100 s (stopped, cut off)
    followers = sim.followers(2_000, start=3.0)
    stopped, last = sim.run(followers, until=200.0)
    assert len(stopped) == len(followers)
    assert 100 + 40 < last <= 100 + 50  # some wrote on while it was safe, none past 50 s
    sim.t = 100 + 50.001  # a check of every follower past 50 s: none writes on, with or without a read due
    for f in followers:
        with pytest.raises(StorageError, match="last refreshed 50.0 s ago"):
            f.check(sim.read, "s3://b/step_1")
    # the reads of the late stretch: at most four per follower and period (the due read and three halvings)
    late = sum(n for s, n in sim.reads.items() if s >= 100)
    assert late <= 4 * len(followers) * 50 / 30


@pytest.mark.parametrize("gap", [30, 40])
def test_late_refreshes_that_come_stop_no_follower(gap: int) -> None:
    sim = Sim(refreshes=lambda t: not 100 < t < 100 + gap)  # refreshes missed (a slow store), then back
    followers = sim.followers(2_000, start=3.0)
    assert sim.run(followers, until=300.0)[0] == set()


def test_a_follower_without_a_grant_reads_before_its_first_write_and_one_naming_another_save_stops() -> None:
    sim = Sim()
    sim.t = 5.0
    f = lease.Follower(TOKEN, lease.granted(lease.NO_GRANT), 0.5, lambda: sim.t)
    f.check(sim.read, "s3://b/step_1")
    assert f.reads == 1
    other = lease.Follower("other-0", lease.granted((1, 60_000_000, 10_000_000)), 0.5, lambda: sim.t)
    sim.t = 40.0
    with pytest.raises(StorageError, match="names save job-0"):
        other.check(sim.read, "s3://b/step_1")


def test_a_follower_that_did_not_check_through_its_trust_reads_once_before_it_decides() -> None:
    sim = Sim()  # a healthy holder
    (f,) = sim.followers(2, start=3.0)
    sim.t = 3.0
    f.check(sim.read, "s3://b/step_1")  # the first write: no read
    sim.t = 120.0  # one write took two minutes: the trust granted ran out meanwhile
    f.check(sim.read, "s3://b/step_1")  # read, found refreshed: writes on
    assert f.reads == 1
    stopped = Sim(refreshes=lambda t: t <= 10)
    (g,) = stopped.followers(2, start=3.0)
    g.check(stopped.read, "s3://b/step_1")
    stopped.t = 120.0
    with pytest.raises(StorageError, match="last refreshed 110.0 s ago"):
        g.check(stopped.read, "s3://b/step_1")
    assert g.reads == 1
