"""Packed chunks are decoded by the engine itself (arraycheckpoint.engine.packread): one pread per member and
crc32c, straight into the destinations, instead of a tensorstore array per tensor. They must give the same bits,
partial regions included; a format-5 member in any other layout falls back to tensorstore, a format-6 one is
damage."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.engine import packread


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((48, 40)).astype(np.float32),  # several chunks and inner chunks (options)
        "b": rng.standard_normal(40).astype(ml_dtypes.bfloat16),
        "i": rng.integers(-(2**62), 2**62, size=(5, 3), dtype=np.int64),
        "flag": np.array([True, False, True]),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 4), np.float32),
    }


# small chunk grids so that a packed array has several chunks, each of several inner chunks
OPTIONS = acp.PlanOptions(min_chunk_bytes=1 << 11, max_chunk_bytes=1 << 11, inner_chunk_bytes=1 << 9)


def _save(tmp_path) -> str:
    ck = str(tmp_path / "ck")
    acp.save(ck, {"extra_state": _state()}, plan_options=OPTIONS)
    meta = acp.read_metadata(ck)
    w = meta.tensors["extra_state/w"]
    assert w.pack is not None and len(w.writers) > 1 and w.chunk_shape != w.inner_chunk_shape
    return ck


def _load(ck: str) -> dict[str, np.ndarray]:
    target = {k: np.zeros_like(v) if v.ndim else np.float64(0) for k, v in _state().items()}
    return acp.load(ck, {"extra_state": target})["extra_state"]


def _same(got: dict, want: dict) -> None:
    for k, v in want.items():
        g = np.asarray(got[k])
        assert g.dtype == np.asarray(v).dtype and g.shape == np.shape(v), k
        assert np.asarray(v).tobytes() == g.tobytes(), k


def test_packed_arrays_are_decoded_by_the_engine_bit_exactly(tmp_path, monkeypatch) -> None:
    ck = _save(tmp_path)
    calls = []
    real = packread.PackedReader.deliver
    monkeypatch.setattr(
        packread.PackedReader, "deliver", lambda self, t: calls.append(t.name) or real(self, t)
    )
    _same(_load(ck), _state())
    assert {"extra_state/w", "extra_state/b", "extra_state/i", "extra_state/flag"} <= set(calls)


def test_partial_regions_of_packed_chunks_are_read_bit_exactly(tmp_path) -> None:
    """A region that cuts through chunks and inner chunks gets exactly its bytes (checked against numpy)."""
    from arraycheckpoint.engine import engine
    from arraycheckpoint.planning.items import LoadShard, LoadTensor
    from arraycheckpoint.planning.regions import Box
    from arraycheckpoint.storage import storage_for

    ck = _save(tmp_path)
    storage, root = storage_for(ck)
    meta = acp.read_metadata(ck)
    w = _state()["w"]
    got = {}
    boxes = [Box((3, 5), (17, 30)), Box((40, 0), (8, 40)), Box((0, 39), (48, 1))]
    targets = [np.full(b.lengths, -1.0, np.float32) for b in boxes]
    shards = [LoadShard(b, lambda a, b=b: got.__setitem__(b, a), target=t) for b, t in zip(boxes, targets)]
    engine().load(storage, root, meta, [LoadTensor("extra_state/w", shards)])
    for b, t in zip(boxes, targets):
        assert np.array_equal(t, w[b.slices()]), b


def test_a_format5_member_in_another_layout_falls_back_to_tensorstore(tmp_path, monkeypatch) -> None:
    """Format 5 (the fixture written by f62d3f0): a member the engine does not decode goes to tensorstore."""
    import os
    import shutil

    from fixtures.make_format2 import full_state
    from test_format5_compat import _expected, _load_single
    from test_format5_compat import _same as same5

    src = os.path.join(os.path.dirname(__file__), "fixtures", "format5", "single")
    shutil.copytree(src, tmp_path / "single")
    monkeypatch.setattr(packread, "decode_into", lambda *a: False)  # "not the layout a save writes"
    model, opt, _extra = _load_single(tmp_path / "single")
    same5(full_state(model, opt), _expected("single"))


def test_a_format6_member_in_another_layout_is_damage(tmp_path, monkeypatch) -> None:
    from arraycheckpoint.errors import CorruptCheckpointError

    ck = _save(tmp_path)
    monkeypatch.setattr(packread, "decode_into", lambda *a: False)
    with pytest.raises(CorruptCheckpointError, match="not the chunk file a save writes"):
        _load(ck)


def test_short_member_is_not_decoded() -> None:
    """A member whose size is not the exact uncompressed encoding is not decoded (False)."""
    from arraycheckpoint.planning.regions import Box

    class T:
        dtype, chunk_shape, inner_chunk_shape = "int64", (5, 3), (5, 3)

    out = np.zeros((5, 3), np.int64)
    lay = packread._Layout(T)
    raw = np.zeros(7, np.uint8)
    assert not packread.decode_into(raw, lay, (0, 0), [(Box((0, 0), (5, 3)), out)], ValueError)
