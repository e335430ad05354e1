"""The coordinator's metadata from per-rank objects the template form cannot hold (every rank's value differs
in its keys): one pass over the ranks' statuses, never a copy of the rank -> value mapping per rank
(O(world^2) at commit: 1.7 s of rank 0's commit at 10,000 simulated ranks, docs/scale.md)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from arraycheckpoint.engine import coordinate
from arraycheckpoint.engine.coordinate import build_metadata, declare, status_payload
from arraycheckpoint.format.metadata import CheckpointMetadata, ObjectMeta
from arraycheckpoint.planning.groupplan import build_compact_plan
from arraycheckpoint.planning.items import SaveObject, SaveRequest
from arraycheckpoint.planning.plan import PlanOptions

WORLD = 3000
NAMES = ("dataloader/state", "extra_state/rank_info")


def _value(name: str, rank: int) -> dict[str, Any]:
    return {"pos": rank * 7, f"worker_{rank % 13}": [rank, len(name)]}  # keys differ by rank: no template


def test_per_rank_objects_are_gathered_in_one_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    statuses = []
    for r in range(WORLD):
        objs = [SaveObject(n, _value(n, r), "rank") for n in NAMES]
        payload = status_payload(SaveRequest([], objs, framework="torch"), None, {}, r, WORLD)
        statuses.append(json.loads(payload))
    plan = build_compact_plan([(declare([], 0), tuple(range(WORLD)))], WORLD, PlanOptions())
    held: list[int] = []  # the size of every rank -> value mapping an ObjectMeta was built with

    class Counted(ObjectMeta):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            held.append(len(self.per_rank))

    monkeypatch.setattr(coordinate, "ObjectMeta", Counted)
    meta = build_metadata(plan, SaveRequest([], [], framework="torch"), statuses)
    # one mapping per name, built once: the old loop built WORLD of them per name (4.5 million entries here)
    assert sorted(held) == [WORLD] * len(NAMES)
    parsed = CheckpointMetadata.from_json(meta.to_json())
    for n in NAMES:
        per_rank = parsed.objects[n].per_rank
        assert sorted(per_rank) == list(range(WORLD))
        assert all(per_rank[r] == _value(n, r) for r in (0, 1, WORLD // 2, WORLD - 1))
