"""``mesh_regions`` vectorised over the mesh (a checkpoint's mesh rule of a few bytes names up to 4M ranks):
the same boxes, holders and order as the rank-by-rank definition (``mesh_box`` per position), on random meshes
with replicated dimensions, nested splits, empty parts, ranks at several positions and member filters."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from arraycheckpoint.planning.rules import Mesh, mesh_box, mesh_regions


def _by_rank(shape, mesh, placements, members=None):
    out: dict = {}
    coords = np.unravel_index(np.arange(len(mesh.ranks)), mesh.shape) if mesh.shape else ()
    seen = set()
    for flat, rank in enumerate(mesh.ranks):
        if members is not None and rank not in members:
            continue
        box = mesh_box(shape, mesh, placements, tuple(int(c[flat]) for c in coords))
        if box.volume and (box, rank) not in seen:
            seen.add((box, rank))
            out.setdefault(box, []).append(rank)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_vectorised_mesh_regions_equal_the_rank_by_rank_definition(seed):
    rng = random.Random(seed)
    for _ in range(300):
        nd = rng.randint(0, 3)
        shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 16]) for _ in range(nd))
        mshape = tuple(rng.randint(1, 5) for _ in range(rng.randint(0, 3)))
        n = math.prod(mshape)
        repeats = rng.random() < 0.3  # processes holding several devices
        ranks = (
            tuple(rng.randrange(max(1, n // 2)) for _ in range(n))
            if repeats
            else tuple(rng.sample(range(2 * n), n))
        )
        mesh = Mesh(mshape, ranks)
        placements = tuple(rng.choice([-1, *range(nd)]) for _ in mshape)
        distinct = sorted(set(ranks))
        members = (
            None if rng.random() < 0.5 else frozenset(rng.sample(distinct, rng.randint(0, len(distinct))))
        )
        got = mesh_regions(shape, mesh, placements, members)
        assert list(got.items()) == list(_by_rank(shape, mesh, placements, members).items()), (
            shape,
            mesh,
            placements,
            members,
        )


def test_a_huge_mesh_over_a_small_tensor_builds_only_its_boxes():
    """4M ranks splitting a 4-element tensor: four boxes (before, 4M Python iterations, about 14 s)."""
    mesh = Mesh((1 << 22,), tuple(range(1 << 22)))
    got = mesh_regions((4, 3), mesh, (0,))
    assert [(b.offsets, b.lengths, r) for b, r in got.items()] == [((i, 0), (1, 3), [i]) for i in range(4)]
