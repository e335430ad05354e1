"""Plain readers of a checkpoint's arrays for tests: tensorstore and JSON only, none of arraycheckpoint's code.

A packed array (format 5) lives in the ZIP file its metadata entry names; every other array in its own
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
    if pack is None:
        kvstore: dict[str, Any] = {"driver": "file", "path": os.path.join(root, name) + "/"}
    else:
        kvstore = {
            "driver": "zip",
            "base": {"driver": "file", "path": os.path.join(root, pack)},
            "path": name + "/",
        }
    return {"driver": "zarr3", "kvstore": kvstore}


def ts_read(root: str, name: str) -> np.ndarray:
    """The whole stored array ``name``, read by tensorstore."""
    import tensorstore as ts

    return ts.open(ts_spec(root, name)).result().read().result()
