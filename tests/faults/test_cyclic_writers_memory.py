"""Format 8's ``"writers": ["cyclic", shift]`` is a few bytes of untrusted metadata that makes a reader derive
one writer per chunk (up to 2^26 an array, 2^28 over a checkpoint's layouts: the bounds ``"held"`` writers
have). Deriving them must cost about what ``"held"`` costs: the reader's tables of the cyclic rule took 57 bytes
per chunk at their peak and kept 40 per chunk and layout (seven int64 arrays), so one 1-KB metadata file of
2^26 chunks took 3.7 GB and 9 s, and a checkpoint at the bounds about 15 GB. Measured with tracemalloc (numpy's
allocations are traced), in process, on metadata documents only."""

from __future__ import annotations

import json
import tracemalloc

import numpy as np
import pytest

from arraycheckpoint.format.metadata import CheckpointMetadata
from arraycheckpoint.planning import owners

N = 1 << 21  # chunks: big enough that the per-chunk arrays dwarf everything else, small enough for CI


def _meta(writers: object, regions: list, groups: list) -> CheckpointMetadata:
    tensor = {
        "shape": [N, 1],
        "dtype": "float32",
        "chunk_shape": [1, 1],
        "inner_chunk_shape": [1, 1],
        "compression": None,
        "regions": regions,
        "writers": writers,
    }
    doc = {
        "format_version": 8,
        "framework": "torch",
        "world_size": 4,
        "layout_groups": groups,
        "tensors": {
            "m/w": tensor,
            "m/v": {**tensor, "writers": ["cyclic", 3]} if writers != "held" else tensor,
        },
        "objects": {},
    }
    return CheckpointMetadata.from_json(json.dumps(doc))


ALL = [{"meshes": [[[4], ["arange", 0]]], "ranks": [[0, 4, 1]]}]
#: every chunk held by all 4 ranks (DDP), or the first half by ranks 0-1 and the second by ranks 2-3 (two
#: holder sets: the chunks' places in their sets are counted)
LAYOUTS = {
    "one-set": ([[0, ["replica"]]], ALL),
    "two-sets": (
        [[0, ["boxes", [[[0, 0], [N // 2, 1]]]]], [1, ["boxes", [[[N // 2, 0], [N // 2, 1]]]]]],
        [{"meshes": [], "ranks": [[0, 2, 1]]}, {"meshes": [], "ranks": [[2, 4, 1]]}],
    ),
}


def _derive(meta: CheckpointMetadata, name: str) -> tuple[np.ndarray, float, float]:
    """The writers of ``name``, and the bytes per chunk deriving them kept and needed at the peak."""
    tracemalloc.start()
    try:
        got = meta.tensors[name].writers.array
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return got, kept / N, peak / N


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_cyclic_writers_cost_about_what_held_writers_cost(layout: str) -> None:
    regions, groups = LAYOUTS[layout]
    _held, held_kept, held_peak = _derive(_meta("held", [[0, ["mesh", 0, [0]]]], ALL), "m/w")
    meta = _meta(["cyclic", 1], regions, groups)
    writers, kept, peak = _derive(meta, "m/w")
    assert held_kept <= 8.5 and held_peak <= 16.5, (held_kept, held_peak)  # the int64 writers, one copy
    # the writers (8 bytes a chunk) and the layout's tables kept for its other shifts (the holder set in 1
    # byte, the place in it in 4): 40 bytes a chunk before, at a peak of 57 (one-set: 17, two-sets: 23 now,
    # the region of each chunk and the sort by holder set included)
    assert kept <= 13.5 and peak <= 26, (kept, peak, held_peak)
    # another shift of the same layout costs its writers (and a block of temporaries: 2 bytes a chunk here)
    other, kept2, peak2 = _derive(meta, "m/v")
    assert kept2 <= 8.5 and peak2 <= 11, (kept2, peak2)
    if layout == "one-set":
        assert np.array_equal(writers, (np.arange(N) + 1) % 4)
        assert np.array_equal(other, (np.arange(N) + 3) % 4)
    else:
        half = np.arange(N // 2)
        assert np.array_equal(writers, np.concatenate([(half + 1) % 2, 2 + (half + 1) % 2]))
        assert np.array_equal(other, np.concatenate([(half + 3) % 2, 2 + (half + 3) % 2]))


def test_the_cyclic_tables_number_holder_sets_in_the_smallest_type() -> None:
    """Up to 256 holder sets in a byte, up to 65,536 in two, then four; a place in 4 bytes below 2^31 chunks;
    every writer as the rule says, worked in blocks (block boundaries inside a set's run included)."""
    rng = np.random.default_rng(7)
    for sets, kind in ((3, np.uint8), (300, np.uint16), (70_000, np.uint32)):
        holders = [[i, i + 1 + i % 3] for i in range(sets)]
        choice = rng.integers(0, sets, size=5_000).astype(np.int64)
        block = owners._BLOCK
        owners._BLOCK = 777
        try:
            cycle = owners.Cycle(choice, holders)
            got = cycle.writers(5)
        finally:
            owners._BLOCK = block
        assert cycle.sid.dtype == kind and cycle.ordinal.dtype == np.int32
        place = np.zeros(sets, dtype=np.int64)
        for ci, region in enumerate(choice.tolist()):
            h = holders[region]
            assert got[ci] == h[(place[region] + 5) % len(h)], ci
            place[region] += 1
        assert np.array_equal(cycle.writers(5, cycle.free), got[cycle.free])
