"""A rank whose commit status is not what a rank sends (simulated through the Communicator seam) fails the save
on every rank, naming that rank, with nothing committed: rank 0 still aborts and broadcasts the outcome.

Rank 0 used to raise a bare JSONDecodeError/AttributeError/RecursionError out of the commit before the outcome broadcast: the
other ranks waited for it until their liveness timeout, the save's lock and staging were left behind, and a
status whose metrics were not an object was committed into the metrics sidecar."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from simworld import SimCommunicator, SimWorld, run_ranks  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.storage.localnames import lock_path


class _LyingRank(SimCommunicator):
    """Rank 1 sends ``bad`` as its commit status instead of the one the engine made."""

    bad = b""

    def gather_with_values(self, values, data, dst=0):  # type: ignore[no-untyped-def]
        return super().gather_with_values(values, self.bad if self.rank == 1 else data, dst)


@pytest.mark.parametrize(
    "bad",
    [
        b"{not json",
        b"\xff\xfe",
        b"[1,2]",
        b'{"error": 5}',
        b'{"objects": 5}',
        b'{"metrics": 5}',
        b'{"objects": {"x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}",
    ],
    ids=[
        "not-json",
        "not-utf8",
        "a-list",
        "error-number",
        "objects-number",
        "metrics-number",
        "nested-100000",
    ],
)
def test_malformed_status_fails_every_rank_naming_it(tmp_path: Path, bad: bytes) -> None:
    world = SimWorld(2, timeout=60)
    path = tmp_path / "ck"

    def save(comm: SimCommunicator) -> str:
        liar = _LyingRank(world, comm.rank)
        liar.bad = bad
        with pytest.raises(acp.SaveFailedError) as e:
            acp.save(path, {"model": {"w": np.arange(8.0)}}, comm=liar)
        return str(e.value)

    messages = run_ranks(2, save, world=world)
    for m in messages:
        assert "rank 1 sent a malformed commit status" in m and "was not committed" in m, m
        assert "lost contact" not in m, m  # rank 0 broadcast the outcome: nobody waited for a timeout
    assert not path.exists()
    assert not lock_path(tmp_path / "ck").exists()  # the save's lock was released
    assert sorted(os.listdir(tmp_path)) == []  # and its staging removed
