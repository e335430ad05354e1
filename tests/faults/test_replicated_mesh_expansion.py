"""Fixed defect: expanding a mesh rule whose mesh
dimension is replicated builds Python lists of every mesh position's offsets and lengths
(``offsets[keep].tolist()``) before grouping the positions into boxes, though only the first position of each
box is used. A hostile checkpoint of a few hundred bytes (``world_size`` 2^22, one mesh of 2^22 ranks, a
rule ``["mesh", 0, [-1]]``) made ``verify`` and ``inspect`` spend 15-30 s per distinct layout in ``tolist``
on this machine (within ``MAX_EXPANDED_RANK_VISITS``, but 8 such layouts are minutes). Measured here as the
peak memory of one expansion (no wall clock): 2^18 positions over a [4, 8] tensor, one box held by all of
them, peaked at 86 MB, of which the holder list (the output) and numpy's arrays are about 18 MB; the test
uses 2^16 positions: 21.5 MB now, 11.5 MB with the offsets and lengths listed only at each box's first
position (the fix: only each box's first position is listed)."""

from __future__ import annotations

import tracemalloc

from arraycheckpoint.planning.rules import Mesh, mesh_regions


def test_replicated_mesh_expansion_lists_each_box_once() -> None:
    n = 1 << 16
    mesh = Mesh((n,), tuple(range(n)))
    assert not mesh.repeats
    tracemalloc.start()
    try:
        regions = mesh_regions((4, 8), mesh, [-1], None)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert len(regions) == 1 and len(next(iter(regions.values()))) == n
    assert peak < 16 * 2**20, f"peak {peak / 2**20:.0f} MB"
