"""Files swapped between the load's checks and its reads (docs/security.md, "Race the reader"): a chunk file or
a pack replaced by a FIFO, a symbolic link, a directory, or cut short after ``check_chunk_files`` passed. The
load must answer with an error of ours naming the tensor and the file, within a bound: never hang on a FIFO
(a blocking open of one waited for a writer forever), never read through a link, never a raw ``OSError``."""

from __future__ import annotations

import os
import shutil
import threading

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.audit import scan
from arraycheckpoint.errors import ArrayCheckpointError, CorruptCheckpointError

_SMALL = {"min_chunk_bytes": 1 << 11, "max_chunk_bytes": 1 << 11, "inner_chunk_bytes": 1 << 9}
OWN = acp.PlanOptions(**_SMALL, pack_array_bytes=0)  # chunk files of their own
PACKED = acp.PlanOptions(**_SMALL)  # every chunk file in rank 0's packs


def _state() -> dict[str, np.ndarray]:
    return {"w": np.arange(48 * 40, dtype=np.float32).reshape(48, 40)}


def _swap_after_check(monkeypatch, swap) -> None:
    real = scan.check_chunk_files

    def checked(*a, **k):
        out = real(*a, **k)
        swap()
        return out

    monkeypatch.setattr(scan, "check_chunk_files", checked)


def _load_bounded(ck: str, fifo: str | None = None) -> BaseException | None:
    """Load ``ck`` on a thread; if it is still running after 20 s (blocked on ``fifo``), unblock it and fail."""
    box: list[BaseException | None] = [None]

    def run() -> None:
        try:
            acp.load(ck, {"extra_state": {"w": np.zeros((48, 40), np.float32)}})
        except BaseException as e:  # noqa: BLE001
            box[0] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():
        if fifo is not None:  # release the blocked open so the thread ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(20)
        pytest.fail("the load blocked on a file swapped after the checks")
    return box[0]


def _first_chunk(ck: str) -> str:
    d = os.path.join(ck, "extra_state", "w")
    return os.path.join(d, sorted(f for f in os.listdir(d) if f.startswith("c"))[0])


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
def test_chunk_file_swapped_after_the_checks(tmp_path, monkeypatch, kind) -> None:
    ck = str(tmp_path / "ck")
    acp.save(ck, {"extra_state": _state()}, plan_options=OWN)
    victim = _first_chunk(ck)
    elsewhere = str(tmp_path / "elsewhere")
    shutil.copy(victim, elsewhere)  # a valid chunk file outside the checkpoint: never read through a link

    def swap() -> None:
        os.unlink(victim)
        if kind == "fifo":
            os.mkfifo(victim)
        elif kind == "symlink":
            os.symlink(elsewhere, victim)
        else:
            os.mkdir(victim)

    _swap_after_check(monkeypatch, swap)
    err = _load_bounded(ck, victim if kind == "fifo" else None)
    assert isinstance(err, ArrayCheckpointError), repr(err)
    assert "extra_state/w" in str(err) and victim in str(err), err
    assert ("symlink" if kind == "symlink" else "not a regular file") in str(err), err


def test_chunk_file_cut_after_the_checks(tmp_path, monkeypatch) -> None:
    ck = str(tmp_path / "ck")
    acp.save(ck, {"extra_state": _state()}, plan_options=OWN)
    victim = _first_chunk(ck)
    _swap_after_check(monkeypatch, lambda: os.truncate(victim, os.path.getsize(victim) // 2))
    err = _load_bounded(ck)
    assert isinstance(err, ArrayCheckpointError) and "extra_state/w" in str(err), repr(err)


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory", "missing", "cut", "packs_link"])
def test_pack_swapped_after_the_checks(tmp_path, monkeypatch, kind) -> None:
    ck = str(tmp_path / "ck")
    acp.save(ck, {"extra_state": _state()}, plan_options=PACKED)
    packs = os.path.join(ck, ".acp", "packs")
    names = sorted(os.listdir(packs))
    elsewhere = str(tmp_path / "elsewhere")
    shutil.copytree(packs, elsewhere)

    def swap() -> None:
        if kind == "packs_link":  # the directory of packs becomes a link to a copy outside the checkpoint
            shutil.rmtree(packs)
            os.symlink(elsewhere, packs)
            return
        for name in names:  # every pack: whichever the load opens first
            victim = os.path.join(packs, name)
            if kind == "cut":
                os.truncate(victim, os.path.getsize(victim) // 2)
                continue
            os.unlink(victim)
            if kind == "fifo":
                os.mkfifo(victim)
            elif kind == "symlink":
                os.symlink(os.path.join(elsewhere, name), victim)
            elif kind == "directory":
                os.mkdir(victim)

    _swap_after_check(monkeypatch, swap)
    err = _load_bounded(ck, os.path.join(packs, names[0]) if kind == "fifo" else None)
    assert isinstance(err, ArrayCheckpointError), repr(err)
    if kind in ("fifo", "symlink", "directory", "packs_link"):
        assert isinstance(err, CorruptCheckpointError), repr(err)
    assert ".acp/packs" in str(err) and "extra_state/w" in str(err), err


def test_object_store_pack_cut_after_the_checks(monkeypatch) -> None:
    """On an object store a member's ranged read past the pack's end was tensorstore's raw ``OUT_OF_RANGE``
    ``ValueError``; it is damage naming the tensor, the member and the pack. (The members are read after the
    checks: not served from the pack's end that the check of its directory read, which would hold them all.)"""
    from arraycheckpoint.audit import packdir
    from arraycheckpoint.storage import storage_for

    monkeypatch.setattr(packdir, "KEEP_HELD_BYTES", 0)

    url = "memory://swapped-after-check/ck"
    acp.save(url, {"extra_state": _state()}, plan_options=PACKED)
    storage, root = storage_for(url)
    keys = [k for k in storage.list(root) if k.startswith(".acp/packs/")]

    def cut() -> None:
        for key in keys:
            raw = storage.read(root, key)
            storage.write(root, key, raw[: len(raw) // 2])

    _swap_after_check(monkeypatch, cut)
    with pytest.raises(CorruptCheckpointError) as info:
        acp.load(url, {"extra_state": {"w": np.zeros((48, 40), np.float32)}})
    assert "extra_state/w" in str(info.value) and ".acp/packs/" in str(info.value), info.value
