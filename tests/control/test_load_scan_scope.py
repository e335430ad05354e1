"""A load checks the stored files of the arrays it reads, not the whole checkpoint (issue 11).

At 10,000 ranks every rank scanning the whole checkpoint (100,000 files) is a billion metadata operations
per load on a parallel file system. A rank reads what it loads: these tests count the directories a load
lists and the packs it opens, and show that damage in an array (or a pack) nobody reads does not fail the
load, while the same damage in what is read still does, naming the path. Both layouts are covered: arrays in
their own directories (``pack_array_bytes=0``) and small arrays in packs (format 5, the default).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from faults.packtools import (
    LAYOUTS,
    chunk_member,
    delete_member,
    pack_key,
    pack_of,
    rescuing_fifo,
    save_options,
)

import arraycheckpoint as acp
from arraycheckpoint.audit import scan as audit_scan
from arraycheckpoint.errors import CorruptCheckpointError, InconsistentCheckpointError
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.testing import chunk_files

#: Packs of about 4 KiB: the 8 x 4 float32 arrays below (156 stored bytes each) fill many packs.
SMALL_PACKS = PlanOptions(min_chunk_bytes=4 << 10)


def _state(n: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"w{i}": torch.randn(8, 4, generator=g) for i in range(n)}


def _count_scandirs(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = os.scandir

    def counting(path: str | os.PathLike[str] = ".") -> object:
        seen.append(os.fspath(path))
        return real(path)

    monkeypatch.setattr(audit_scan.os, "scandir", counting)
    return seen


def test_load_lists_only_the_arrays_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ck = str(tmp_path / "ck")
    state = _state(200)
    acp.save(ck, {"model": state}, **save_options("directory"))
    seen = _count_scandirs(monkeypatch)
    target = {"model": {"w7": torch.zeros(8, 4), "w150": torch.zeros(8, 4)}}
    acp.load(ck, target, strict=False)
    assert torch.equal(target["model"]["w7"], state["w7"]) and torch.equal(
        target["model"]["w150"], state["w150"]
    )
    listed = {os.path.relpath(p, ck) for p in seen}
    assert listed == {"model/w7", "model/w150"}, sorted(listed)[:10]

    seen.clear()
    full = {"model": {k: torch.zeros(8, 4) for k in state}}
    acp.load(ck, full)
    assert len(seen) == 200  # one listing per array read, nothing else
    assert all(torch.equal(full["model"][k], v) for k, v in state.items())


def _count_opens(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    seen: list[str] = []
    real = os.open

    def counting(path: str, flags: int, *args: object, **kwargs: object) -> int:
        dir_fd = kwargs.get("dir_fd")
        # the checks open a file component by component below the checkpoint (filecheck.open_below):
        # a name relative to a directory descriptor is counted under that directory's path (links resolved)
        where = os.path.join(os.readlink(f"/proc/self/fd/{dir_fd}"), path) if dir_fd is not None else path
        seen.append(os.path.realpath(where))
        return real(path, flags, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(audit_scan.os, "open", counting)
    return seen


def test_load_opens_only_the_packs_it_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed arrays: no directory is listed, and exactly the packs holding the arrays read are opened,
    once each, however many of their arrays are read."""
    ck = str(tmp_path / "ck")
    state = _state(200)
    acp.save(ck, {"model": state}, plan_options=SMALL_PACKS)
    packs = {k: pack_key(ck, f"model/{k}") for k in state}
    assert None not in packs.values() and len(set(packs.values())) > 5, sorted(set(packs.values()))
    scans, opens = _count_scandirs(monkeypatch), _count_opens(monkeypatch)
    target = {"model": {"w7": torch.zeros(8, 4), "w150": torch.zeros(8, 4)}}
    acp.load(ck, target, strict=False)
    assert torch.equal(target["model"]["w7"], state["w7"]) and torch.equal(
        target["model"]["w150"], state["w150"]
    )
    assert scans == []
    # each pack read is opened twice: once by the checks (its ZIP directory), once to read its members
    opened = sorted(os.path.relpath(p, os.path.realpath(ck)) for p in opens if "/.acp/packs/" in p)
    assert opened == sorted(2 * [packs["w7"], packs["w150"]]), opened

    opens.clear()
    full = {"model": {k: torch.zeros(8, 4) for k in state}}
    acp.load(ck, full)
    opened = sorted(os.path.relpath(p, os.path.realpath(ck)) for p in opens if "/.acp/packs/" in p)
    # each pack: checked once, read once; the pack after the rank's last one is not looked for (the metadata
    # says how many packs the rank wrote: a stray pack there is read by no reader, verify and checkpoint_store too)
    assert opened == sorted(2 * sorted(set(packs.values()))), opened
    assert scans == []
    assert all(torch.equal(full["model"][k], v) for k, v in state.items())


def test_damage_outside_what_is_read_does_not_fail_the_load(tmp_path: Path) -> None:
    ck = str(tmp_path / "ck")
    state = _state(3)
    acp.save(ck, {"model": state}, **save_options("directory"))
    victim = tmp_path / "ck" / "model" / "w2"
    (chunk,) = chunk_files(victim)
    os.unlink(chunk)
    os.mkfifo(chunk)  # a FIFO where w2's chunk was: reading it would block forever
    target = {"model": {"w0": torch.zeros(8, 4)}}
    acp.load(ck, target, strict=False)
    assert torch.equal(target["model"]["w0"], state["w0"])
    with pytest.raises(CorruptCheckpointError, match="w2"):
        acp.load(ck, {"model": {"w2": torch.zeros(8, 4)}}, strict=False)


@pytest.mark.parametrize("damage", ["fifo", "garbage", "missing"])
def test_damage_in_a_pack_nobody_reads_does_not_fail_the_load(tmp_path: Path, damage: str) -> None:
    """The pack of w40 is a FIFO (opening it would block), garbage, or gone: a load of arrays in other packs
    never opens it; a load of w40 is refused, naming the tensor and the pack."""
    ck = tmp_path / "ck"
    state = _state(60)
    acp.save(str(ck), {"model": state}, plan_options=SMALL_PACKS)
    victim = pack_of(ck, "model/w40")
    assert pack_key(ck, "model/w0") != pack_key(ck, "model/w40")
    victim.unlink()
    if damage == "fifo":
        os.mkfifo(victim)
    elif damage == "garbage":
        victim.write_bytes(b"\0" * 4096)
    with rescuing_fifo(victim) as rescued:  # a load that opened the FIFO would block: fail instead
        target = {"model": {"w0": torch.zeros(8, 4)}}
        acp.load(str(ck), target, strict=False)
        assert torch.equal(target["model"]["w0"], state["w0"])
        error = InconsistentCheckpointError if damage == "missing" else CorruptCheckpointError
        with pytest.raises(error, match="'model/w40'") as info:
            acp.load(str(ck), {"model": {"w40": torch.zeros(8, 4)}}, strict=False)
    assert not rescued.is_set(), "a load blocked opening a FIFO pack"
    assert str(victim) in str(info.value)


def test_a_linked_array_directory_is_refused_when_read(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    state = _state(2)
    acp.save(str(ck), {"model": state}, **save_options("directory"))
    elsewhere = tmp_path / "elsewhere"
    (ck / "model" / "w1").rename(elsewhere)
    (ck / "model" / "w1").symlink_to(elsewhere)
    target = {"model": {"w0": torch.zeros(8, 4)}}
    acp.load(str(ck), target, strict=False)
    assert torch.equal(target["model"]["w0"], state["w0"])
    with pytest.raises(CorruptCheckpointError, match="symlink"):
        acp.load(str(ck), {"model": {"w1": torch.zeros(8, 4)}}, strict=False)


def test_a_linked_pack_is_refused_when_read(tmp_path: Path) -> None:
    """A pack replaced by a link to an identical file elsewhere: arrays of other packs load; the linked
    pack's arrays are refused."""
    ck = tmp_path / "ck"
    state = _state(60)
    acp.save(str(ck), {"model": state}, plan_options=SMALL_PACKS)
    linked = pack_of(ck, "model/w40")
    elsewhere = tmp_path / "elsewhere.zip"
    linked.rename(elsewhere)
    linked.symlink_to(elsewhere)
    target = {"model": {"w0": torch.zeros(8, 4)}}
    acp.load(str(ck), target, strict=False)
    assert torch.equal(target["model"]["w0"], state["w0"])
    with pytest.raises(CorruptCheckpointError, match="link") as info:
        acp.load(str(ck), {"model": {"w40": torch.zeros(8, 4)}}, strict=False)
    assert "'model/w40'" in str(info.value)


def test_a_linked_pack_directory_is_refused_when_a_pack_is_read(tmp_path: Path) -> None:
    """``.acp/packs`` replaced by a link to a copy elsewhere: an array in its own directory still loads (no
    pack is looked at), every packed array is refused."""
    import shutil

    ck = tmp_path / "ck"
    state = {"small": torch.ones(8, 4), "big": torch.randn(600, 1000)}  # 2.4 MB: above the target size
    acp.save(str(ck), {"model": state}, plan_options=PlanOptions(min_chunk_bytes=1 << 20))
    assert pack_key(ck, "model/big") is None and pack_key(ck, "model/small") is not None
    packs = ck / ".acp" / "packs"
    shutil.copytree(packs, tmp_path / "elsewhere")
    shutil.rmtree(packs)
    packs.symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    target = {"model": {"big": torch.zeros(600, 1000)}}
    acp.load(str(ck), target, strict=False)
    assert torch.equal(target["model"]["big"], state["big"])
    with pytest.raises(CorruptCheckpointError, match="symlink") as info:
        acp.load(str(ck), {"model": {"small": torch.zeros(8, 4)}}, strict=False)
    assert "'model/small'" in str(info.value)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_missing_chunk_of_a_read_array_is_named(tmp_path: Path, layout: str) -> None:
    ck = tmp_path / "ck"
    acp.save(str(ck), {"model": {"w": torch.arange(10.0)}}, **save_options(layout))
    if layout == "directory":
        (chunk,) = chunk_files(ck / "model" / "w")
        os.unlink(chunk)
    else:
        delete_member(pack_of(ck, "model/w"), chunk_member("model/w", (0,)))
    with pytest.raises(InconsistentCheckpointError, match="'model/w'"):
        acp.load(str(ck), {"model": {"w": torch.zeros(10)}})


@pytest.mark.parametrize("layout", LAYOUTS)
def test_object_store_lists_once_when_that_is_cheaper(layout: str) -> None:
    """A rank reading most arrays of an object-store checkpoint makes one listing, not one per array.
    Packed arrays are never listed: their packs' directories say what they hold."""
    import arraycheckpoint.storage.memory as memory_storage  # noqa: F401 - registers memory://

    url = f"memory://scan-scope/{layout}/ck"
    state = _state(1500)
    acp.save(url, {"model": state}, **save_options(layout))
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
        assert calls == ([root] if layout == "directory" else []), calls[:5]
        assert all(torch.equal(full["model"][k], v) for k, v in state.items())
        calls.clear()
        part = {"model": {"w3": torch.zeros(8, 4)}}
        acp.load(url, part, strict=False)
        if layout == "directory":
            assert [c.rsplit("/", 2)[-2:] for c in calls] == [["model", "w3"]], calls
        else:
            assert calls == [], calls
        assert np.array_equal(part["model"]["w3"].numpy(), state["w3"].numpy())
    finally:
        type(storage).list = real  # type: ignore[method-assign]
