"""``checkpoint_store`` serves an array's ``zarr.json`` as the metadata implies it (checked, and refused when
it is not little-endian with its index at the end) also when it is read by a byte range, and says that
document's size. A ranged read (``get`` with a ``RangeByteRequest``, ``OffsetByteRequest`` or
``SuffixByteRequest``, ``get_partial_values``) served the stored document unchecked: a big-endian document that
a whole read refuses came back as stored, from a directory and from a pack alike, and ``getsize`` gave the stored
document's size, not the served one's."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from faults.packtools import members, replace_member
from zarr.abc.store import OffsetByteRequest, RangeByteRequest, SuffixByteRequest
from zarr.core.buffer import default_buffer_prototype

import arraycheckpoint as acp
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.zarr import checkpoint_store

DOC = "model/weight/zarr.json"
RANGES = [RangeByteRequest(0, 1 << 20), RangeByteRequest(5, 40), OffsetByteRequest(3), SuffixByteRequest(30)]


@pytest.fixture(scope="module", params=["dir", "pack"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param) / "ck"
    options = acp.PlanOptions(pack_array_bytes=0) if request.param == "dir" else None
    acp.save(path, {"model": {"weight": np.arange(32, dtype=np.float32).reshape(4, 8)}}, plan_options=options)
    return request.param, path


def _edited(saved: tuple[str, Path], tmp_path: Path, fn: Any) -> Path:
    """A copy of the checkpoint whose array document (its file, or its pack member) ``fn`` edited."""
    layout, src = saved
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    if layout == "dir":
        doc = json.loads((path / DOC).read_text())
        fn(doc)
        (path / DOC).write_text(json.dumps(doc))
    else:
        (pack,) = (path / ".acp" / "packs").iterdir()
        doc = json.loads(dict(members(pack))[DOC])
        fn(doc)
        replace_member(pack, DOC, json.dumps(doc).encode())
    return path


def _big_endian(doc: dict) -> None:
    for c in doc["codecs"][0]["configuration"]["codecs"]:
        if c["name"] == "bytes":
            c["configuration"] = {"endian": "big"}


def _stray_key(doc: dict) -> None:
    doc["attributes"] = {"note": "x" * 200}  # not compared, not served: the served document is shorter


def _get(store: Any, byte_range: Any) -> bytes:
    async def go() -> bytes:
        got = await store.get(DOC, default_buffer_prototype(), byte_range)
        return got.to_bytes()

    return asyncio.run(go())


@pytest.mark.parametrize("byte_range", RANGES, ids=lambda r: type(r).__name__)
def test_a_ranged_read_of_a_big_endian_document_is_refused(
    saved: tuple[str, Path], tmp_path: Path, byte_range: Any
) -> None:
    store = checkpoint_store(_edited(saved, tmp_path, _big_endian))
    with pytest.raises(MetadataError, match="'model/weight'.*little-endian"):
        _get(store, None)
    with pytest.raises(MetadataError, match="'model/weight'.*little-endian"):
        _get(store, byte_range)
    with pytest.raises(MetadataError, match="'model/weight'.*little-endian"):
        asyncio.run(store.get_partial_values(default_buffer_prototype(), [(DOC, byte_range)]))
    with pytest.raises(MetadataError, match="'model/weight'.*little-endian"):
        asyncio.run(store.getsize(DOC))


def test_ranged_reads_are_parts_of_the_served_document(saved: tuple[str, Path], tmp_path: Path) -> None:
    path = _edited(saved, tmp_path, _stray_key)
    store = checkpoint_store(path)
    whole = _get(store, None)
    stored = (
        (path / DOC).read_bytes()
        if saved[0] == "dir"
        else dict(members(next((path / ".acp" / "packs").iterdir())))[DOC]
    )
    assert b"attributes" not in whole and len(whole) < len(stored)
    assert asyncio.run(store.getsize(DOC)) == len(whole)
    assert _get(store, RANGES[0]) == whole
    assert _get(store, RANGES[1]) == whole[5:40]
    assert _get(store, RANGES[2]) == whole[3:]
    assert _get(store, RANGES[3]) == whole[-30:]
