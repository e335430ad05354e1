"""Worst-fit writers stored as the cyclic rule (format 8, ``"writers": ["cyclic", shift]``).

megatron's dense towers (qkv, out, norms, routers) are replicated over wide holder sets: a (PP, TP) position's
data-parallel replicas, or a whole stage. Their chunks are placed by worst fit (a shift of the cyclic rule is
not trusted to balance such sets by itself), and their writers used to be listed per chunk. Every position
carries the same load, so the worst fit goes round each set's holders in order: one shift states them. The
planner now stores such writers as the rule. The plan itself does not change (same writers, balance and
bytes moved); only the metadata shrinks, and a reader derives the same writers.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from arraycheckpoint.engine.coordinate import build_metadata
from arraycheckpoint.format.metadata import CheckpointMetadata
from arraycheckpoint.planning import owners
from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan
from arraycheckpoint.planning.items import SaveRequest
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.planning.regions import Box

TP, DP, LAYERS = 2, 40, 4  # 40 replicas per TP position: wider than the shifts the planner tries (32)
OPTIONS = PlanOptions(min_chunk_bytes=1 << 8, max_chunk_bytes=1 << 9, inner_chunk_bytes=1 << 6)


def _dense_towers(towers: int = 6) -> tuple[list[tuple[Decl, tuple[int, ...]]], int]:
    """TP 2 x DP 40 (megatron's dense grid, tp fastest): stacked column-parallel weights and their two Adam
    states (each TP position's half replicated over its 40 DP ranks, a few chunks per replica set) and a
    norm replicated on all 80 ranks, declared as megatron's boxes per TP position."""
    world = TP * DP
    groups = []
    for t in range(TP):
        rules = []
        for k in range(towers):
            for name, itemsize in ((f"model/t{k}.qkv", 2), (f"optimizer/t{k}.qkv/exp_avg", 4)):
                box = Box((0, 16 * t, 0), (LAYERS, 16, 16))
                dtype = "bfloat16" if itemsize == 2 else "float32"
                rules.append(TensorRule(name, (LAYERS, 32, 16), dtype, itemsize, ("boxes", (box,))))
            rules.append(TensorRule(f"model/t{k}.norm", (LAYERS, 64), "float32", 4, ("replica",)))
        groups.append((Decl((), tuple(rules)), tuple(t + TP * d for d in range(DP))))
    return groups, world


def _per_rank(plan) -> np.ndarray:
    out = np.zeros(plan.world, dtype=np.int64)
    for name, d in plan.tensors.items():
        nb = plan._classes[name].nbytes
        out += np.bincount(np.asarray(d.writers), weights=nb, minlength=plan.world).astype(np.int64)
    return out


def test_dense_tower_writers_are_the_worst_fits_stored_as_the_cyclic_rule(monkeypatch) -> None:
    groups, world = _dense_towers()
    plan = build_compact_plan(groups, world, OPTIONS)
    threshold = owners.RULED_MIN_CHUNKS
    request = SaveRequest([], [], framework="megatron")
    text = build_metadata(plan, request, [{} for _ in range(world)]).to_json()
    monkeypatch.setattr(owners, "RULED_MIN_CHUNKS", 1 << 40)  # the worst fit's writers, listed, as before
    listed = build_compact_plan(groups, world, OPTIONS)
    listed_text = build_metadata(listed, request, [{} for _ in range(world)]).to_json()

    ruled = [n for n, d in plan.tensors.items() if d.shift is not None]
    assert len(ruled) == len(plan.tensors) == 18, ruled  # every tensor: one shift states its writers
    by_rule = {n for n, d in listed.tensors.items() if d.shift is not None}  # placed by the rule before too
    assert by_rule == {f"optimizer/t{k}.qkv/exp_avg" for k in range(6)}, by_rule  # 128 chunks, 40 a set
    for name, d in plan.tensors.items():
        c = plan._classes[name]
        assert np.array_equal(d.writers, listed.tensors[name].writers), name  # the same plan
        for ci, w in enumerate(d.writers):  # written where it is held: no byte moves
            assert w in c.holders[int(c.choice[ci])]
        if name not in by_rule:  # the worst fit's writers (16 or 64 chunks, sets of 80 or 40), listed before
            assert not c.cycle.balances and threshold < len(d.writers) <= owners.CYCLIC_MIN_CHUNKS, name
            assert listed.tensors[name].shift is None and not listed.tensors[name].derived
    assert np.array_equal(_per_rank(plan), _per_rank(listed))  # the same balance, rank by rank
    assert plan.plan_id != listed.plan_id  # the encoding is part of what every rank agrees on

    doc = json.loads(text)
    assert all(doc["tensors"][n]["writers"] == ["cyclic", plan.tensors[n].shift] for n in ruled)
    assert len({plan.tensors[n].shift for n in ruled if n not in by_rule}) > 1  # the worst fit rotates
    parsed = CheckpointMetadata.from_json(text)
    for name, d in plan.tensors.items():
        assert np.array_equal(parsed.tensors[name].writers.array, d.writers), name
    before = json.loads(listed_text)["tensors"]
    for name in set(ruled) - by_rule:  # one rule of about 15 bytes instead of 2-3 bytes per chunk
        sizes = len(json.dumps(doc["tensors"][name]["writers"])), len(json.dumps(before[name]["writers"]))
        assert sizes[0] <= 16 and sizes[1] >= 3 * len(plan.tensors[name].writers), (name, sizes)
    assert len(text) < len(listed_text) - 1000, (len(text), len(listed_text))


def test_writers_no_shift_states_stay_listed() -> None:
    """Replicated chunks of unequal sizes: the worst fit fills the replicas that an earlier tensor left
    lighter first (``model/b`` goes 7, 8, 9, 7, 8, 9, 0, 1, ...), which no shift states: listed, as before.
    ``model/a`` is a rotation but has too few chunks to be worth a rule. A shift is only taken when it states
    every writer: two swapped, or one outside the holders, and there is none."""
    opts = PlanOptions(min_chunk_bytes=1 << 8, max_chunk_bytes=1 << 8, inner_chunk_bytes=1 << 6)
    world = 10
    decl = Decl(
        (),
        (
            TensorRule("model/a", (7, 16), "float32", 4, ("replica",)),  # 7 chunks of 64 bytes: ranks 0-6
            TensorRule("model/b", (13, 20), "float32", 4, ("replica",)),  # 26 chunks of 40 bytes
        ),
    )
    plan = build_compact_plan([(decl, tuple(range(world)))], world, opts)
    for name in ("model/a", "model/b"):
        d = plan.tensors[name]
        assert d.shift is None and not d.derived, name
    assert plan.tensors["model/a"].writers.tolist() == list(range(7))
    assert plan.tensors["model/b"].writers[:7].tolist() == [7, 8, 9, 7, 8, 9, 0]
    c = plan._classes["model/b"]
    rotation = c.cycle.writers(3)
    swapped = rotation.copy()
    swapped[[5, 6]] = swapped[[6, 5]]
    outside = rotation.copy()
    outside[0] = world + 1  # the first writer outside the holder set
    rows = np.stack([rotation, swapped, outside, plan.tensors["model/b"].writers])
    assert c.cycle.shifts_of(rows).tolist() == [3, -1, -1, -1]
    ruled = owners.Cycle.stated(
        [("r", c.cycle, rotation), ("s", c.cycle, swapped), ("x", c.cycle, outside[:8])]
    )
    assert ruled == {"r": 3}  # ``x``: 8 chunks, too few to be worth a rule


@pytest.mark.parametrize(
    ("choice", "holders"),
    [
        ([0, 1] * 10, [[0, 1], [0, 1, 2]]),  # the first chunk's set is not the widest
        ([2, 0, 1] * 10, [[0, 1], [0, 1, 2], [3, 4, 5, 6]]),  # a period of 12, 3 times the widest set
        ([0, 0, 1, 2] * 5, [[4], [0, 1, 2], [5, 6]]),  # a chunk with one holder first
    ],
)
def test_every_shift_of_holder_sets_of_unequal_sizes_is_found(choice, holders) -> None:
    """The writers under every shift up to the period of the holder sets' sizes are found, however the sets'
    sizes differ (before, the shift was derived modulo the first chunk's set's size only: ``[0, 1, -1, ...]``
    for the first case); a row no shift states (two writers swapped) is not."""
    cycle = owners.Cycle(np.asarray(choice), holders)
    period = int(np.lcm.reduce([len(h) for h in holders]))
    rows = np.stack([cycle.writers(s) for s in range(period)])
    swapped = rows[1].copy()
    swapped[[-1, -2]] = swapped[[-2, -1]]
    found = cycle.shifts_of(np.concatenate([rows, swapped[None]]))
    assert found.tolist() == [*range(period), -1]


@pytest.mark.parametrize("shift", [-1, 80, True, "3", 1.5])
def test_a_hostile_shift_on_a_dense_tower_is_refused_naming_it(shift) -> None:
    from arraycheckpoint.errors import MetadataError

    groups, world = _dense_towers(towers=1)
    plan = build_compact_plan(groups, world, OPTIONS)
    doc = json.loads(build_metadata(plan, SaveRequest([], [], framework="megatron"), [{}] * world).to_json())
    doc["tensors"]["model/t0.qkv"]["writers"] = ["cyclic", shift]
    with pytest.raises(MetadataError, match=r"model/t0\.qkv.*integer shift in \[0, 80\)"):
        CheckpointMetadata.from_json(json.dumps(doc))
