"""A load parses and checks its metadata and its packs once (issue 22, item 5).

Format-6 pack members are read once: the load's pack checks parse each pack's central directory and hand
the validated offsets to the reader, which checks each member's local header on the bytes it reads with the
member (before it uses them), instead of the checks reading every local header with a ``pread`` of their own
first. The metadata parser and the layout checks validate a layout, a region list or a pack entry shared by
many tensors once; these tests show that a value which only resembles a checked one (another type, another
packing) is still checked and refused.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from faults.packtools import chunk_member, pack_of, set_local_header

import arraycheckpoint as acp
from arraycheckpoint.audit import packdir
from arraycheckpoint.checks import limits, zipdir
from arraycheckpoint.checks.bounds import MAX_PACKED_CHUNKS
from arraycheckpoint.errors import CorruptCheckpointError, MetadataError
from arraycheckpoint.format.metadata import CheckpointMetadata, TensorMeta


def _state(n: int = 6) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(8, 4, generator=g) for i in range(n)}


def _spy(monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> list[tuple[object, ...]]:
    calls: list[tuple[object, ...]] = []
    real = getattr(module, name)

    def spying(*args: object, **kwargs: object) -> object:
        calls.append(args)
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, spying)
    return calls


def test_each_local_header_is_read_and_checked_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = str(tmp_path / "ck")
    state = _state()
    acp.save(ck, {"model": state})
    audited = _spy(monkeypatch, packdir, "_check_local_headers")
    checked = _spy(monkeypatch, zipdir, "check_local_header")
    preads = _spy(monkeypatch, os, "pread")
    target = {"model": {k: torch.zeros_like(v) for k, v in state.items()}}
    acp.load(ck, target)
    assert all(torch.equal(target["model"][k], v) for k, v in state.items())
    assert audited == []  # the checks left the local headers to the reader
    members = sorted(str(c[1].filename) for c in checked)  # type: ignore[attr-defined]
    expected = sorted([f"model/{k}/zarr.json" for k in state] + [f"model/{k}/c.0.0" for k in state])
    assert members == expected  # every member read has its local header checked, each once
    # the pack's end (the directory with it) is the only pread of the checks: no pread per member
    assert len(preads) <= len({pack_of(Path(ck), f"model/{k}") for k in state})


def test_tools_still_check_local_headers_before_reading(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Without a reader to hand them to (the tools' own checks), the local headers are checked up front."""
    from arraycheckpoint.audit.scan import check_checkpoint
    from arraycheckpoint.storage.local import LocalStorage

    ck = str(tmp_path / "ck")
    acp.save(ck, {"model": _state(2)})
    audited = _spy(monkeypatch, packdir, "_check_local_headers")
    meta = acp.read_metadata(ck)
    check_checkpoint(LocalStorage(), ck, meta)
    assert audited and sum(len(c[1]) for c in audited) == 4  # type: ignore[arg-type]


@pytest.mark.parametrize("member", ["chunk", "doc"])
def test_local_header_damage_found_by_the_reader_names_the_tensor(tmp_path: Path, member: str) -> None:
    """A local header with a data descriptor flag (sizes after the data), which only the local header check
    sees: refused by the reader's check, for a chunk and for an array's zarr.json, naming the tensor."""
    ck = tmp_path / "ck"
    acp.save(str(ck), {"model": _state(2)})
    name = "model/w1"
    key = chunk_member(name) if member == "chunk" else f"{name}/zarr.json"
    set_local_header(pack_of(ck, name), key, flags=0x0008)
    target = {"model": {k: torch.zeros(8, 4) for k in ("w0", "w1")}}
    with pytest.raises(CorruptCheckpointError, match=r"'model/w1'.*local header.*data descriptor"):
        acp.load(str(ck), target)


def _doc(tensors: dict[str, dict[str, object]], version: int = 6, world: int = 2) -> str:
    return json.dumps(
        {
            "format_version": version,
            "world_size": world,
            "framework": "torch",
            "layout_groups": [{"meshes": [], "ranks": [[0, world, 1]]}],
            "tensors": tensors,
            "objects": {},
        }
    )


def _tensor(**changes: object) -> dict[str, object]:
    t: dict[str, object] = {
        "shape": [8, 4],
        "dtype": "float32",
        "chunk_shape": [8, 4],
        "inner_chunk_shape": [8, 4],
        "compression": None,
        "regions": [[0, ["replica"]]],
        "writers": [0],
        "pack": ".acp/packs/0@16777216",
    }
    t.update(changes)
    return t


def test_metadata_fast_path_parses_a_valid_document() -> None:
    meta = CheckpointMetadata.from_json(_doc({"model/a": _tensor(), "model/b": _tensor(writers=[1])}))
    assert meta.tensors["model/b"].writers == (1,) and meta.tensors["model/a"].pack_rank == 0
    assert meta.tensors["model/b"].shape == (8, 4) and meta.tensors["model/b"].compression is None


@pytest.mark.parametrize(
    "second",
    [
        _tensor(compression="None"),  # equal to None's key only if the key were the str
        _tensor(shape=[8.0, 4]),  # equal (and of equal hash) to [8, 4]
        _tensor(shape=[True, 4], chunk_shape=[1, 4], inner_chunk_shape=[1, 4]),
        _tensor(writers=[0, 0]),  # same pack entry, other writer count
        _tensor(writers=[2]),  # a rank outside the world
        _tensor(pack=".acp/packs/2@16777216"),  # a rank outside the world
        _tensor(regions=[[1, ["replica"]]]),  # a group that does not exist
        _tensor(regions=[[True, ["replica"]]]),
        _tensor(shape=[4, 8], chunk_shape=[8, 8], inner_chunk_shape=[8, 8]),  # chunk beyond the shape
    ],
)
def test_metadata_checks_what_only_resembles_a_checked_value(second: dict[str, object]) -> None:
    text = _doc({"model/a": _tensor(), "model/b": second})
    with pytest.raises(MetadataError):
        meta = CheckpointMetadata.from_json(text)
        limits.check_layouts(meta)


def test_layout_checks_tell_packed_from_unpacked() -> None:
    """check_layouts checks each distinct layout once; a packed array of a layout already checked unpacked
    still meets the packed limit."""
    rows = MAX_PACKED_CHUNKS + 1

    def tensor(name: str, pack: str | None) -> TensorMeta:
        return TensorMeta(name, (rows,), "float32", (1,), (1,), None, (), pack=pack)

    tensors = {"model/a": tensor("model/a", None), "model/b": tensor("model/b", ".acp/packs/0@16777216")}
    meta = CheckpointMetadata("torch", 1, tensors, {})
    with pytest.raises(MetadataError, match="'model/b'.*more than any pack holds"):
        limits.check_layouts(meta)
    limits.check_layouts(CheckpointMetadata("torch", 1, {"model/a": tensors["model/a"]}, {}))


def test_each_distinct_writers_is_counted_once_per_rank(tmp_path: Path, monkeypatch) -> None:
    """The pack checks ask every packed array for its chunks per rank (capacity, what each rank holds, the
    pack each member is predicted in); the arrays of one layout share one parsed ``Writers``, which counts
    once (``rank_counts``, ``rank_chunks``: the same answers as for a plain list, read-only), and a load of
    a checkpoint whose packed arrays span two writers reads bit-exactly through them."""
    import numpy as np

    from arraycheckpoint.format import writers as wmod

    listed = [2, 0, 2, 1, 2]
    w = wmod.Writers(np.array(listed, dtype=np.int64))
    assert wmod.rank_counts(w) == {0: 1, 1: 1, 2: 3} == wmod.rank_counts(listed)
    assert wmod.rank_counts(w) is wmod.rank_counts(w)
    assert wmod.rank_chunks(w, 2).tolist() == [0, 2, 4] == wmod.rank_chunks(listed, 2).tolist()
    assert wmod.rank_chunks(w, 2) is wmod.rank_chunks(w, 2) and wmod.rank_chunks(w, 3).tolist() == []
    with pytest.raises(ValueError):
        wmod.rank_chunks(w, 2)[0] = 1

    rng = np.random.default_rng(0)
    state = {f"l{i}": rng.standard_normal((48, 40)).astype(np.float32) for i in range(4)}  # one layout
    ck = str(tmp_path / "ck")
    opts = acp.PlanOptions(min_chunk_bytes=1 << 11, max_chunk_bytes=1 << 11, inner_chunk_bytes=1 << 9)
    acp.save(ck, {"extra_state": state}, plan_options=opts)
    meta = acp.read_metadata(ck)
    assert all(t.pack is not None and len(t.writers) > 1 for t in meta.tensors.values())
    distinct = {id(t.writers) for t in meta.tensors.values()}
    counted: list[int] = []
    real = wmod._counts
    monkeypatch.setattr(wmod, "_counts", lambda a: counted.append(len(a)) or real(a))
    target = {k: np.zeros_like(v) for k, v in state.items()}
    acp.load(ck, {"extra_state": target})
    assert all(target[k].tobytes() == v.tobytes() for k, v in state.items())
    assert len(counted) == len(distinct) == 1  # four arrays, one count
