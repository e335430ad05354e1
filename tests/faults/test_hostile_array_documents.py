"""An array's ``zarr.json`` (its own file, or a member of a pack) that passes the metadata cross-check by the
fields it compares but says something else elsewhere.

* A ``bytes`` codec that is big-endian, or a shard index at the start: the chunks' crc32c still holds (it
  covers the encoded bytes), so zarr-python through ``checkpoint_store`` read byte-swapped values silently and
  ``verify`` said OK. Now refused by the load, ``verify`` and the store, naming the tensor.
* A stray key or codec setting that zarr-python refuses: the store failed inside zarr-python (a
  MetadataValidationError, a TypeError from its ShardingCodec) while ``acp.load`` and ``verify`` accepted the
  checkpoint. The store now serves the document the metadata implies (as the load opens arrays with it)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr
from faults.packtools import members, replace_member

import arraycheckpoint as acp
from arraycheckpoint.cli import main
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.zarr import checkpoint_store

WEIGHT = np.arange(32, dtype=np.float32).reshape(4, 8)


@pytest.fixture(scope="module", params=["dir", "pack"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tmp_path_factory.mktemp(request.param) / "ck"
    options = acp.PlanOptions(pack_array_bytes=0) if request.param == "dir" else None
    acp.save(path, {"model": {"weight": WEIGHT}}, plan_options=options)
    return request.param, path


def _edit(saved: tuple[str, Path], tmp_path: Path, fn: Any) -> Path:
    layout, src = saved
    path = tmp_path / "ck"
    shutil.copytree(src, path)
    if layout == "dir":
        doc_file = path / "model" / "weight" / "zarr.json"
        doc = json.loads(doc_file.read_text())
        fn(doc)
        doc_file.write_text(json.dumps(doc))
    else:
        (pack,) = (path / ".acp" / "packs").iterdir()
        doc = json.loads(dict(members(pack))["model/weight/zarr.json"])
        fn(doc)
        replace_member(pack, "model/weight/zarr.json", json.dumps(doc).encode())
    return path


def _sharding(doc: dict) -> dict:
    return doc["codecs"][0]["configuration"]


def _big_endian(doc: dict) -> None:
    for c in _sharding(doc)["codecs"]:
        if c["name"] == "bytes":
            c["configuration"] = {"endian": "big"}


def _index_first(doc: dict) -> None:
    _sharding(doc)["index_location"] = "start"


@pytest.mark.parametrize("edit", [_big_endian, _index_first], ids=["big-endian", "index-at-start"])
def test_another_byte_order_is_refused_by_every_reader(
    saved: tuple[str, Path], tmp_path: Path, edit: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _edit(saved, tmp_path, edit)
    with pytest.raises(MetadataError, match="'model/weight'.*little-endian"):
        acp.load(path, {"model": {"weight": np.zeros((4, 8), np.float32)}})
    with pytest.raises(MetadataError, match="'model/weight'.*little-endian"):
        zarr.open_group(checkpoint_store(path), mode="r")["model/weight"][...]
    assert main(["verify", str(path)]) == 1
    assert "little-endian" in capsys.readouterr().out


def _stray_key(doc: dict) -> None:
    doc["dimension_namez"] = ["a", "b"]


def _stray_setting(doc: dict) -> None:
    _sharding(doc)["index_locatiom"] = "end"


@pytest.mark.parametrize("edit", [_stray_key, _stray_setting], ids=["stray-key", "stray-codec-setting"])
def test_the_store_serves_the_document_the_metadata_implies(
    saved: tuple[str, Path], tmp_path: Path, edit: Any
) -> None:
    path = _edit(saved, tmp_path, edit)
    got = acp.load(path, {"model": {"weight": np.zeros((4, 8), np.float32)}})
    assert np.array_equal(got["model"]["weight"], WEIGHT)
    assert main(["verify", str(path)]) == 0
    assert np.array_equal(zarr.open_group(checkpoint_store(path), mode="r")["model/weight"][...], WEIGHT)
