"""Packed arrays on a local file system are decoded by the engine itself (arraycheckpoint.engine.packread):
one pread per member and hardware crc32c, instead of a tensorstore array per tensor. Both paths must give the
same bits, partial regions included, and a member in any other layout must fall back to tensorstore."""

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


@pytest.mark.skipif(not packread.fast_path_available(), reason="no hardware crc32c in this interpreter")
def test_packed_arrays_are_decoded_by_the_engine_bit_exactly(tmp_path, monkeypatch) -> None:
    ck = _save(tmp_path)
    calls = []
    real = packread.read_array
    monkeypatch.setattr(packread, "read_array", lambda *a: calls.append(a[1].name) or real(*a))
    _same(_load(ck), _state())
    assert {"extra_state/w", "extra_state/b", "extra_state/i"} <= set(calls)


def test_a_member_in_another_layout_falls_back_to_tensorstore(tmp_path, monkeypatch) -> None:
    ck = _save(tmp_path)
    monkeypatch.setattr(packread, "read_array", lambda *a: None)  # "not the layout a save writes"
    _same(_load(ck), _state())


@pytest.mark.skipif(not packread.fast_path_available(), reason="no hardware crc32c in this interpreter")
def test_short_member_is_not_decoded(tmp_path) -> None:
    """A member whose size is not the exact uncompressed encoding is left to tensorstore (None)."""
    ck = _save(tmp_path)
    meta = acp.read_metadata(ck)
    tm = meta.tensors["extra_state/i"]

    class Short:
        path, key = "p", "k"

        def member(self, name: str) -> bytes:
            return b"\0" * 7

    members = packread.chunk_members(tm, ".")
    assert packread.read_array(Short(), tm, members, [b for b in []]) is not None  # nothing wanted: no read
    from arraycheckpoint.regions import Box

    assert packread.read_array(Short(), tm, members, [Box.full(tm.shape)]) is None
