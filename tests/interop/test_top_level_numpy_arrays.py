"""A numpy array at the top of a saved state is a zarr array, not a group: the object that records its type
(``w/~arrays``) lies in no zarr node. It wrote a group ``w/zarr.json`` over the array's own document (a save with
arrays in their own directories failed: "File exists: .../w/zarr.json"; a packed one declared ``w`` a group)."""

from __future__ import annotations

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint import PlanOptions
from arraycheckpoint.zarr import checkpoint_store

zarr = pytest.importorskip("zarr")


@pytest.mark.parametrize("pack_array_bytes", [0, None], ids=["own-directory", "packed"])
def test_a_top_level_numpy_array_saves_loads_and_reads_as_a_zarr_array(tmp_path, pack_array_bytes):
    w = np.arange(64.0).reshape(8, 8)
    options = PlanOptions(pack_array_bytes=0) if pack_array_bytes == 0 else None
    acp.save(tmp_path / "ck", {"w": w, "m": {"v": np.arange(5, dtype=np.int32)}}, plan_options=options)

    back = {"w": np.zeros_like(w), "m": {"v": np.zeros(5, dtype=np.int32)}}
    acp.load(tmp_path / "ck", back)
    assert isinstance(back["w"], np.ndarray) and np.array_equal(back["w"], w)
    assert np.array_equal(back["m"]["v"], np.arange(5, dtype=np.int32))

    root = zarr.open_group(checkpoint_store(tmp_path / "ck"), mode="r")
    assert isinstance(root["w"], zarr.Array) and np.array_equal(root["w"][...], w)
    assert np.array_equal(root["m"]["v"][...], np.arange(5, dtype=np.int32))
    if pack_array_bytes == 0:  # plain zarr-python on the directory, no store in between
        assert np.array_equal(zarr.open_array(tmp_path / "ck" / "w", mode="r")[...], w)
