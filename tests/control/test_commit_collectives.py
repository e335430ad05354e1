"""The commit of a save is two collectives: one gather of every rank's verdict, plan id and status, one
broadcast of the outcome.

Real gloo processes: the gather carries small statuses inline and larger ones (a per-rank document of 20 KB)
point to point, in a small world and in one treated as large (no inline room: every status point to point);
``gather_with_values`` gives each rank's values and payload back exactly at any destination; a cached save
issues exactly three collectives (the agreement before the snapshot, the status gather, the outcome), where
it issued six before; and the per-rank documents that travelled each way load back exactly.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.format.perrank import PerRank
from arraycheckpoint.runtime import collectives


def _note(rank: int) -> dict[str, Any]:
    # rank 1's document is longer than the gather's inline room, and the ranks' keys differ (no template)
    return {"text": ("x" * 20_000 if rank == 1 else "short") + str(rank), f"only_{rank}": rank}


def _body(rank: int, world: int, root: str, inline_world: int) -> dict[str, Any]:
    saved_inline = collectives.INLINE_WORLD
    collectives.INLINE_WORLD = inline_world
    calls: Counter[str] = Counter()
    cls = collectives.TorchCommunicator
    orig = cls._call

    def counted(self: Any, start: Any, what: str) -> None:
        calls[what] += 1
        orig(self, start, what)

    cls._call = counted  # type: ignore[method-assign]
    try:
        comm = collectives.default_communicator()
        out: dict[str, Any] = {"gathered": {}}
        for dst in range(world):
            payload = bytes([rank]) * (0 if rank == 2 else 30_000 if rank == dst + 1 else 7 + rank)
            got = comm.gather_with_values([rank, -(2**62) - rank], payload, dst=dst)
            if rank == dst:
                assert got is not None
                rows, payloads = got
                out["gathered"][dst] = (rows.tolist(), [(len(p), set(p)) for p in payloads])
            else:
                assert got is None
        weight = torch.arange(64, dtype=torch.float32)
        for i in range(2):  # the second save reuses the first one's plan
            calls.clear()
            acp.save(f"{root}/{inline_world}/w{i}", {"w": weight})
        out["calls"] = dict(calls)
        # per-rank documents with different keys travel in the statuses (rank 1's beyond the inline room)
        state = {"w": weight, "extra_state": {"note": PerRank(_note(rank))}}
        acp.save(f"{root}/{inline_world}/notes", state)
        back = {"w": torch.zeros(64), "extra_state": {"note": PerRank()}}
        acp.load(f"{root}/{inline_world}/notes", back)
        out["note"] = back["extra_state"]["note"].value
        out["weight_equal"] = torch.equal(back["w"], weight)
        return out
    finally:
        cls._call = orig  # type: ignore[method-assign]
        collectives.INLINE_WORLD = saved_inline


def test_commit_is_one_gather_and_one_broadcast_with_big_statuses_point_to_point(tmp_path) -> None:
    for inline_world in (64, 1):  # the statuses inline (at most rank 1's point to point), then none inline
        res = run_distributed(_body, world=3, args=(str(tmp_path), inline_world))
        for rank, r in enumerate(res):
            assert r["note"] == _note(rank) and r["weight_equal"]
            p2p = r["calls"].pop("the checkpoint fragment exchange", 0)
            # a cached save: the agreement, the status gather, the outcome (it was six collectives)
            assert r["calls"] == {
                "the checkpoint agreement": 1,
                "the checkpoint status gather": 1,
                "a checkpoint broadcast": 1,
            }, (inline_world, rank, r["calls"])
            # statuses inline in a small world; with no inline room each rank's status (its metrics) goes
            # point to point to the coordinator
            assert p2p == (0 if inline_world == 64 else 1), (inline_world, rank, p2p)
            got_rows, got_payloads = r["gathered"][rank]
            assert got_rows == [[s, -(2**62) - s] for s in range(3)]
            want = [0 if s == 2 else 30_000 if s == rank + 1 else 7 + s for s in range(3)]
            assert got_payloads == [(n, {s} if n else set()) for s, n in enumerate(want)]
