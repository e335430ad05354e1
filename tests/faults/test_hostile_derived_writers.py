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
    calls = [0]
    real = plan.intersect

    def counting(a, b):
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(plan, "intersect", counting)
    monkeypatch.setattr(flatgrid, "intersect", counting)
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
    calls = [0]
    real = verify.intersect

    def counting(a, b):
        calls[0] += 1
        return real(a, b)

    monkeypatch.setattr(verify, "intersect", counting)
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
