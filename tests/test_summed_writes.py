"""Chunk files of their own whose CRC32C the writer sums as it writes them (:mod:`arraycheckpoint.engine.summed`):
zarr-python and tensorstore read them (both verify every CRC32C), and the load is bit-exact."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorstore as ts
import torch
import zarr

import arraycheckpoint as acp
from arraycheckpoint.engine import summed


def test_own_chunk_files_summed_as_written_read_by_zarr_and_tensorstore(tmp_path: Path, monkeypatch) -> None:
    calls: list[int] = []
    real = summed.write

    def spy(fd, parts, offset, path, zip_crc):
        out = real(fd, parts, offset, path, zip_crc)
        calls.append(out[1])
        return out

    monkeypatch.setattr(summed, "write", spy)
    g = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(1000, 333, generator=g)}
    ck = tmp_path / "ck"
    acp.save(
        ck, {"model": state}, plan_options=acp.PlanOptions(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20)
    )
    own = sorted(p for p in (ck / "model" / "w").iterdir() if p.name.startswith("c."))
    assert len(own) == 4, own  # 1 MiB chunk files of their own, not packed
    assert len(calls) >= 4 and all(n > summed.SLICE_BYTES for n in calls), calls
    want = state["w"].numpy()  # ("b" is packed: its own readers' path is tests/interop's)
    assert np.array_equal(zarr.open_array(ck / "model" / "w", mode="r")[...], want)
    spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": str(ck / "model" / "w")}}
    assert np.array_equal(ts.open(spec, open=True).result().read().result(), want)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    acp.load(ck, {"model": dest})
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_a_flipped_byte_in_a_summed_chunk_is_refused(tmp_path: Path) -> None:
    """The CRC32C summed while writing is the data's: a changed byte fails the load, naming the array."""
    state = {"w": torch.arange(512 * 1024, dtype=torch.float32).reshape(512, 1024)}
    ck = tmp_path / "ck"
    acp.save(
        ck, {"model": state}, plan_options=acp.PlanOptions(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20)
    )
    chunk = ck / "model" / "w" / "c.1.0"
    raw = bytearray(chunk.read_bytes())
    raw[1000] ^= 0x10
    chunk.write_bytes(bytes(raw))
    dest = {"w": torch.zeros(512, 1024)}
    try:
        acp.load(ck, {"model": dest})
    except acp.ArrayCheckpointError as e:
        assert "model/w" in str(e) or "model.w" in str(e), str(e)
    else:
        raise AssertionError("a flipped byte loaded")
