"""acp.dcp.Reader never lets DCP's planner unpickle a checkpoint's stored value unless allow_pickle=True.

DCP's ``DefaultLoadPlanner.load_bytes`` runs ``torch.load(weights_only=False)`` on what the reader hands it;
a hostile ``.acp/metadata.json`` could put any pickle there (found by the session 20 review: a planted
``os.system`` ran on ``dcp.load(state, storage_reader=acp.dcp.Reader(path))``).
"""

from __future__ import annotations

import base64
import io
import json
import os
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
dcp = pytest.importorskip("torch.distributed.checkpoint")

import arraycheckpoint as acp  # noqa: E402


class _Planted:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> Any:
        return (open, (self.marker, "w"))  # creates the marker file when unpickled


def _plant(path: Path, key: str, payload: bytes) -> None:
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    found = []

    def walk(o: Any) -> None:
        if isinstance(o, dict):
            for k, v in o.items():
                if k == "bytes" and isinstance(v, dict) and key in v:
                    v[key] = base64.b64encode(payload).decode()
                    found.append(k)
                else:
                    walk(v)
        elif isinstance(o, list):
            for v in o:
                walk(v)

    walk(doc)
    assert found, "the Writer stores DCP values under 'bytes'"
    meta.write_text(json.dumps(doc))


def _saved(tmp_path: Path) -> Path:
    path = tmp_path / "ckpt"
    state = {"w": torch.arange(4.0), "step": 7, "betas": (0.9, 0.99), "name": "a"}
    dcp.save(state, storage_writer=acp.dcp.Writer(str(path)))
    return path


def test_plain_values_come_back_without_allow_pickle(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    target: dict[str, Any] = {"w": torch.zeros(4), "step": 0, "betas": (0.0, 0.0), "name": ""}
    dcp.load(target, storage_reader=acp.dcp.Reader(str(path)))
    assert torch.equal(target["w"], torch.arange(4.0))
    assert target["step"] == 7
    assert target["betas"] == (0.9, 0.99) and target["name"] == "a"


def test_a_planted_pickle_is_refused_and_never_run(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    marker = tmp_path / "ran"
    buf = io.BytesIO()
    torch.save(_Planted(str(marker)), buf)
    _plant(path, "step", buf.getvalue())
    target: dict[str, Any] = {"w": torch.zeros(4), "step": 0, "betas": (0.0, 0.0), "name": ""}
    with pytest.raises(BaseException) as info:
        dcp.load(target, storage_reader=acp.dcp.Reader(str(path)))
    assert "step" in str(info.value) and "allow_pickle" in str(info.value)
    assert not marker.exists()
    # the caller who trusts the checkpoint opts in, as with acp.load(..., allow_pickle=True)
    dcp.load(target, storage_reader=acp.dcp.Reader(str(path), allow_pickle=True))
    assert marker.exists()


def test_a_value_that_is_not_base64_names_it(tmp_path: Path) -> None:
    path = _saved(tmp_path)
    meta = path / ".acp" / "metadata.json"
    _plant(path, "step", b"x")
    doc = json.loads(meta.read_text())
    raw = json.dumps(doc).replace(base64.b64encode(b"x").decode(), "!!not base64!!")
    meta.write_text(raw)
    with pytest.raises(BaseException, match="'step'.*not base64"):
        dcp.load(
            {"w": torch.zeros(4), "step": 0, "betas": (0.0, 0.0), "name": ""},
            storage_reader=acp.dcp.Reader(str(path)),
        )
    assert os.path.exists(path / ".acp" / "committed")


def test_a_tensor_torch_has_no_dtype_for_is_named(tmp_path: Path) -> None:
    """A JAX-saved float8_e3m4 made Reader.read_metadata fail with a bare KeyError: dtype(float8_e3m4)."""
    import ml_dtypes
    import numpy as np

    path = tmp_path / "ckpt"
    acp.save(str(path), {"model": {"w": np.zeros(4, dtype=ml_dtypes.float8_e3m4), "b": torch.ones(2)}})
    with pytest.raises(BaseException, match="'model/w'.*float8_e3m4"):
        dcp.load({"model.b": torch.zeros(2)}, storage_reader=acp.dcp.Reader(str(path)))


def test_two_keys_escaped_to_one_entry_are_named(tmp_path: Path) -> None:
    """``w:1`` is stored escaped as ``w~c1``, which a literal key ``w~c1`` also is: the error named neither."""
    with pytest.raises(BaseException, match=r"'w:1' and 'w~c1' would both be stored as 'w~c1'"):
        dcp.save(
            {"w:1": torch.ones(2), "w~c1": torch.zeros(2)}, storage_writer=acp.dcp.Writer(str(tmp_path / "c"))
        )
    assert not (tmp_path / "c" / ".acp" / "committed").exists()
