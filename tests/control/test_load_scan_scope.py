"""A load checks the stored files of the arrays it reads, not the whole checkpoint (issue 11).

At 10,000 ranks every rank scanning the whole checkpoint (100,000 files) is a billion metadata operations
per load on a parallel file system. A rank reads what it loads: these tests count the directories a load
lists and show that damage in an array nobody reads does not fail the load, while the same damage in an
array that is read still does, naming the path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint import safety
from arraycheckpoint.errors import CorruptCheckpointError, InconsistentCheckpointError
from arraycheckpoint.testing import chunk_files


def _state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(8, 4, generator=g) for i in range(n)}


def _count_scandirs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = os.scandir

    def counting(path: str | os.PathLike[str] = ".") -> object:
        seen.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(safety.os, "scandir", counting)
    return seen


def test_load_lists_only_the_arrays_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = str(tmp_path / "ck")
    state = _state(200)
    acp.save(ck, {"model": state})
    seen = _count_scandirs(monkeypatch)
    target = {"model": {"w7": torch.zeros(8, 4), "w150": torch.zeros(8, 4)}}
    acp.load(ck, target, strict=False)
    assert torch.equal(target["model"]["w7"], state["w7"]) and torch.equal(target["model"]["w150"], state["w150"])
    listed = {os.path.relpath(p, ck) for p in seen}
    assert listed == {"model/w7", "model/w150"}, sorted(listed)[:10]

    seen.clear()
    full = {"model": {k: torch.zeros(8, 4) for k in state}}
    acp.load(ck, full)
    assert len(seen) == 200  # one listing per array read, nothing else
    assert all(torch.equal(full["model"][k], v) for k, v in state.items())


def test_damage_outside_what_is_read_does_not_fail_the_load(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    state = _state(3)
    acp.save(ck, {"model": state})
    victim = tmp_path / "ck" / "model" / "w2"
    (chunk, ) = chunk_files(victim)
    os.unlink(chunk)
    os.mkfifo(chunk)  # a FIFO where w2's chunk was: reading it would block forever
    target = {"model": {"w0": torch.zeros(8, 4)}}
    acp.load(ck, target, strict=False)
    assert torch.equal(target["model"]["w0"], state["w0"])
    with pytest.raises(CorruptCheckpointError, match="w2"):
        acp.load(ck, {"model": {"w2": torch.zeros(8, 4)}}, strict=False)


def test_a_linked_array_directory_is_refused_when_read(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    state = _state(2)
    acp.save(str(ck), {"model": state})
    elsewhere = tmp_path / "elsewhere"
    (ck / "model" / "w1").rename(elsewhere)
    (ck / "model" / "w1").symlink_to(elsewhere)
    target = {"model": {"w0": torch.zeros(8, 4)}}
    acp.load(str(ck), target, strict=False)
    assert torch.equal(target["model"]["w0"], state["w0"])
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        acp.load(str(ck), {"model": {"w1": torch.zeros(8, 4)}}, strict=False)


def test_a_missing_chunk_of_a_read_array_is_named(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    acp.save(str(ck), {"model": {"w": torch.arange(10.0)}}, )
    (chunk,) = chunk_files(ck / "model" / "w")
    os.unlink(chunk)
    with pytest.raises(InconsistentCheckpointError, match="'model/w'"):
        acp.load(str(ck), {"model": {"w": torch.zeros(10)}})


def test_object_store_lists_once_when_that_is_cheaper() -> None:
    """A rank reading most arrays of an object-store checkpoint makes one listing, not one per array."""
    import arraycheckpoint.storage.memory as memory_storage  # noqa: F401 - registers memory://

    url = "memory://scan-scope/ck"
    state = _state(1500)
    acp.save(url, {"model": state})
    storage, root = acp.storage.storage_for(url)
    calls: list[str] = []
    real = type(storage).list

    def counting(self: object, r: str) -> list[str]:
        calls.append(r)
        return real(self, r)  # type: ignore[arg-type]

    type(storage).list = counting  # type: ignore[method-assign]
    try:
        full = {"model": {k: torch.zeros(8, 4) for k in state}}
        acp.load(url, full)
        assert calls == [root], calls[:5]
        calls.clear()
        part = {"model": {"w3": torch.zeros(8, 4)}}
        acp.load(url, part, strict=False)
        assert [c.rsplit("/", 2)[-2:] for c in calls] == [["model", "w3"]], calls
        assert np.array_equal(part["model"]["w3"].numpy(), state["w3"].numpy())
    finally:
        type(storage).list = real  # type: ignore[method-assign]
