"""Plain readers of a checkpoint's arrays for tests: tensorstore and JSON only, none of arraycheckpoint's code.

A packed array lives in the ZIP file its metadata entry names (format 5) or in a pack of the rank it names
(format 6: here, checkpoints one rank wrote, so that pack holds the whole array); every other array in its own
directory. Tests that check what was stored read it the way an outside reader would.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np


def tensor_entry(root: str, name: str) -> dict[str, Any]:
    """The metadata entry of the stored array ``name`` (``.acp/metadata.json``, plain JSON)."""
    with open(os.path.join(root, ".acp", "metadata.json")) as f:
        return json.load(f)["tensors"][name]


def ts_spec(root: str, name: str) -> dict[str, Any]:
    """A plain tensorstore zarr3 spec of the stored array ``name``: its directory, or its pack member."""
    pack = tensor_entry(root, name).get("pack")
    if pack is not None and not pack.endswith(".zip"):  # format 6: the pack of the rank holding its zarr.json
        pack = _pack_holding(root, f"{name}/zarr.json")
    if pack is None:
        kvstore: dict[str, Any] = {"driver": "file", "path": os.path.join(root, name) + "/"}
    else:
        kvstore = {
            "driver": "zip",
            "base": {"driver": "file", "path": os.path.join(root, pack)},
            "path": name + "/",
        }
    return {"driver": "zarr3", "kvstore": kvstore}


def _pack_holding(root: str, member: str) -> str | None:
    """The pack file (relative to ``root``) holding ``member``, found with :mod:`zipfile`."""
    import zipfile

    packs = os.path.join(root, ".acp", "packs")
    for leaf in sorted(os.listdir(packs)):
        with zipfile.ZipFile(os.path.join(packs, leaf)) as zf:
            if member in zf.namelist():
                return f".acp/packs/{leaf}"
    return None


def ts_read(root: str, name: str) -> np.ndarray:
    """The whole stored array ``name``, read by tensorstore."""
    import tensorstore as ts

    return ts.open(ts_spec(root, name)).result().read().result()
