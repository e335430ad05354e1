"""Range rules (FSDP1 flat ranges) and process meshes (JAX device meshes): expansion, checks, format.

The expansion is checked against an independent model (``torch.chunk`` over a flat ``arange``, jax-style
index arithmetic), the declaration against the boxes a rank really holds, the metadata parser against
hostile input. Plans built from these rules are compared with the reference planner in test_groupplan.py.
"""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from arraycheckpoint.engine.coordinate import build_metadata, declare
from arraycheckpoint.errors import MetadataError, PlanError
from arraycheckpoint.format.metadata import CheckpointMetadata
from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan
from arraycheckpoint.planning.items import ArraySource, SaveRequest, SaveShard, SaveTensor
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.planning.regions import Box, flat_range_to_boxes
from arraycheckpoint.planning.rules import MAX_FLAT_ELEMENTS, Mesh, mesh_regions, range_regions, rule_boxes


def _fsdp1_chunks(total: int, world: int) -> list[np.ndarray]:
    """What FSDP1's ``_get_unpadded_shard`` gives each rank of a flat space: ``torch.chunk``, empties after."""
    chunks = torch.arange(total).chunk(world)
    return [chunks[r].numpy() if r < len(chunks) else np.zeros(0, np.int64) for r in range(world)]


@pytest.mark.parametrize("seed", range(6))
def test_range_rule_holds_what_torch_chunk_gives_each_rank(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 9)
    shapes = [tuple(rng.randint(1, 7) for _ in range(rng.randint(0, 3))) for _ in range(5)]
    offsets, total = [], 0
    for s in shapes:
        total += rng.randint(0, 3)  # alignment padding between parameters
        offsets.append(total)
        total += int(np.prod(s))
    total += rng.randint(0, world)  # world-size padding at the end (numel need not divide)
    mesh = Mesh((world,), tuple(range(10, 10 + world)))  # group ranks need not start at 0
    chunks = _fsdp1_chunks(total, world)
    for s, off in zip(shapes, offsets):
        numel = int(np.prod(s))
        for r in range(world):
            got = rule_boxes(s, ("range", 0, off, total), (mesh,), 10 + r)
            mine = chunks[r][(chunks[r] >= off) & (chunks[r] < off + numel)] - off
            flat = np.arange(numel).reshape(s)
            held = np.concatenate([flat[b.slices()].ravel() for b in got]) if got else np.zeros(0)
            assert np.array_equal(held, mine), (s, off, total, r)
        regions = range_regions(s, mesh, off, total)
        for box, holders in regions.items():
            assert holders == [
                10 + r
                for r in range(world)
                if box in rule_boxes(s, ("range", 0, off, total), (mesh,), 10 + r)
            ]


def _item(name, shape, boxes, rule=None):
    data = np.zeros(shape, np.float32)
    return SaveTensor(
        name, shape, np.dtype(np.float32), [SaveShard(b, ArraySource(data[b.slices()])) for b in boxes], rule
    )


def test_declare_keeps_a_range_rule_only_where_it_matches_the_local_range():
    world, total = 4, 30
    mesh = Mesh((world,), (0, 1, 2, 3))
    shape = (5, 4)  # elements [6, 26) of the flat space
    for rank in range(world):
        held = rule_boxes(shape, ("range", 0, 6, total), (mesh,), rank)
        d = declare([_item("w", shape, held, ("range", mesh, 6, total))], rank)
        assert d.tensors[0].rule == ("range", 0, 6, total) and d.meshes == (mesh,)
    # rank 1 really holds another range (a different padding rule): it says so with boxes
    wrong = flat_range_to_boxes(shape, 0, 3)
    d = declare([_item("w", shape, wrong, ("range", mesh, 6, total))], 1)
    assert d.tensors[0].rule == ("boxes", tuple(wrong)) and d.meshes == ()
    # a rank outside the group's mesh never keeps the rule
    d = declare([_item("w", shape, [], ("range", mesh, 6, total))], 7)
    assert d.tensors[0].rule == ("boxes", ())


def test_identical_range_declarations_have_identical_digests():
    from arraycheckpoint.planning.rules import digest

    world, total = 6, 100
    mesh = Mesh((world,), tuple(range(world)))
    shapes = [(7, 3), (11,), (4, 5, 2)]
    offsets = [0, 21, 32]
    digests = set()
    for rank in range(world):
        items = [
            _item(f"t{i}", s, rule_boxes(s, ("range", 0, o, total), (mesh,), rank), ("range", mesh, o, total))
            for i, (s, o) in enumerate(zip(shapes, offsets))
        ]
        digests.add(digest(declare(items, rank).to_json()))
    assert len(digests) == 1  # one declaration stands for every rank: mode "local", nothing gathered


def test_process_mesh_boxes_are_every_device_box_of_the_process():
    # 2 processes x 4 devices, mesh (x=2, y=4), devices of process p at x == p; dim 0 split over (x, y)
    mesh = Mesh((2, 4), (0, 0, 0, 0, 1, 1, 1, 1))
    assert Mesh.from_json(mesh.to_json()) == mesh
    assert mesh.to_json()[1][0] == "affine"
    shape = (16, 3)
    got = rule_boxes(shape, ("mesh", 0, (0, 1)), (mesh,), 1)
    assert got == [Box((8, 0), (8, 1)), Box((8, 1), (8, 1)), Box((8, 2), (8, 1))]  # y=3: empty column
    # replicated over y: one box per process, listed once even though 4 devices hold it
    assert rule_boxes(shape, ("mesh", 0, (0, -1)), (mesh,), 0) == [Box((0, 0), (8, 3))]
    assert mesh_regions(shape, mesh, (0, -1)) == {Box((0, 0), (8, 3)): [0], Box((8, 0), (8, 3)): [1]}
    plan = build_compact_plan(
        [(Decl((mesh,), (TensorRule("w", shape, "float32", 4, ("mesh", 0, (0, -1))),)), (0, 1))], 2
    )
    assert plan.regions("w") == ((Box((0, 0), (8, 3)), 0), (Box((8, 0), (8, 3)), 1))


@pytest.mark.parametrize(
    "ranks,shape",
    [
        ((0, 0, 0, 0, 1, 1, 1, 1), (2, 4)),  # devices -> process, local devices innermost
        ((0, 1, 0, 1, 0, 1, 0, 1), (4, 2)),  # transposed
        ((3, 3, 5, 5, 7, 7), (3, 2)),  # strided sub-mesh
        (tuple(range(8)), (8,)),  # arange
        ((4, 2, 9, 1), (4,)),  # no pattern: the list
        (tuple((i // 8) * 2 + (j // 8) for i in range(32) for j in range(16)), (32, 16)),  # 2-D host blocks
    ],
)
def test_mesh_json_round_trip(ranks, shape):
    m = Mesh(shape, ranks)
    j = json.loads(json.dumps(m.to_json()))
    assert Mesh.from_json(j) == m
    assert len(json.dumps(j)) < 80 or j[1][0] == "list"


@pytest.mark.parametrize(
    "ranks",
    [
        ["affine", 0, [[0, 1]]],  # div 0
        ["affine", 0, [[9, 1]]],  # div beyond the axis
        ["affine", 0, [[1, 1 << 40]]],  # absurd stride
        ["affine", 5, [[1, -1]]],  # negative ranks
        ["affine", 0, [[1, 1], [1, 1]]],  # one pair per axis
        ["affine", True, [[1, 1]]],
        ["affine", 0],
    ],
)
def test_hostile_affine_meshes_are_refused(ranks):
    with pytest.raises(PlanError):
        Mesh.from_json([[8], ranks])


def _meta_with(rule, shape=(6, 4), total=40, world=4):
    mesh = Mesh((world,), tuple(range(world)))
    decl = Decl((mesh,), (TensorRule("model/w", shape, "float32", 4, rule),))
    plan = build_compact_plan([(decl, range(world))], world, PlanOptions(min_chunk_bytes=16))
    meta = build_metadata(plan, SaveRequest([], [], framework="torch"), [{} for _ in range(world)])
    return json.loads(meta.to_json()), plan


def test_range_rule_in_metadata_round_trip():
    doc, plan = _meta_with(("range", 0, 10, 40))
    assert doc["tensors"]["model/w"]["regions"] == [[0, ["range", 0, 10, 40]]]
    meta = CheckpointMetadata.from_json(json.dumps(doc))
    shards = meta.tensors["model/w"].shards
    assert [(Box(s.offsets, s.lengths), s.rank) for s in shards] == sorted(plan.regions("model/w"))
    # every element of the tensor is in exactly one region
    cover = np.zeros((6, 4), np.int64)
    for s in shards:
        cover[Box(s.offsets, s.lengths).slices()] += 1
    assert (cover == 1).all()


@pytest.mark.parametrize(
    "rule",
    [
        ["range", 0, 20, 40],  # the tensor (24 elements) runs past the flat space
        ["range", 0, -1, 40],
        ["range", 1, 0, 40],  # no such mesh
        ["range", 0, 0, MAX_FLAT_ELEMENTS + 1],  # absurd flat space
        ["range", 0, 0, True],
        ["range", 0, 0],
        ["range", 0, 0.5, 40],
    ],
)
def test_hostile_range_rules_are_refused_at_parse_time(rule):
    doc, _ = _meta_with(("range", 0, 10, 40))
    doc["tensors"]["model/w"]["regions"] = [[0, rule]]
    with pytest.raises(MetadataError, match="model/w"):
        CheckpointMetadata.from_json(json.dumps(doc))


def test_a_range_rule_over_a_huge_mesh_expands_only_the_parts_it_touches():
    # 4M ranks (the mesh bound), a flat space of 2^60 elements: the tensor touches two parts
    n = 1 << 22
    mesh = Mesh.from_json([[n], ["arange", 0]])
    total = 1 << 60
    size = total // n
    regions = range_regions((10,), mesh, size - 4, total)
    assert regions == {Box((0,), (4,)): [0], Box((4,), (6,)): [1]}
