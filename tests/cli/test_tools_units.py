"""Pure functions behind the command: size parsing, export file planning, coverage holes."""

from __future__ import annotations

import pytest

from arraycheckpoint.format.metadata import ShardMeta, TensorMeta
from arraycheckpoint.tools.common import parse_size
from arraycheckpoint.tools.export import ExportEntry, plan_files
from arraycheckpoint.tools.verify import uncovered


def test_parse_size():
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("500MB") == 500 * 10**6
    assert parse_size("2GiB") == 2 << 30
    assert parse_size("1000") == 1000
    for bad in ("", "lots", "-1GB", "5XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def _e(key: str, n: int) -> ExportEntry:
    return ExportEntry(key, key, "float32", n)


def test_plan_files_caps_each_file_and_isolates_oversized_tensors():
    entries = [_e("a", 40), _e("b", 50), _e("c", 200), _e("d", 10), _e("e", 90), _e("f", 5)]
    files = plan_files(entries, 100)
    assert [[e.key for e in f] for f in files] == [["a", "b"], ["c"], ["d", "e"], ["f"]]
    assert all(sum(e.nbytes for e in f) <= 100 or len(f) == 1 for f in files)
    assert [e.key for f in files for e in f] == [e.key for e in entries]  # order kept, nothing lost
    assert plan_files([], 100) == []


def _tm(shape, boxes):
    return TensorMeta("t", shape, "float32", shape, shape, None, tuple(ShardMeta(o, n, 0) for o, n in boxes))


def test_uncovered_finds_holes_and_accepts_full_or_overlapping_cover():
    assert uncovered(_tm((6, 4), [((0, 0), (3, 4)), ((3, 0), (3, 4))])) == []
    assert uncovered(_tm((6, 4), [((0, 0), (4, 4)), ((2, 0), (4, 4))])) == []  # replicas overlap
    holes = uncovered(_tm((6, 4), [((0, 0), (3, 4)), ((3, 0), (3, 2))]))
    assert [(h.offsets, h.lengths) for h in holes] == [((3, 2), (3, 2))]
    assert uncovered(_tm((), [((), ())])) == []
    assert len(uncovered(_tm((), []))) == 1


def _flat(shape, world):
    from arraycheckpoint.planning.regions import flat_range_to_boxes

    total = shape[0] * shape[1]
    cuts = [total * r // world for r in range(world + 1)]
    return cuts, [flat_range_to_boxes(shape, lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def test_uncovered_fast_path_on_many_flat_shards():
    """FSDP1-style flat ranges (not row aligned) of 1000 ranks: the sweep proves coverage quickly."""
    shape = (997, 1013)
    _, per_rank = _flat(shape, 1000)
    boxes = [b for bs in per_rank for b in bs]
    assert len(boxes) > 1500  # a rank holds a row tail and the next row head, some also full rows
    assert uncovered(_tm(shape, [(b.offsets, b.lengths) for b in boxes])) == []


def test_uncovered_names_a_dropped_flat_range():
    shape = (97, 101)
    cuts, per_rank = _flat(shape, 40)
    kept = [b for r, bs in enumerate(per_rank) if r != 17 for b in bs]
    holes = uncovered(_tm(shape, [(b.offsets, b.lengths) for b in kept]))
    assert sum(h.volume for h in holes) == cuts[18] - cuts[17]
