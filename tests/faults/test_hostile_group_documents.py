"""``checkpoint_store`` serves the group documents (the root's, every group's above an entry) and the control
node's as the metadata implies them, as it serves arrays' documents: a stored group document is untrusted.

zarr-python reads an array below a group through the group's inline consolidated metadata when the group's
``zarr.json`` has one, without reading the array's own document: a root (or ``model``) document declaring
``model/weight`` big-endian made zarr-python read byte-swapped values through the store while ``acp.load`` and
``verify`` read the right ones and said OK; a group document that says it is an array made the group
unreadable (an IndexError from inside zarr-python); a control node declaring 10^12 elements was served as
such."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zarr

import arraycheckpoint as acp
from arraycheckpoint.cli import main
from arraycheckpoint.zarr import checkpoint_store

WEIGHT = np.arange(32, dtype=np.float32).reshape(4, 8)


@pytest.fixture(scope="module", params=["dir", "pack"])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param) / "ck"
    options = acp.PlanOptions(pack_array_bytes=0) if request.param == "dir" else None
    acp.save(path, {"model": {"weight": WEIGHT}}, plan_options=options)
    return path


def _big_endian_array_doc() -> dict[str, Any]:
    from arraycheckpoint.codecs import array_metadata

    doc = array_metadata((4, 8), np.dtype(np.float32), (4, 8), (4, 8), None, name="weight", separator=".")
    for c in doc["codecs"][0]["configuration"]["codecs"]:
        if c["name"] == "bytes":
            c["configuration"] = {"endian": "big"}
    return doc


def _consolidated(children: dict[str, Any]) -> dict[str, Any]:
    return {"kind": "inline", "must_understand": False, "metadata": children}


def _root_consolidated(path: Path) -> None:
    doc = json.loads((path / "zarr.json").read_text())
    group = {"zarr_format": 3, "node_type": "group", "attributes": {}}
    doc["consolidated_metadata"] = _consolidated({"model": group, "model/weight": _big_endian_array_doc()})
    (path / "zarr.json").write_text(json.dumps(doc))


def _group_consolidated(path: Path) -> None:
    doc = json.loads((path / "model" / "zarr.json").read_text())
    doc["consolidated_metadata"] = _consolidated({"weight": _big_endian_array_doc()})
    (path / "model" / "zarr.json").write_text(json.dumps(doc))


def _group_as_array(path: Path) -> None:
    doc = {**_big_endian_array_doc(), "dimension_names": None}
    (path / "model" / "zarr.json").write_text(json.dumps(doc))


EDITS = {"root-consolidated": _root_consolidated, "group-consolidated": _group_consolidated}


@pytest.mark.parametrize("edit", [*EDITS, "group-as-array"])
def test_the_store_reads_the_values_the_load_reads(saved: Path, tmp_path: Path, edit: str) -> None:
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    EDITS.get(edit, _group_as_array)(path)
    got = acp.load(path, {"model": {"weight": np.zeros((4, 8), np.float32)}})
    assert np.array_equal(got["model"]["weight"], WEIGHT)
    assert main(["verify", str(path)]) == 0
    root = zarr.open_group(checkpoint_store(path), mode="r")
    assert np.array_equal(root["model/weight"][...], WEIGHT)
    assert np.array_equal(root["model"]["weight"][...], WEIGHT)
    assert root.attrs["format_version"] == acp.read_metadata(path).format_version


def test_the_control_node_is_served_as_the_metadata_implies_it(saved: Path, tmp_path: Path) -> None:
    path = tmp_path / "ck"
    shutil.copytree(saved, path)
    node = path / ".acp" / "zarr.json"
    doc = json.loads(node.read_text())
    doc["shape"] = [10**12]
    node.write_text(json.dumps(doc))
    store = checkpoint_store(path)
    assert zarr.open_array(store, path=".acp", mode="r").shape == (0,)
    served = json.loads(zarr.core.sync.sync(store.get(".acp/zarr.json")).to_bytes())
    assert served["shape"] == [0]
    assert zarr.core.sync.sync(store.getsize(".acp/zarr.json")) == len(json.dumps(served).encode())
