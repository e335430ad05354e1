"""Issue 22 at scale, in simulated worlds: FSDP1 flat ranges move at most ``range_move_share`` of a save's
bytes (flat-run chunk grids, sub-row where ranks hold less than a row), and the metadata stores no writer
per chunk where the layout determines it (format 7, ``"writers": "held"``): a reader derives every writer,
the planner's own decision, and refuses derived writers a valid checkpoint cannot have, naming the tensor.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.engine.coordinate import build_metadata
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata
from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan
from arraycheckpoint.planning.items import SaveRequest
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.planning.rules import Mesh

SHAPES = [(1024, 1024), (768, 256), (256, 768), (1024,)]


def _fsdp1(world: int, extra: tuple[TensorRule, ...] = ()) -> tuple[list, int]:
    """One flat parameter over ``world`` ranks (8-element alignment, world-size padding), each parameter
    with an fp32 state following its range: one declaration on every rank."""
    offsets, total = [], 0
    for s in SHAPES:
        total += -total % 8
        offsets.append(total)
        total += math.prod(s)
    total += -total % world
    rules = []
    for i, (s, o) in enumerate(zip(SHAPES, offsets)):
        rules.append(TensorRule(f"model/p{i}", s, "bfloat16", 2, ("range", 0, o, total)))
        rules.append(TensorRule(f"optimizer/p{i}/exp_avg", s, "float32", 4, ("range", 0, o, total)))
    mesh = Mesh((world,), tuple(range(world)))
    return [(Decl((mesh,), tuple(rules) + extra), tuple(range(world)))], world


def _moved(plan) -> int:
    """Bytes every writer receives: the pieces of its straddling chunks that it does not hold."""
    moved = 0
    for name, d in plan.tensors.items():
        c = plan._classes[name]
        itemsize = int(c.nbytes[0] // c.chunk(0).volume)
        for ci, pieces in c.straddle.items():
            w = int(d.writers[ci])
            moved += sum(b.volume for b, g in pieces if w not in c.holders[g]) * itemsize
    return moved


@pytest.mark.parametrize("world", [64, 2048, 10_000])
def test_flat_ranges_move_at_most_the_share_and_writers_are_derived(world):
    # runs may be as short as min_chunk_bytes / 4096 bytes: here 1, since ranks hold 140-22,000 elements
    options = PlanOptions(min_chunk_bytes=1 << 12, max_chunk_bytes=1 << 20)
    groups, world = _fsdp1(world)
    plan = build_compact_plan(groups, world, options)
    total = sum(
        math.prod(d.layout.shape) * plan._classes[n].nbytes[0] // plan._classes[n].chunk(0).volume
        for n, d in plan.tensors.items()
    )
    moved = _moved(plan)
    assert 0 < moved <= options.range_move_share * total, (moved, total)
    chunks = {n: d.layout.chunk_shape for n, d in plan.tensors.items()}
    if world >= 2048:  # a rank holds less than a few rows: runs shorter than a row
        assert any(
            c[0] == 1 and c[-1] < s[-1]
            for c, s in zip(chunks.values(), [d.layout.shape for d in plan.tensors.values()])
        ), chunks
    for name, d in plan.tensors.items():
        assert int(plan._classes[name].nbytes.max()) <= options.max_chunk_bytes
        assert d.derived, name
    # the metadata lists no writer: a reader derives every one, equal to the plan's
    meta = build_metadata(plan, SaveRequest([], [], framework="fsdp"), [{} for _ in range(world)])
    text = meta.to_json()
    doc = json.loads(text)
    assert all(t["writers"] == "held" for t in doc["tensors"].values())
    assert len(text) < 20_000  # grows with tensors and layout groups, not with chunks or ranks
    parsed = CheckpointMetadata.from_json(text)
    for name, d in plan.tensors.items():
        got = parsed.tensors[name].writers
        assert got.derived and len(got) == len(d.writers)
        assert np.array_equal(got.array, d.writers), name


def test_replicated_writers_stay_listed():
    """A replica's writer is chosen by worst fit over its holders: the metadata lists it."""
    groups, world = _fsdp1(8, (TensorRule("model/norm", (4096,), "float32", 4, ("replica",)),))
    plan = build_compact_plan(groups, world, PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=1 << 12))
    meta = build_metadata(plan, SaveRequest([], [], framework="fsdp"), [{} for _ in range(world)])
    doc = json.loads(meta.to_json())
    assert isinstance(doc["tensors"]["model/norm"]["writers"], list)
    assert len(set(doc["tensors"]["model/norm"]["writers"])) > 1  # spread over the replicas
    assert doc["tensors"]["model/p0"]["writers"] == "held"
    # "held" on the replica is no valid checkpoint: refused when its writers are used, naming it
    doc["tensors"]["model/norm"]["writers"] = "held"
    parsed = CheckpointMetadata.from_json(json.dumps(doc))
    with pytest.raises(MetadataError, match="model/norm.*several ranks"):
        _ = parsed.tensors["model/norm"].writers.array
    assert parsed.tensors["model/p0"].writers[0] in range(world)


def _saved(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(64, 4)
    opts = acp.PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=64, inner_chunk_bytes=64)
    acp.save(tmp_path / "ck", {"model": {"w": w}}, plan_options=opts)
    path = tmp_path / "ck" / METADATA_FILE
    return w, path, json.loads(path.read_text())


def test_derived_writers_load_and_hostile_ones_are_refused(tmp_path):
    w, path, doc = _saved(tmp_path)
    t = doc["tensors"]["model/w"]
    assert t["writers"] == "held" and t["pack"]  # 16 chunks in rank 0's packs, found through derived writers
    out = {"w": torch.zeros(64, 4)}
    acp.load(tmp_path / "ck", {"model": out})
    assert torch.equal(out["w"], w)

    def refused(match, **change):
        bad = json.loads(json.dumps(doc))
        bad["tensors"]["model/w"].update(change)
        path.write_text(json.dumps(bad))
        with pytest.raises(MetadataError, match=match):
            acp.load(tmp_path / "ck", {"model": {"w": torch.zeros(64, 4)}})

    # regions that leave part of the tensor unsaved: its writers cannot be derived
    refused("model/w.*writers are derived.*cover", regions=[[0, ["boxes", [[[0, 0], [32, 4]]]]]])
    # a derived writer list of an absurd chunk count (bounded before anything is allocated)
    refused("model/w.*derived for", shape=[1 << 40, 4], chunk_shape=[1, 4], inner_chunk_shape=[1, 4])
    # the same 40-byte entry repeated with new shapes: derived writers bounded over the whole checkpoint
    # (512 MiB per array otherwise), refused while parsing, before any is derived
    bad = json.loads(json.dumps(doc))
    entry = {k: v for k, v in bad["tensors"].pop("model/w").items() if k != "pack"}
    for k in range(5):  # 5 x 2^26 chunks > MAX_DERIVED_WRITERS_TOTAL = 2^28
        bad["tensors"][f"model/w{k}"] = {
            **entry,
            "shape": [1 << 26, 4 + k],
            "chunk_shape": [1, 4 + k],
            "inner_chunk_shape": [1, 4 + k],
        }
    with pytest.raises(MetadataError, match="model/w4.*derived writers pass"):
        CheckpointMetadata.from_json(json.dumps(bad))
    del bad["tensors"]["model/w4"]
    assert len(CheckpointMetadata.from_json(json.dumps(bad)).tensors["model/w3"].writers) == 1 << 26
    # "held" is format 7: in an older format it is a malformed writer list
    bad = json.loads(json.dumps(doc))
    bad["format_version"] = 6
    with pytest.raises(MetadataError, match="model/w.*writers"):
        CheckpointMetadata.from_json(json.dumps(bad))
    for value in ("HELD", 1, None, {"held": 1}):
        bad = json.loads(json.dumps(doc))
        bad["tensors"]["model/w"]["writers"] = value
        with pytest.raises(MetadataError, match="model/w"):
            CheckpointMetadata.from_json(json.dumps(bad))


@pytest.mark.parametrize("seed", range(6))
def test_flat_run_choice_is_the_chunk_by_chunk_choice(seed):
    """The vectorised path over flat runs decides exactly what the chunk-by-chunk path decides (each chunk's
    region, every straddling chunk's pieces), and ``moved_elements`` is exactly what travels when each cut
    changes the holder."""
    import random

    from arraycheckpoint.planning.flatgrid import (
        _flat_choice,
        _generic_choice,
        flat_interval,
        moved_elements,
        run_shapes,
    )
    from arraycheckpoint.planning.regions import flat_range_to_boxes

    rng = random.Random(seed)
    shape = tuple(rng.choice([1, 2, 3, 6, 12]) for _ in range(rng.randint(1, 3))) + (rng.choice([8, 12, 30]),)
    n = math.prod(shape)
    cuts = sorted({rng.randint(1, n - 1) for _ in range(rng.randint(1, 6))})
    bounds = [0, *cuts, n]
    boxes, holders = [], []
    for r in range(len(bounds) - 1):
        for b in flat_range_to_boxes(shape, bounds[r], bounds[r + 1]):
            boxes.append(b)
            holders.append([r])
    order = sorted(range(len(boxes)), key=lambda i: boxes[i])
    boxes, holders = [boxes[i] for i in order], [holders[i] for i in order]
    for chunk in run_shapes(shape, 4, 1 << 30, 1):
        iv = np.asarray([flat_interval(shape, b) for b in boxes], dtype=np.int64)
        fast, fast_pieces = _flat_choice(shape, chunk, boxes, iv, holders)
        slow, slow_pieces = _generic_choice(shape, chunk, boxes, holders)
        assert fast.tolist() == slow.tolist(), chunk
        assert {k: v for k, v in fast_pieces.items() if len(v) > 1} == slow_pieces, chunk
        run = math.prod(chunk)
        exact = 0
        for ci, pieces in slow_pieces.items():
            mine = int(fast[ci])
            exact += sum(b.volume for b, g in pieces if holders[g] != holders[mine])
        assert moved_elements(np.asarray(cuts, dtype=np.int64), n, run) == exact, chunk


def test_a_save_lists_the_writers_beyond_the_checkpoint_wide_bound(monkeypatch):
    """Derived writers are bounded per checkpoint (readers refuse more): a save whose derived writers would pass
    the bound lists the rest, and a reader derives or reads every writer equal to the plan's."""
    from arraycheckpoint.planning import groupplan

    groups, world = _fsdp1(64)
    options = PlanOptions(min_chunk_bytes=1 << 12, max_chunk_bytes=1 << 20)
    full = build_compact_plan(groups, world, options)
    counts = sorted(len(d.writers) for d in full.tensors.values())
    monkeypatch.setattr(groupplan, "MAX_DERIVED_WRITERS_TOTAL", counts[0] + counts[1])
    plan = build_compact_plan(groups, world, options)
    derived = [n for n, d in plan.tensors.items() if d.derived]
    assert 0 < len(derived) < len(plan.tensors)
    assert sum(len(plan.tensors[n].writers) for n in derived) <= counts[0] + counts[1]
    meta = build_metadata(plan, SaveRequest([], [], framework="fsdp"), [{} for _ in range(world)])
    text = meta.to_json()
    doc = json.loads(text)
    assert {n for n, t in doc["tensors"].items() if t["writers"] == "held"} == set(derived)
    parsed = CheckpointMetadata.from_json(text)
    for name, d in plan.tensors.items():
        assert np.array_equal(np.asarray(list(parsed.tensors[name].writers)), d.writers), name
