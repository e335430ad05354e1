"""Mesh rules on megatron's process grids (:mod:`arraycheckpoint.planning.grids`): pattern recognition, and
the control plane of an expert-parallel layout counted in bytes as the world grows.

An expert-parallel megatron layout gives every (PP, TP, EP) position different boxes: declared as boxes the
distinct declarations grow with the world and every one of them travels to every rank and into the metadata.
Declared as rules on the grids every rank of a stage declares the same thing, so what travels and what the
metadata holds stay flat as ranks grow (counted in bytes here, never timed).
"""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from arraycheckpoint.engine.coordinate import build_metadata, declare
from arraycheckpoint.planning.grids import Grid, GridRules, axis_steps
from arraycheckpoint.planning.groupplan import build_compact_plan
from arraycheckpoint.planning.items import SaveRequest, SaveShard, SaveTensor
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.planning.rules import digest, rule_boxes

TP, PP, EP, LAYERS, EXPERTS = 2, 2, 4, 4, 8
SHAPES = {  # stacked: the layer axis first, the experts' index second
    "qkv": (LAYERS, 12, 4),
    "router": (LAYERS, EXPERTS, 4),
    "fc1": (LAYERS, EXPERTS, 8, 4),
    "fc2": (LAYERS, EXPERTS, 4, 4),
}
OPTIONS = PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=4 << 10)


def _position(rank: int, world: int) -> tuple[int, ...]:
    stage = world // PP
    p, q = divmod(rank, stage)
    return p, q, stage, q % TP, q // TP, q % EP, q // EP


def _grids(rank: int, world: int) -> list[Grid]:
    """megatron's dense (tp-dp-pp) and expert (ep-edp-pp, expert TP 1) grids, as its process groups say."""
    p, q, stage, t, d, e, ed = _position(rank, world)
    pp = [i * stage + q for i in range(PP)]
    dense = {
        "tp": [p * stage + d * TP + i for i in range(TP)],
        "dp": [p * stage + i * TP + t for i in range(stage // TP)],
    }
    expert = {
        "ep": [p * stage + ed * EP + i for i in range(EP)],
        "edp": [p * stage + i * EP + e for i in range(stage // EP)],
    }
    grids = [
        Grid.from_groups(rank, world, {**dense, "pp": pp}),
        Grid.from_groups(rank, world, {**expert, "pp": pp}),
    ]
    assert all(g is not None for g in grids)
    return grids  # type: ignore[return-value]


def _boxes(rank: int, world: int, kind: str) -> list[Box]:
    """Rank ``rank``'s boxes of ``kind`` as megatron declares them: one per layer of its stage (and per local
    expert), the TP slice of qkv."""
    p, _q, _stage, t, _d, e, _ed = _position(rank, world)
    shape = SHAPES[kind]
    layers = range(p * LAYERS // PP, (p + 1) * LAYERS // PP)
    if kind == "qkv":
        rows = shape[1] // TP
        return [Box((x, t * rows, 0), (1, rows, shape[2])) for x in layers]
    if kind == "router":
        return [Box((x, 0, 0), (1, *shape[1:])) for x in layers]
    local = EXPERTS // EP
    rest = (0,) * (len(shape) - 2)
    return [Box((x, y, *rest), (1, 1, *shape[2:])) for x in layers for y in range(e * local, (e + 1) * local)]


def _declaration(rank: int, world: int, rules: bool):
    finder = GridRules(_grids(rank, world))
    items = []
    for kind, shape in SHAPES.items():
        boxes = _boxes(rank, world, kind)
        rule = finder.rule(shape, boxes, leading=2 if kind.startswith("fc") else 1) if rules else None
        items.append(
            SaveTensor(f"model/{kind}", shape, np.dtype("float32"), [SaveShard(b, None) for b in boxes], rule)
        )
    return declare(items, rank)


def _control(world: int, rules: bool) -> dict[str, int]:
    """Bytes of one save's declarations and metadata: the distinct declarations (what the coordinator
    broadcasts, compressed, when ranks differ; nothing when all agree) and the metadata JSON."""
    groups: dict[bytes, tuple] = {}
    for r in range(world):
        decl = _declaration(r, world, rules)
        key = digest(decl.to_json())
        groups.setdefault(key, (decl, []))[1].append(r)
    broadcast = 0
    if len(groups) > 1:
        text = json.dumps([d.to_json() for d, _r in groups.values()], separators=(",", ":")).encode()
        broadcast = len(zlib.compress(text))
    plan = build_compact_plan([(d, tuple(r)) for d, r in groups.values()], world, OPTIONS)
    meta = build_metadata(plan, SaveRequest([], [], framework="megatron"), [{} for _ in range(world)])
    return {"groups": len(groups), "broadcast": broadcast, "metadata": len(meta.to_json()), "plan": plan}


def test_rules_keep_control_bytes_flat_as_ranks_grow() -> None:
    small, large = _control(32, rules=True), _control(256, rules=True)
    assert small["groups"] == large["groups"] == 1 and large["broadcast"] == 0
    assert large["metadata"] <= small["metadata"] + 256  # a few digits longer, not per rank
    boxed_small, boxed_large = _control(32, rules=False), _control(256, rules=False)
    assert boxed_small["groups"] == boxed_large["groups"] == PP * EP  # (TP, EP) pairs x stages
    # as boxes the metadata names every group's ranks and boxes: it grows with the world
    assert boxed_large["metadata"] > large["metadata"] * 2 and boxed_large["broadcast"] > 0
    for name, d in large["plan"].tensors.items():  # rules and boxes: the same chunks by the same writers
        assert np.array_equal(np.asarray(d.writers), np.asarray(boxed_large["plan"].tensors[name].writers)), (
            name
        )


def test_every_rank_declares_the_same_rules() -> None:
    world = 64
    first = digest(_declaration(0, world, True).to_json())
    assert all(digest(_declaration(r, world, True).to_json()) == first for r in range(world))
    assert all(t.rule[0] in ("mesh", "replica") for t in _declaration(5, world, True).tensors)


@pytest.mark.parametrize(
    ("extent", "cells", "steps"),
    [
        (8, [(0, 8)], []),
        (8, [(2, 2)], [("grid", 4, 1)]),
        (8, [(4, 1), (5, 1), (6, 1), (7, 1)], [("grid", 2, 1), ("repeat", 4)]),
        (8, [(1, 1), (5, 1)], [("repeat", 2), ("grid", 4, 1)]),  # a gated fc1's two halves at TP 4
        (8, [(0, 1), (1, 1)], [("grid", 4, 0), ("repeat", 2)]),
        (8, [(0, 1), (3, 1)], None),
        (9, [(0, 2)], None),
        # interleaved virtual pipeline: PP 2 x VP 2, two layers a chunk; stage 1 holds layers 2, 3, 6, 7
        (8, [(2, 1), (3, 1), (6, 1), (7, 1)], [("repeat", 2), ("grid", 2, 1), ("repeat", 2)]),
        (16, [(9, 1), (13, 1)], [("grid", 2, 1), ("repeat", 2), ("grid", 4, 1)]),
        (8, [(1, 1), (2, 1), (5, 1), (6, 1)], None),  # runs that straddle their parts
        (8, [(0, 1), (1, 1), (4, 1)], None),  # runs of different lengths
    ],
)
def test_axis_patterns(extent: int, cells: list, steps: list | None) -> None:
    assert axis_steps(extent, cells) == steps


def test_rule_states_exactly_the_boxes_and_refuses_other_patterns() -> None:
    grid = Grid.from_groups(5, 8, {"tp": [4, 5, 6, 7], "dp": [1, 5]})
    assert grid is not None and grid.names == ("dp", "tp") and grid.coords == (1, 1)
    rules = GridRules([grid])
    glu = [Box((2, 0), (2, 4)), Box((10, 0), (2, 4))]  # tp 1 of 4, both halves
    rule = rules.rule((16, 4), glu)
    assert rule is not None and set(rule_boxes((16, 4), ("mesh", 0, rule[2]), [rule[1]], 5)) == set(glu)
    assert rules.rule((16, 4), [Box((0, 0), (16, 4))]) is None  # the whole tensor: a replica
    assert rules.rule((16, 4), [Box((0, 0), (3, 4))]) is None  # no even split
    # 2 parts: dp has 2, but this rank is at dp 1, not 0 (a claim about itself that would be false)
    assert rules.rule((16, 4), [Box((0, 0), (8, 4))]) is None
    half = rules.rule((16, 4), [Box((8, 0), (8, 4))])
    assert half is not None and half[2] == (0, -1)  # split over dp, replicated over tp
    assert Grid.from_groups(0, 8, {"tp": [0, 1], "dp": [0, 3]}) is None  # does not tile the world


def test_grid_refuses_groups_that_do_not_tile_the_world() -> None:
    assert Grid.from_groups(0, 4, {"tp": [0, 2, 1]}) is None
    assert Grid.from_groups(0, 4, {"tp": [1, 2]}) is None  # the rank is not in its own group
    assert Grid.from_groups(0, 6, {"tp": [0, 1], "dp": [0, 2]}) is None  # 4 positions for 6 ranks


def test_meshes_a_reader_would_refuse_are_never_planned(monkeypatch: pytest.MonkeyPatch) -> None:
    """Readers accept MAX_MESH_RANKS mesh positions over all layout groups: the planner refuses more before
    anything is written, and a rank's grid rules keep to a budget (boxes past it)."""
    from arraycheckpoint.errors import PlanError
    from arraycheckpoint.planning import grids, groupplan

    world = 64
    decl = _declaration(0, world, True)
    positions = sum(len(m.ranks) for m in decl.meshes)
    monkeypatch.setattr(groupplan, "MAX_MESH_RANKS", positions - 1)
    with pytest.raises(PlanError, match="rank positions in all"):
        build_compact_plan([(decl, tuple(range(world)))], world, OPTIONS)
    monkeypatch.setattr(
        grids, "MESH_POSITIONS_BUDGET", world * 2
    )  # room for the dense mesh, not the experts'
    kinds = {t.name: t.rule[0] for t in _declaration(0, world, True).tensors}
    assert kinds["model/qkv"] == "mesh" and kinds["model/fc1"] == "boxes", kinds


def test_split_over_two_grid_dimensions_that_flatten() -> None:
    """An axis split over TP x DP (megatron's TP-DP group order: ``dp * tp_size + tp``) is a mesh rule with both
    dimensions on that axis, the same on every rank; dimensions that do not flatten into one are refused."""
    world, tp, dp = 16, 2, 4  # pp 2 outermost

    def grid(rank: int) -> Grid:
        p, q = divmod(rank, tp * dp)
        t, d = q % tp, q // tp
        got = Grid.from_groups(
            rank,
            world,
            {
                "tp": [p * 8 + d * tp + i for i in range(tp)],
                "dp": [p * 8 + i * tp + t for i in range(dp)],
                "pp": [i * 8 + q for i in range(2)],
            },
        )
        assert got is not None
        return got

    shape = (32, 4)
    rules = set()
    for rank in range(world):
        q = rank % 8
        box = Box((4 * q, 0), (4, 4))
        rule = GridRules([grid(rank)]).rule(shape, [box])
        assert rule is not None, rank
        assert rule_boxes(shape, ("mesh", 0, rule[2]), [rule[1]], rank) == [box]
        rules.add((rule[1], rule[2]))
    assert len(rules) == 1 and next(iter(rules))[1] == (0, 0, -1)  # dp then tp on axis 0, pp replicated
    # over pp x tp (strides 8 and 1: no flattening) there is no rule, even where the coordinates fit
    assert GridRules([grid(9)]).rule(shape, [Box((12, 0), (4, 4))]) is None


def test_hand_built_blocks_declare_a_rule_on_the_world() -> None:
    """No grid: a block that is the rank's ``torch.chunk`` part of the world along one axis is declared as a
    mesh rule on the world's 1-D grid (the same on every rank); any other block stays boxes."""
    world, shape = 4, (10, 3)
    f32 = np.dtype("float32")

    def decl(rank: int, box: Box, with_world: bool = True):
        item = SaveTensor("w", shape, f32, [SaveShard(box, None)])
        return declare([item], rank, world if with_world else None)

    parts = [(0, 3), (3, 3), (6, 3), (9, 1)]  # torch.chunk(10, 4): the last part short
    decls = [decl(r, Box((o, 0), (n, 3))) for r, (o, n) in enumerate(parts)]
    assert len({digest(d.to_json()) for d in decls}) == 1 and decls[0].tensors[0].rule == ("mesh", 0, (0,))
    assert decls[0].meshes[0].ranks == tuple(range(world))
    assert decl(2, Box((6, 0), (2, 3))).tensors[0].rule[0] == "boxes"  # array_split's part: not the rule's
    assert decl(1, Box((3, 0), (3, 2))).tensors[0].rule[0] == "boxes"  # split along two axes
    assert decl(1, Box((3, 0), (3, 3)), with_world=False).tensors[0].rule[0] == "boxes"
    # a split into fewer parts than ranks: the rank holding nothing declares the same rule
    small = [
        SaveTensor("s", (3, 2), f32, [SaveShard(Box((r, 0), (1, 2)), None)] if r < 3 else [])
        for r in range(4)
    ]
    assert len({digest(declare([t], r, world).to_json()) for r, t in enumerate(small)}) == 1


def test_the_positions_budget_is_per_declaration(monkeypatch: pytest.MonkeyPatch) -> None:
    """The grids' rule finder is kept across saves (megatron_grid): the meshes an earlier save used counted
    against every later save's budget, so a later small declaration got no rule at all (session 20 review)."""
    from arraycheckpoint.planning import grids as grids_mod

    monkeypatch.setattr(grids_mod, "MESH_POSITIONS_BUDGET", 64)
    grid = Grid.from_groups(1, 16, {"tp": [0, 1, 2, 3], "dp": [1, 5, 9, 13]})  # rank 1 of TP 4 x DP 4
    rules = GridRules([grid])
    rules.begin()  # save 1: a 4-layer stacked weight, a mesh of 16 x 4 = 64 positions (the whole budget)
    assert rules.rule((4, 8, 8), [Box((layer, 2, 0), (1, 2, 8)) for layer in range(4)], leading=1)
    assert rules.rule((8, 8), [Box((2, 0), (2, 8))]) is None  # within one declaration the budget holds
    rules.begin()  # save 2: a TP-split weight alone (16 positions)
    assert rules.rule((8, 8), [Box((2, 0), (2, 8))]) is not None


def _replicated_experts(layers: int) -> tuple:
    """A stacked expert weight ``(layers, 8 experts, 4, 4)`` on 16 ranks: EP 4 splits the experts, each
    expert-parallel position replicated over 4 expert data-parallel ranks (mesh rule), and its plan."""
    from arraycheckpoint.planning.groupplan import Decl, TensorRule
    from arraycheckpoint.planning.rules import Mesh

    mesh = Mesh((4, 4), tuple(range(16)))
    shape = (layers, 8, 4, 4)
    decl = Decl((mesh,), (TensorRule("model/fc1", shape, "float32", 4, ("mesh", 0, (1, -1))),))
    opts = PlanOptions(min_chunk_bytes=1 << 8, max_chunk_bytes=1 << 8, inner_chunk_bytes=1 << 6)
    return build_compact_plan([(decl, tuple(range(16)))], 16, opts)


def test_replicated_writers_follow_the_cyclic_rule_and_metadata_stays_flat() -> None:
    """Format 8: a tensor with more than CYCLIC_MIN_CHUNKS replicated chunks stores ``["cyclic", shift]``
    instead of one writer per chunk; a reader derives the same writers, each a holder of its chunk, and every
    replica set's chunks are spread evenly over its holders. Four times the chunks: the same metadata size."""
    from arraycheckpoint.format.metadata import CheckpointMetadata
    from arraycheckpoint.planning.owners import CYCLIC_MIN_CHUNKS

    sizes = {}
    for layers in (16, 64):
        plan = _replicated_experts(layers)
        d, c = plan.tensors["model/fc1"], plan._classes["model/fc1"]
        assert len(d.writers) > CYCLIC_MIN_CHUNKS and d.derived and d.shift is not None
        meta = build_metadata(plan, SaveRequest([], [], framework="megatron"), [{} for _ in range(16)])
        text = meta.to_json()
        assert json.loads(text)["tensors"]["model/fc1"]["writers"] == ["cyclic", d.shift]
        sizes[layers] = len(text)
        got = CheckpointMetadata.from_json(text).tensors["model/fc1"].writers
        assert np.array_equal(got.array, d.writers)
        per_rank = np.zeros(16, dtype=np.int64)
        for ci, w in enumerate(d.writers):
            assert w in c.holders[int(c.choice[ci])], ci  # written where it is held: nothing moves
            per_rank[w] += 1
        assert per_rank.max() - per_rank.min() <= 1, per_rank  # each replica set's chunks spread evenly
    assert abs(sizes[64] - sizes[16]) < 16, sizes  # listed: about 3 bytes more per chunk


def test_split_over_three_grid_dimensions_that_flatten() -> None:
    """An axis split over TP x CP x DP (megatron's dense grid order tp-cp-dp-pp: the combined TP-CP-DP group's
    rank order ``(dp * cp_size + cp) * tp_size + tp``), replicated over PP: one mesh rule with the three
    dimensions on that axis (dp, cp, tp), the same on all 16 ranks, stating exactly each rank's box; a chain
    with a gap (dp x tp without cp) is no rule."""
    world, tp, cp, dp, pp = 16, 2, 2, 2, 2

    def grid(rank: int) -> Grid:
        p, q = divmod(rank, tp * cp * dp)
        t, c, d = q % tp, (q // tp) % cp, q // (tp * cp)
        base = p * tp * cp * dp
        got = Grid.from_groups(
            rank,
            world,
            {
                "tp": [base + d * tp * cp + c * tp + i for i in range(tp)],
                "cp": [base + d * tp * cp + i * tp + t for i in range(cp)],
                "dp": [base + i * tp * cp + c * tp + t for i in range(dp)],
                "pp": [i * tp * cp * dp + q for i in range(pp)],
            },
        )
        assert got is not None
        return got

    shape = (16, 3)
    rules = set()
    for rank in range(world):
        q = rank % 8
        box = Box((2 * q, 0), (2, 3))
        rule = GridRules([grid(rank)]).rule(shape, [box])
        assert rule is not None, rank
        assert rule_boxes(shape, ("mesh", 0, rule[2]), [rule[1]], rank) == [box]
        rules.add((rule[1], rule[2]))
    assert len(rules) == 1
    mesh, placements = next(iter(rules))
    assert placements == (0, 0, 0, -1) and mesh.shape == (dp, cp, tp, pp), (mesh.shape, placements)
    # rows over dp x tp only (cp replicated): dp's stride is not tp's times its size, so no chain, and no
    # other dimensions give rank 5 (t 1, c 0, d 1) the part d * tp + t = 3 of 4
    assert GridRules([grid(5)]).rule((8, 3), [Box((6, 0), (2, 3))]) is None


def test_wide_replica_sets_with_few_chunks_keep_the_worst_fit() -> None:
    """400 replicas of a tensor of 320 chunks: a shift cannot place each chunk on the least loaded of 400
    holders as the worst fit does (and not every shift is tried), so the worst fit places them; here (the
    first tensor, every holder unloaded) it goes round the holders in order, so the metadata stores its
    writers as the rule that states them (``tests/control/test_ruled_worst_fit.py``). With 40 replicas each
    holder gets eight chunks of it, and the rule places them, balanced."""
    from arraycheckpoint.planning import owners
    from arraycheckpoint.planning.groupplan import Decl, TensorRule

    opts = PlanOptions(min_chunk_bytes=1 << 8, max_chunk_bytes=1 << 8, inner_chunk_bytes=1 << 6)
    for world, ruled in ((400, False), (40, True)):
        decl = Decl((), (TensorRule("model/w", (80, 64), "float32", 4, ("replica",)),))
        plan = build_compact_plan([(decl, tuple(range(world)))], world, opts)
        d = plan.tensors["model/w"]
        assert len(d.writers) == 320 and plan._classes["model/w"].cycle.balances == ruled, world
        assert d.shift == 0 and d.writers.tolist() == [r % world for r in range(320)], world
        counts = np.bincount(np.asarray(d.writers), minlength=world)
        assert counts.max() - counts.min() <= 1, counts
    assert owners.SHIFT_CANDIDATES < 400
