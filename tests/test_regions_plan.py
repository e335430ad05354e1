"""Pure planning code: box math, the flat-range decomposition and the global plan, without processes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from arraycheckpoint.errors import PlanError
from arraycheckpoint.planning.plan import (
    PlanOptions,
    TensorDecl,
    build_global_plan,
    rank_plan_from_json,
    rank_plan_to_json,
)
from arraycheckpoint.planning.regions import Box, chunk_boxes, flat_range_to_boxes, intersect


@pytest.mark.parametrize("seed", range(5))
def test_flat_range_decomposition_reassembles_exactly(seed: int) -> None:
    rng = np.random.default_rng(seed)
    for _ in range(400):
        shape = tuple(int(x) for x in rng.integers(1, 6, size=rng.integers(1, 5)))
        n = math.prod(shape)
        a = int(rng.integers(0, n + 1))
        b = int(rng.integers(a, n + 1))
        full = np.arange(n).reshape(shape)
        boxes = flat_range_to_boxes(shape, a, b)
        got = np.concatenate([full[x.slices()].ravel() for x in boxes]) if boxes else np.empty(0, int)
        assert np.array_equal(got, np.arange(a, b)), (shape, a, b, boxes)
        assert len(boxes) <= 2 * len(shape) - 1


def test_flat_range_errors_and_scalars() -> None:
    with pytest.raises(ValueError):
        flat_range_to_boxes((2, 2), 3, 5)
    assert flat_range_to_boxes((), 0, 1) == [Box((), ())]
    assert flat_range_to_boxes((4,), 2, 2) == []


def test_intersect_and_chunks() -> None:
    assert intersect(Box((0, 0), (4, 4)), Box((2, 3), (5, 5))) == Box((2, 3), (2, 1))
    assert intersect(Box((0,), (2,)), Box((2,), (2,))) is None
    chunks = list(chunk_boxes((10, 3), (4, 3)))
    assert chunks == [Box((0, 0), (4, 3)), Box((4, 0), (4, 3)), Box((8, 0), (2, 3))]


def _decl(name, shape, boxes, itemsize=4):
    return TensorDecl(name, shape, "float32", itemsize, tuple(boxes))


def test_replicas_written_once_and_balanced() -> None:
    """DDP: every rank holds every tensor; each chunk gets one writer and bytes spread evenly."""
    world = 4
    tensors = [(f"t{i}", (256, 1024)) for i in range(16)]  # 1 MiB each
    local = [[_decl(n, s, [Box.full(s)]) for n, s in tensors] for _ in range(world)]
    plan = build_global_plan(local, PlanOptions(min_chunk_bytes=1, max_chunk_bytes=1 << 20))
    written = [sum(w.chunk.volume * 4 for w in rp.writes) for rp in plan.ranks]
    assert sum(written) == 16 * (1 << 20)
    assert max(written) == min(written) == 4 * (1 << 20)
    assert not any(rp.sends for rp in plan.ranks)
    for _name, tp in plan.tensors.items():
        assert len(tp.writers) == 1 and len(tp.regions) == 1


def test_uneven_shards_align_chunks_and_need_no_exchange() -> None:
    """10 rows over 4 ranks (3,3,3,1) as DTensor does: grid aligns to the 3-row boundaries."""
    shape = (10, 1 << 16)
    rows = [(0, 3), (3, 3), (6, 3), (9, 1)]
    local = [[_decl("w", shape, [Box((o, 0), (n, shape[1]))])] for o, n in rows]
    plan = build_global_plan(local, PlanOptions(min_chunk_bytes=1 << 10))
    assert plan.tensors["w"].layout.chunk_shape[0] == 3
    assert plan.tensors["w"].writers == (0, 1, 2, 3)
    assert not any(rp.recvs for rp in plan.ranks)


def test_flat_shards_ship_straddling_fragments_to_one_writer() -> None:
    """FSDP1: flat ranges cut rows; the owner of a straddling chunk receives the other fragments."""
    shape = (6, 5)
    cuts = [0, 7, 16, 30]
    local = [[_decl("w", shape, flat_range_to_boxes(shape, a, b))] for a, b in zip(cuts, cuts[1:])]
    plan = build_global_plan(local, PlanOptions(min_chunk_bytes=1 << 20))
    assert plan.tensors["w"].layout.chunk_shape == shape  # tiny: one file
    (writer,) = plan.tensors["w"].writers
    sends = [t for rp in plan.ranks for t in rp.sends]
    assert sends and all(t.dst == writer for t in sends)
    covered = sum(p.box.volume for rp in plan.ranks for w in rp.writes for p in w.pieces)
    assert covered == 30


def test_plan_validation_errors() -> None:
    s = (4, 4)
    with pytest.raises(PlanError, match="overlap"):
        build_global_plan([[_decl("w", s, [Box((0, 0), (3, 4))])], [_decl("w", s, [Box((2, 0), (2, 4))])]])
    with pytest.raises(PlanError, match="cover"):
        build_global_plan([[_decl("w", s, [Box((0, 0), (2, 4))])], []])
    with pytest.raises(PlanError, match="outside"):
        build_global_plan([[_decl("w", s, [Box((3, 0), (2, 4))])]])
    with pytest.raises(PlanError, match="shape"):
        build_global_plan([[_decl("w", s, [Box.full(s)])], [_decl("w", (4, 5), [Box.full((4, 5))])]])


def test_large_tensor_is_split_along_shard_boundaries() -> None:
    shape = (4096, 4096)  # 64 MiB float32, two shards
    local = [
        [_decl("w", shape, [Box((0, 0), (2048, 4096))])],
        [_decl("w", shape, [Box((2048, 0), (2048, 4096))])],
    ]
    plan = build_global_plan(local, PlanOptions(max_chunk_bytes=8 << 20))
    layout = plan.tensors["w"].layout
    assert 2048 % layout.chunk_shape[0] == 0 and math.prod(layout.chunk_shape) * 4 <= 8 << 20
    assert all(layout.chunk_shape[i] % layout.inner_chunk_shape[i] == 0 for i in range(2))
    writers = plan.tensors["w"].writers
    half = len(writers) // 2
    assert set(writers[:half]) == {0} and set(writers[half:]) == {1}


def test_rank_plan_json_round_trip() -> None:
    shape = (6, 5)
    local = [[_decl("w", shape, flat_range_to_boxes(shape, a, b))] for a, b in [(0, 13), (13, 30)]]
    for rp in build_global_plan(local).ranks:
        assert rank_plan_from_json(rank_plan_to_json(rp)) == rp


@pytest.mark.parametrize("seed", range(3))
def test_chunk_grids_nest_in_the_regions_and_stay_under_the_maximum(seed: int) -> None:
    """Random regular-ish layouts (each dimension cut like torch.chunk over a few ranks, uneven and empty
    shards included) and random maxima: every interior region boundary lies on the grid, and no chunk holds
    more than the maximum (or one element)."""
    from arraycheckpoint.planning.chunking import nests, tensor_chunk_shape

    rng = np.random.default_rng(seed)
    for _ in range(300):
        shape = tuple(int(x) for x in rng.integers(1, 60, size=rng.integers(1, 4)))
        cuts = []
        for extent in shape:
            parts = int(rng.integers(1, 6))
            step = -(-extent // parts)
            cuts.append([(lo, min(step, extent - lo)) for lo in range(0, extent, step)])
        boxes = [Box(tuple(o for o, _n in combo), tuple(n for _o, n in combo)) for combo in _product(cuts)]
        itemsize = int(rng.choice([1, 2, 4, 8]))
        limit = int(rng.integers(itemsize, 4096))
        opts = PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=limit)
        chunk, nested = tensor_chunk_shape(shape, itemsize, boxes, opts)
        assert nested and nests(shape, chunk, boxes), (shape, boxes, chunk)
        assert math.prod(chunk) * itemsize <= limit, (shape, chunk, limit)


def _product(cuts):
    import itertools

    return itertools.product(*cuts)


def test_names_nested_across_ranks_are_refused_when_the_save_plans() -> None:
    """Rank 0 holds ``model/x``, rank 1 ``model/x/y`` (per-rank tensors): each rank's own names are fine, the
    union is an array inside an array, which no load accepts; the plan (before any write) refuses it."""
    import pytest

    from arraycheckpoint.errors import UnsafeNameError
    from arraycheckpoint.planning.plan import TensorDecl, build_global_plan

    whole = (Box((0,), (4,)),)
    outer = TensorDecl("model/x", (4,), "float32", 4, whole)
    inner = TensorDecl("model/x/y", (4,), "float32", 4, whole)
    with pytest.raises(UnsafeNameError, match="model/x/y"):
        build_global_plan([[outer], [inner]])
    assert build_global_plan([[outer], [outer]]).tensors["model/x"].layout.shape == (4,)
