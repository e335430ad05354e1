"""Hostile format-7 metadata whose writers a reader derives (``"writers": "held"``): a few hundred bytes of
layout rule can name millions of regions, so deriving must stay linear in regions and chunks, and bounded over
the whole checkpoint; regions that do not cut the tensor exactly are refused naming the tensor. In process, on
metadata documents only (no tensor bytes)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from arraycheckpoint.errors import MetadataError
from arraycheckpoint.format.metadata import CheckpointMetadata
from arraycheckpoint.planning import flatgrid, plan


def _doc(world: int, tensors: dict[str, dict]) -> dict:
    """A format-7 metadata document: one layout group of ``world`` ranks over a 1-D mesh of all of them."""
    return {
        "format_version": 7,
        "framework": "torch",
        "world_size": world,
        "layout_groups": [{"meshes": [[[world], ["arange", 0]]], "ranks": [[0, world, 1]]}],
        "tensors": tensors,
        "objects": {},
    }


def _count_intersections(monkeypatch, real, *modules) -> list[int]:
    """Count the calls of ``real`` (a box intersection) through ``modules``' ``intersect``: ``[calls]``."""
    calls = [0]

    def counting(a, b):
        calls[0] += 1
        return real(a, b)

    for module in modules:
        monkeypatch.setattr(module, "intersect", counting)
    return calls


def _held(shape: list[int], chunk: list[int], regions: list) -> dict:
    return {
        "shape": shape,
        "dtype": "float32",
        "chunk_shape": chunk,
        "inner_chunk_shape": chunk,
        "compression": None,
        "regions": regions,
        "writers": "held",
    }


def test_column_split_writers_are_derived_in_linear_time(monkeypatch):
    """A tensor split by columns over 2,000 ranks (a 1-KB mesh rule): every region starts at row 0, so a
    check of overlaps sorted by rows compares every pair (2 M box intersections: 2 s here, 5,000 s at 100,000
    ranks). The partition is checked in whole chunks instead: no pairwise comparison at all."""
    world = 2000
    calls = _count_intersections(monkeypatch, plan.intersect, plan, flatgrid)
    doc = _doc(world, {"model/w": _held([1, 2 * world], [1, 2], [[0, ["mesh", 0, [1]]]])})
    writers = CheckpointMetadata.from_json(json.dumps(doc)).tensors["model/w"].writers
    assert np.array_equal(writers.array, np.arange(world))
    assert calls[0] <= world, calls[0]


@pytest.mark.parametrize(
    "shape, chunk, boxes, why",
    [
        # a nested grid: chunks counted with repeats (too many: overlap; too few: a hole)
        ([8, 4], [2, 4], [[[0, 0], [4, 4]], [[2, 0], [6, 4]]], "overlap or do not cover"),
        ([8, 4], [2, 4], [[[0, 0], [4, 4]], [[6, 0], [2, 4]]], "overlap or do not cover"),
        # as many chunks as the grid has, one held twice and one by none
        ([8, 4], [2, 4], [[[0, 0], [4, 4]], [[2, 0], [2, 4]], [[6, 0], [2, 4]]], "overlap and do not cover"),
        # flat runs (a grid of half rows that no region boundary nests in): ranges overlapping, or a gap
        ([4, 4], [1, 2], [[[0, 0], [1, 4]], [[0, 3], [1, 1]], [[1, 0], [3, 4]]], "flattened tensor, overlap"),
        ([4, 4], [1, 2], [[[0, 0], [1, 3]], [[1, 0], [3, 4]]], "flattened tensor, overlap"),
    ],
)
def test_regions_not_cutting_the_tensor_exactly_are_refused(shape, chunk, boxes, why):
    doc = _doc(1, {"model/w": _held(shape, chunk, [[0, ["boxes", boxes]]])})
    meta = CheckpointMetadata.from_json(json.dumps(doc))
    with pytest.raises(MetadataError, match=f"model/w.*{why}"):
        _ = meta.tensors["model/w"].writers.array


def test_verify_checks_a_column_split_in_linear_time(monkeypatch):
    """``verify``'s coverage check of the same column split, writers listed (any format): swept by rows,
    every pair of regions was compared (25 s at 8,000 ranks); swept along the dimension cut most, each region
    meets one other."""
    from arraycheckpoint.tools import verify

    world = 2000
    calls = _count_intersections(monkeypatch, verify.intersect, verify)
    tensor = _held([1, 2 * world], [1, 2], [[0, ["mesh", 0, [1]]]])
    doc = _doc(world, {"model/w": {**tensor, "writers": list(range(world))}})
    meta = CheckpointMetadata.from_json(json.dumps(doc))
    assert verify.uncovered(meta.tensors["model/w"]) == []
    assert calls[0] <= 2 * world, calls[0]
    # a hole among them is still found (the boxes are no longer disjoint in volume: the exact sweep)
    doc["tensors"]["model/w"]["regions"] = [
        [0, ["boxes", [[[0, 0], [1, 10]], [[0, 12], [1, 2 * world - 12]]]]]
    ]
    holes = verify.uncovered(CheckpointMetadata.from_json(json.dumps(doc)).tensors["model/w"])
    assert [(h.offsets, h.lengths) for h in holes] == [((0, 10), (1, 2))]


def test_rank_visits_of_derived_writers_are_bounded_over_the_checkpoint():
    """A 30-byte mesh rule of 4M ranks costs a reader 4M rank visits (seconds) per distinct shape it derives:
    the visits are bounded over the whole checkpoint and refused while parsing, naming the tensor, before
    any is derived."""
    from arraycheckpoint.checks.bounds import MAX_DERIVED_RANK_VISITS
    from arraycheckpoint.planning.rules import MAX_MESH_RANKS

    world = MAX_MESH_RANKS
    per_tensor = 2 * world  # the group's ranks and its mesh's
    k = MAX_DERIVED_RANK_VISITS // per_tensor + 1
    tensors = {f"model/w{i}": _held([4 + i], [1], [[0, ["mesh", 0, [0]]]]) for i in range(k)}
    with pytest.raises(MetadataError, match=f"model/w{k - 1}.*visits more than"):
        CheckpointMetadata.from_json(json.dumps(_doc(world, tensors)))
    del tensors[f"model/w{k - 1}"]
    meta = CheckpointMetadata.from_json(json.dumps(_doc(world, tensors)))
    assert meta.tensors["model/w0"].writers.derived


def test_a_save_lists_the_writers_past_the_rank_visit_bound(monkeypatch):
    """The planner counts the visits a reader counts and lists the writers of the layouts past the bound:
    a reader with the same bound parses the metadata and reads every writer equal to the plan's."""
    from arraycheckpoint.checks import bounds
    from arraycheckpoint.engine.coordinate import build_metadata
    from arraycheckpoint.planning import groupplan
    from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan
    from arraycheckpoint.planning.items import SaveRequest
    from arraycheckpoint.planning.plan import PlanOptions
    from arraycheckpoint.planning.rules import Mesh

    world = 16
    rules = tuple(
        TensorRule(f"model/p{i}", (64 + 16 * i, 8), "float32", 4, ("mesh", 0, (0,))) for i in range(6)
    )
    groups = [(Decl((Mesh((world,), tuple(range(world))),), rules), tuple(range(world)))]
    limit = 3 * 2 * world  # three layouts' worth: the group's 16 ranks and the mesh's 16, each
    monkeypatch.setattr(groupplan, "MAX_DERIVED_RANK_VISITS", limit)
    monkeypatch.setattr(bounds, "MAX_DERIVED_RANK_VISITS", limit)
    plan = build_compact_plan(groups, world, PlanOptions(min_chunk_bytes=64, max_chunk_bytes=256))
    derived = sorted(n for n, d in plan.tensors.items() if d.derived)
    assert derived == ["model/p0", "model/p1", "model/p2"], derived
    text = build_metadata(plan, SaveRequest([], [], framework="fsdp"), [{} for _ in range(world)]).to_json()
    parsed = CheckpointMetadata.from_json(text)
    for name, d in plan.tensors.items():
        assert getattr(parsed.tensors[name].writers, "derived", False) == (name in derived)
        assert np.array_equal(np.asarray(list(parsed.tensors[name].writers)), d.writers), name


def test_expanded_regions_are_bounded_over_the_checkpoint_and_shared(monkeypatch):
    """Tools list every tensor's saved regions (expanded from its rules): each distinct layout once, the
    ranks visited bounded over the checkpoint (a few bytes of mesh rule name 4M ranks; at 2 us a visit, ten
    thousand tensors of new shapes were 50 hours of ``inspect``), refused naming the tensor."""
    from arraycheckpoint.checks import bounds
    from arraycheckpoint.planning import groupplan

    world = 1000
    monkeypatch.setattr(bounds, "MAX_EXPANDED_RANK_VISITS", 3 * 2 * world)
    calls = [0]
    real = groupplan._regions_of

    def counting(*args):
        calls[0] += 1
        return real(*args)

    monkeypatch.setattr(groupplan, "_regions_of", counting)
    tensors = {f"model/w{i}": _held([4 + i], [1], [[0, ["mesh", 0, [0]]]]) for i in range(4)}
    tensors.update({f"model/same{i}": _held([4], [1], [[0, ["mesh", 0, [0]]]]) for i in range(50)})
    for t in tensors.values():
        t["writers"] = list(range(t["shape"][0]))
    meta = CheckpointMetadata.from_json(json.dumps(_doc(world, tensors)))
    for i in range(50):  # one layout, expanded once
        assert [s.rank for s in meta.tensors[f"model/same{i}"].shards] == [0, 1, 2, 3]
    assert calls[0] == 1
    for i in range(3):
        assert len(meta.tensors[f"model/w{i}"].shards) == 4 + i
    with pytest.raises(MetadataError, match="model/w3.*visits more than"):
        len(meta.tensors["model/w3"].shards)


@pytest.mark.parametrize(
    "rule",
    [
        ["mesh", 0, [0, 0]],  # more placements than the mesh has dimensions (an IndexError when expanded)
        ["mesh", 0, []],
        ["boxes", [5]],  # boxes not [offsets, lengths] (a TypeError while parsing)
        ["boxes", 5],
        ["boxes", [[5, 6]]],
        ["boxes", [[[0], [4], [1]]]],
        ["replica", 1],
    ],
)
@pytest.mark.parametrize("writers", ["held", [0, 0, 0, 0]])
def test_malformed_layout_rules_are_refused_while_parsing(rule, writers):
    tensor = {**_held([4], [1], [[0, rule]]), "writers": writers}
    with pytest.raises(MetadataError, match="model/w.*malformed layout rule"):
        CheckpointMetadata.from_json(json.dumps(_doc(2, {"model/w": tensor})))


@pytest.mark.parametrize("pack", [".acp/packs/0\n", ".acp/packs/0@1024\n"])
def test_pack_entry_with_a_trailing_newline_is_refused(pack):
    """``$`` also matches before a final newline: a pack entry is matched to its very end."""
    tensor = {**_held([4], [1], [[0, ["replica"]]]), "pack": pack}
    doc = _doc(1, {"model/w": tensor})
    doc["layout_groups"] = [{"meshes": [], "ranks": [[0, 1, 1]]}]
    with pytest.raises(MetadataError, match="model/w.*pack"):
        CheckpointMetadata.from_json(json.dumps(doc))


def test_a_world_beyond_any_mesh_is_refused_before_anything_sized_by_it(tmp_path):
    """A template per-rank object has a row per rank of the world: a world of 2^40 (its stacked arrays
    declared [2^40, k], in bounds) made a load build ``list(range(2^40))`` (MemoryError) and ``diff`` too."""
    import torch

    import arraycheckpoint as acp
    from arraycheckpoint.format.perrank import PerRank
    from arraycheckpoint.stateful import source_rank

    path = tmp_path / "ck"
    acp.save(path, {"extra_state": {"counter": PerRank({"n": 3, "t": torch.arange(3)})}})
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["world_size"] = 1 << 40
    for t in doc["tensors"].values():
        if t.get("rank_rows"):
            t["shape"][0], t["chunk_shape"][0], t["inner_chunk_shape"][0] = 1 << 40, 1 << 20, 1 << 20
            t.update(writers="held")
            t.pop("pack", None)
    meta.write_text(json.dumps(doc))
    with pytest.raises(MetadataError, match="world_size 1099511627776"):
        acp.load(path, {"extra_state": {"counter": PerRank()}})
    assert source_rank(5, range(4)) == 1 and source_rank(2, range(1 << 22)) == 2  # no list of the world


@pytest.mark.parametrize(
    "writers, why",
    [
        (["cyclic", -1], "integer shift in"),
        (["cyclic", 4], "integer shift in"),
        (["cyclic", True], "integer shift in"),
        (["cyclic", 1.0], "integer shift in"),
        (["cyclic", "1"], "integer shift in"),
        (["cyclic"], "integer shift in"),
        (["cyclic", 1, 2], "integer shift in"),
    ],
)
def test_malformed_cyclic_writers_are_refused_naming_the_tensor(writers, why):
    """Format 8's ``["cyclic", shift]``: the shift is an integer in [0, world_size); anything else is refused
    while the metadata is parsed, naming the tensor."""
    doc = _doc(4, {"model/w": {**_held([8, 4], [2, 4], [[0, ["replica"]]]), "writers": writers}})
    doc["format_version"] = 8
    with pytest.raises(MetadataError, match=why) as e:
        CheckpointMetadata.from_json(json.dumps(doc))
    assert "model/w" in str(e.value)


def test_cyclic_writers_are_derived_and_need_format_8():
    """A replicated tensor's chunks go round its holders from ``shift`` on; the same entry in a format-7
    document is no list of ranks: refused. Regions that do not cut the tensor exactly are refused on use."""
    entry = {**_held([8, 4], [2, 4], [[0, ["replica"]]]), "writers": ["cyclic", 3]}
    doc = _doc(4, {"model/w": entry})
    doc["format_version"] = 8
    writers = CheckpointMetadata.from_json(json.dumps(doc)).tensors["model/w"].writers
    assert list(writers) == [3, 0, 1, 2]
    doc["format_version"] = 7
    with pytest.raises(MetadataError, match="model/w"):
        CheckpointMetadata.from_json(json.dumps(doc))
    bad = {
        **_held([8, 4], [2, 4], [[0, ["boxes", [[[0, 0], [4, 4]], [[2, 0], [6, 4]]]]]]),
        "writers": entry["writers"],
    }
    doc = _doc(4, {"model/w": bad})
    doc["format_version"] = 8
    meta = CheckpointMetadata.from_json(json.dumps(doc))
    with pytest.raises(MetadataError, match="model/w.*overlap or do not cover"):
        _ = meta.tensors["model/w"].writers.array
