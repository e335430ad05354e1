"""A node the metadata does not name (a planted ``model/evil`` array beside the real ones, a group, a file) is
no part of the checkpoint: ``checkpoint_store`` neither lists nor serves it, so zarr-python and xarray users
never read it as part of the checkpoint, and ``verify`` warns about it (the checkpoint itself is sound)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import zarr
from faults.packtools import LAYOUTS, save_options

import arraycheckpoint as acp
from arraycheckpoint.tools.verify import verify
from arraycheckpoint.zarr import checkpoint_store

EVIL = "model/evil"


def _keys(store: object, how: str, prefix: str = "") -> list[str]:
    async def go() -> list[str]:
        if how == "list":
            return [k async for k in store.list()]  # type: ignore[attr-defined]
        if how == "prefix":
            return [k async for k in store.list_prefix(prefix)]  # type: ignore[attr-defined]
        return [k async for k in store.list_dir(prefix)]  # type: ignore[attr-defined]

    return asyncio.run(go())


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_planted_array_is_neither_listed_nor_served(tmp_path: Path, layout: str) -> None:
    ck = tmp_path / "ck"
    state = {"a": torch.arange(16.0), "b": torch.arange(6.0).reshape(2, 3)}
    acp.save(ck, {"model": state}, **save_options(layout))
    planted = zarr.create_array(ck / EVIL, shape=(4,), dtype="float32", dimension_names=["x"])
    planted[...] = np.full(4, 666, dtype="float32")
    zarr.create_group(ck / "model" / "evilgroup")
    zarr.create_group(ck / "rogue")
    (ck / "model" / "notes.txt").write_text("not a node")
    assert zarr.open_group(ck, mode="r")["model/evil"][0] == 666  # a plain walk of the directory sees it

    store = checkpoint_store(ck)
    for keys in (_keys(store, "list"), _keys(store, "prefix", "model"), _keys(store, "dir", "model")):
        assert not [k for k in keys if "evil" in k or "rogue" in k or "notes" in k], keys
    assert sorted(_keys(store, "dir", "model")) == ["a", "b", "zarr.json"]
    assert "rogue" not in _keys(store, "dir", "")
    root = zarr.open_group(store, mode="r")
    assert sorted(n for n, _ in root.members(max_depth=None)) == [".acp", "model", "model/a", "model/b"]
    with pytest.raises(FileNotFoundError, match="model/evil"):
        zarr.open_array(store, path=EVIL, mode="r")
    with pytest.raises(KeyError):
        root[EVIL]
    with pytest.raises(FileNotFoundError):
        zarr.open_group(store, path="rogue", mode="r")
    assert not asyncio.run(store.exists(f"{EVIL}/zarr.json"))
    assert asyncio.run(store.get(f"{EVIL}/c/0")) is None
    for name, want in state.items():  # the real arrays read as they were saved
        assert np.array_equal(root[f"model/{name}"][...], want.numpy())

    report = verify(ck)
    assert report.ok, [str(p) for p in report.problems]
    (warning,) = report.warnings
    for stray in (f"{EVIL}/zarr.json", "model/evilgroup/zarr.json", "rogue/zarr.json", "model/notes.txt"):
        assert stray in warning, warning
    assert "model/a/zarr.json" not in warning and ".acp" not in warning


def test_the_verify_command_warns_and_succeeds(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from arraycheckpoint.cli import main

    ck = tmp_path / "ck"
    acp.save(ck, {"model": {"a": torch.arange(4.0)}})
    zarr.create_array(ck / EVIL, shape=(4,), dtype="float32", dimension_names=["x"])
    assert main(["verify", str(ck)]) == 0
    out = capsys.readouterr().out
    assert "WARN 1 stray key(s)" in out and f"{EVIL}/zarr.json" in out and "BAD" not in out, out
    assert main(["verify", "--json", str(ck)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] and len(doc["warnings"]) == 1 and EVIL in doc["warnings"][0], doc


def test_verify_of_a_clean_checkpoint_warns_of_nothing(tmp_path: Path) -> None:
    for layout in LAYOUTS:
        acp.save(tmp_path / layout, {"model": {"a": torch.arange(4.0)}}, **save_options(layout))
        assert verify(tmp_path / layout).warnings == []
