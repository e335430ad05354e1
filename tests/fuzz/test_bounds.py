"""Bounds on what a document can make a reader allocate, and that a valid large checkpoint stays under them.

The metadata file limit (256 MiB) bounds a file, not what it parses into: 255 MiB of empty JSON objects
parsed into 3 GB. :func:`arraycheckpoint.checks.bounds.load_json_bounded` counts the arrays and objects first (a
block scan, no recursion, bounded memory) and refuses a document holding more than a valid one of its size
can; the layout checks refuse chunk counts no storage holds, at load and already when a save plans them.
"""

from __future__ import annotations

import json
import tracemalloc

import pytest

from arraycheckpoint.checks import bounds as checks_bounds
from arraycheckpoint.checks import limits
from arraycheckpoint.errors import MetadataError, PlanError
from arraycheckpoint.format.metadata import CheckpointMetadata


def _metadata_of(n: int) -> bytes:
    """The metadata of a valid packed checkpoint of ``n`` small tensors, built in process (no data written)
    from the entry a real save writes for one (tests/fuzz/corpus.py saves the same kind of tensor)."""
    entry = {
        "shape": [4, 3],
        "dtype": "float32",
        "chunk_shape": [4, 3],
        "inner_chunk_shape": [4, 3],
        "compression": None,
        "regions": [[0, ["replica"]]],
        "writers": [0],
        "pack": ".acp/packs/0.0.zip",
    }
    doc = {
        "format_version": 5,
        "library_version": "0.1.0",
        "codec_preset": 1,
        "framework": "torch",
        "world_size": 1,
        "step": 7,
        "topology": {"world_size": 1, "framework": "torch"},
        "roles": [],
        "layout_groups": [{"meshes": [], "ranks": [[0, 1, 1]]}],
        "tensors": {f"model/layers.{i}.w": entry for i in range(n)},
        "objects": {"extra_state": {"scope": "global", "value": {"epoch": 3, "history": [[1, 2]] * 1000}}},
        "metrics": {},
    }
    return json.dumps(doc, separators=(",", ":")).encode()


def test_a_valid_checkpoint_of_100000_tensors_stays_under_the_json_bounds() -> None:
    raw = _metadata_of(100_000)
    depth, containers = checks_bounds.json_shape(raw)
    assert depth <= checks_bounds.MAX_JSON_DEPTH
    # the margin: a valid document holds well under half the containers its size allows
    assert containers * 2 < checks_bounds.max_json_containers(len(raw)), (containers, len(raw))
    meta = CheckpointMetadata.from_json(raw)
    assert len(meta.tensors) == 100_000
    limits.check_layouts(meta)


def test_empty_objects_are_refused_before_parsing_in_bounded_memory() -> None:
    """8 MiB of ``{}`` (the 32 MiB and 255 MiB cases scale from it): refused by the pre-scan, which allocates
    one copy of the document and a constant, not the gigabytes of dicts a parse would build."""
    body = json.loads(_metadata_of(1))
    body["metrics"] = {"x": []}
    text = json.dumps(body).replace('"x": []', '"x": [' + ",".join(["{}"] * ((8 << 20) // 3)) + "]")
    raw = text.encode()
    tracemalloc.start()
    try:
        with pytest.raises(MetadataError, match="JSON arrays and objects"):
            CheckpointMetadata.from_json(raw, what="ck/.acp/metadata.json")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < len(raw) + (32 << 20), (peak, len(raw))  # one copy of the text and a few blocks


def test_json_shape_across_scan_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Depth and container counts carry over block boundaries (blocks of 7 bytes here), and brackets
    inside strings are not counted."""
    monkeypatch.setattr(checks_bounds, "_SCAN_BLOCK", 7)
    doc = [{"a": [[1], {"b": "[[[{"}]}, [[[[]]]], {}]
    raw = json.dumps(doc).encode()
    assert checks_bounds.json_shape(raw) == (5, 10)
    assert checks_bounds.json_depth(b'"\\"[[[["') == 0


def test_chunk_counts_no_storage_holds_are_refused() -> None:
    with pytest.raises(MetadataError, match="more than any storage holds"):
        limits.check_tensor_layout("model/x", (1 << 25, 1 << 25), "uint8", (1, 1), (1, 1))
    limits.check_tensor_layout("model/x", (1 << 16, 1 << 16), "uint8", (1, 1), (1, 1))  # 2^32: the limit
    doc = json.loads(_metadata_of(1))
    t = doc["tensors"]["model/layers.0.w"]
    t["shape"], t["chunk_shape"], t["inner_chunk_shape"], t["writers"] = (
        [1 << 14, 1 << 14],
        [1, 1],
        [1, 1],
        [],
    )
    meta = CheckpointMetadata.from_json(json.dumps(doc))
    with pytest.raises(MetadataError, match="more than any pack holds"):
        limits.check_layouts(meta)  # 2^28 packed chunks: no pack of at most 4 x 4.25 GiB has room


def test_the_save_plan_refuses_a_layout_the_load_would_refuse() -> None:
    """A chunk grid the load would refuse is refused when the save plans it, before anything is written."""
    from arraycheckpoint.planning.plan import PlanOptions, TensorDecl, build_global_plan
    from arraycheckpoint.planning.regions import Box

    whole = (Box((0,), (1 << 36,)),)
    decl = TensorDecl("model/x", (1 << 36,), "uint8", 1, whole)

    def layout(options: PlanOptions):
        return build_global_plan([[decl]], options).tensors["model/x"].layout

    with pytest.raises(PlanError, match="more than any storage holds"):
        layout(PlanOptions(min_chunk_bytes=1, max_chunk_bytes=8))
    with pytest.raises(PlanError, match="above the limit"):
        layout(PlanOptions(min_chunk_bytes=1 << 33, max_chunk_bytes=1 << 36))
    assert layout(PlanOptions()).chunk_shape == (64 << 20,)
