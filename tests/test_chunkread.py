"""Unpacked chunk files of a local checkpoint are read once, straight into the destination (issue 22, item 5):
``preadv`` into the target where an inner chunk lands whole and contiguously, else one scratch buffer; both
checksums verified; any file not in the layout a save writes goes through tensorstore."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.engine import engine
from arraycheckpoint.errors import CorruptCheckpointError
from arraycheckpoint.planning.items import LoadShard, LoadTensor
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.planning.regions import Box

# ~2 KiB chunks: [100, 40] float32 in chunks of ~12 rows (an edge chunk) and inner chunks of a few rows; the
# planner picks the exact shapes, which the tests read from the array's zarr.json
OPTIONS = PlanOptions(min_chunk_bytes=1024, max_chunk_bytes=2048, inner_chunk_bytes=512, pack_array_bytes=0)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    g = torch.Generator().manual_seed(3)
    state = {
        "w": torch.randn(100, 40, generator=g),  # 100 rows: a partial edge chunk
        "b": torch.randn(37, 24, generator=g).to(torch.bfloat16),
        "s": torch.tensor(2.5),  # 0-d
    }
    path = tmp_path_factory.mktemp("chunkread") / "ck"
    acp.save(path, {"model": state}, plan_options=OPTIONS)
    return path, state


def _read_phase(report):
    (read,) = [p for p in report["metrics"] if p["phase"] == "read"]
    return read


@pytest.mark.parametrize("block", [None, 100])
def test_whole_load_reads_into_the_targets(saved, block, monkeypatch):
    """Also in blocks of 100 bytes: each inner chunk (about 512 bytes) read and checksummed in several parts."""
    from arraycheckpoint.engine import chunkread

    if block is not None:
        monkeypatch.setattr(chunkread, "_BLOCK", block)
    path, state = saved
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    report: dict = {}
    acp.load(path, {"model": dest}, report=report)
    for k, v in state.items():
        assert torch.equal(dest[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    read = _read_phase(report)
    total = sum(v.numel() * v.element_size() for v in state.values())
    # every inner chunk inside the array went straight into its tensor; only the edge's went through scratch
    assert read["direct"] >= total * 0.8, read
    assert read["direct"] + read["scratch"] >= total, read


@pytest.mark.parametrize("block", [None, 100])
def test_strided_region_and_sink_reads(saved, block, monkeypatch):
    """A column block (a non-contiguous destination: scratch, then copied once) and a sink without a target."""
    from arraycheckpoint.engine import chunkread

    if block is not None:
        monkeypatch.setattr(chunkread, "_BLOCK", block)
    path, state = saved
    storage, root, meta = engine().read_metadata(str(path))
    w = state["w"].numpy()
    host = np.zeros((100, 40), np.float32)
    box = Box((5, 7), (90, 20))
    got = {}
    targets = [
        LoadTensor("model/w", [LoadShard(box, lambda a: None, target=host[5:95, 7:27])]),
        LoadTensor("model/b", [LoadShard(Box((3, 0), (30, 24)), lambda a: got.setdefault("b", a.copy()))]),
    ]
    engine().load(storage, root, meta, targets)
    assert np.array_equal(host[5:95, 7:27], w[5:95, 7:27])
    assert not host[:5].any() and not host[:, :7].any() and not host[95:].any() and not host[:, 27:].any()
    assert np.array_equal(
        got["b"].view(np.uint16), state["b"][3:33].view(torch.int16).numpy().view(np.uint16)
    )


def test_damaged_inner_chunk_names_the_tensor(saved, tmp_path):
    import shutil

    path, state = saved
    copy = tmp_path / "ck"
    shutil.copytree(path, copy)
    chunk = copy / "model" / "w" / "c.1.0"
    raw = bytearray(chunk.read_bytes())
    raw[100] ^= 0x01  # inside the first inner chunk's data
    chunk.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="model/w"):
        acp.load(copy, {"model": {k: torch.zeros_like(v) for k, v in state.items()}})


def test_a_shard_not_in_the_saved_layout_goes_through_tensorstore(saved, tmp_path):
    """A chunk file another zarr writer produced (an all-zero inner chunk left out of the shard) is not the
    layout a save writes: tensorstore reads it, and reports the missing inner chunk as damage, as it did
    before this reader existed (a load never fills missing data)."""
    import shutil

    import tensorstore as ts

    from arraycheckpoint.engine.common import array_spec

    path, state = saved
    copy = tmp_path / "ck"
    shutil.copytree(path, copy)
    storage, root, meta = engine().read_metadata(str(copy))
    spec = array_spec(storage, root, meta.tensors["model/w"])
    spec["store_data_equal_to_fill_value"] = False
    arr = ts.open(spec, open=True, assume_metadata=True).result()
    doc = json.loads((copy / "model" / "w" / "zarr.json").read_text())
    rows = doc["chunk_grid"]["configuration"]["chunk_shape"][0]
    inner = doc["codecs"][0]["configuration"]["chunk_shape"][0]
    assert rows > inner  # chunk 1 holds several inner chunks: one can be left out
    want = state["w"].numpy().copy()
    want[rows : rows + inner] = (
        0  # the first inner chunk of chunk 1 becomes fill value: tensorstore leaves it out
    )
    arr[rows : 2 * rows].write(want[rows : 2 * rows]).result()
    assert (copy / "model" / "w" / "c.1.0").stat().st_size < (copy / "model" / "w" / "c.0.0").stat().st_size
    with pytest.raises(CorruptCheckpointError, match="model/w.*missing"):
        acp.load(copy, {"model": {"w": torch.zeros(100, 40)}}, strict=False)


@pytest.mark.parametrize("enabled", [True, False])
def test_a_load_runs_without_garbage_collection_and_restores_it(saved, enabled, monkeypatch):
    """acp.load pauses the cyclic garbage collector (its passes over the objects a load keeps alive found
    nothing to free) and leaves it as it found it, also when the load fails."""
    import gc

    from arraycheckpoint.engine import chunkread

    path, state = saved
    seen = []
    real = chunkread.read_shard
    monkeypatch.setattr(chunkread, "read_shard", lambda *a, **k: seen.append(gc.isenabled()) or real(*a, **k))
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    was = gc.isenabled()
    try:
        gc.enable() if enabled else gc.disable()
        acp.load(path, {"model": dest})
        assert seen and not any(seen)
        assert gc.isenabled() == enabled
        with pytest.raises(acp.CheckpointNotFoundError):
            acp.load(str(path) + "-missing", {"model": dest})
        assert gc.isenabled() == enabled
    finally:
        gc.enable() if was else gc.disable()
