"""The target check of a save that writes in place (object stores, memory, fsspec): a crashed save's leftovers
are cleared, the user's objects never. One of our control files (or a stale lock) beside the user's objects
used to make the whole prefix "ours", and the save deleted the user's files; a save that found the target
empty wrote into a checkpoint another save committed meanwhile."""

from __future__ import annotations

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import storage_for
from arraycheckpoint.storage.base import LOCK_KEY, is_checkpoint_key

STATE = {"extra_state": {"w": np.arange(6, dtype=np.float32)}}


def _backends(request) -> str:
    if request.param == "memory":
        return f"memory://target-claim/{request.node.name}"
    if request.param == "fsspec":
        return f"local://{request.getfixturevalue('tmp_path')}/ck"
    return request.getfixturevalue("s3_prefix") + "/ck"


@pytest.fixture(params=["memory", "fsspec", "s3"])
def url(request) -> str:
    return _backends(request)


def _load(url: str) -> np.ndarray:
    return acp.load(url, {"extra_state": {"w": np.zeros(6, np.float32)}})["extra_state"]["w"]


@pytest.mark.parametrize("ours", [".acp/metadata.json", ".metadata.json", ".acp/zarr.json", "model/w/c.0"])
def test_a_control_file_beside_user_objects_does_not_make_them_ours(url, ours) -> None:
    storage, root = storage_for(url)
    storage.write(root, ours, b"{}")
    storage.write(root, "data.csv", b"precious")
    storage.write(root, "notes/readme.txt", b"precious")
    with pytest.raises(CheckpointExistsError, match="data.csv"):
        acp.save(url, STATE)
    storage, root = storage_for(url)
    assert (
        storage.read(root, "data.csv") == b"precious"
        and storage.read(root, "notes/readme.txt") == b"precious"
    )
    assert not storage.exists(root, LOCK_KEY)  # the claim was given back


def test_a_committed_checkpoint_is_replaced_whole_with_overwrite(url) -> None:
    """As a rename replaces a directory: what was inside the committed checkpoint goes with it."""
    acp.save(url, STATE)
    storage, root = storage_for(url)
    storage.write(root, "README.md", b"inside the checkpoint")
    acp.save(url, {"extra_state": {"w": np.ones(6, np.float32)}}, overwrite=True)
    storage, root = storage_for(url)
    assert not storage.exists(root, "README.md")
    assert np.array_equal(_load(url), np.ones(6, np.float32))


def test_a_crashed_saves_leftovers_are_cleared(url) -> None:
    storage, root = storage_for(url)
    for key in (
        ".acp/metadata.json",
        ".acp/packs/0.0.zip",
        "zarr.json",
        "model/w/zarr.json",
        "model/w/c.0.1",
    ):
        storage.write(root, key, b"stale")
    acp.save(url, STATE)
    storage, root = storage_for(url)
    assert not storage.exists(root, "model/w/c.0.1")
    assert np.array_equal(_load(url), STATE["extra_state"]["w"])


def test_a_checkpoint_committed_between_check_and_claim_is_not_written_into(monkeypatch) -> None:
    url = "memory://target-claim/race"
    storage, root = storage_for(url)
    storage.check_target(root, overwrite=False)  # empty
    acp.save(url, STATE)  # another save commits meanwhile
    with pytest.raises(CheckpointExistsError, match="while this one was starting"):
        storage.acquire(root, "late")
    assert not storage.exists(root, LOCK_KEY)
    assert np.array_equal(_load(url), STATE["extra_state"]["w"])


@pytest.mark.parametrize(
    "key,ours",
    [
        (".acp-lock", True),
        (".acp/packs/3.1.zip", True),
        (".metrics-load.json", True),
        ("zarr.json", True),
        ("model/layers.0.w/c.0.12", True),
        ("model/w/c", True),
        ("model/w/c/0/1", True),  # formats 1 and 2
        ("optimizer/w/exp_avg/zarr.json", True),
        ("data.csv", False),
        ("notes/readme.txt", False),
        (".gitignore", False),
        ("model/.hidden/c.0", False),
        ("model/w/c.0.x", False),
        ("model/w/c/0/x", False),
        ("model//c.0", False),
    ],
)
def test_checkpoint_keys(key: str, ours: bool) -> None:
    assert is_checkpoint_key(key) is ours


def test_fsspec_lock_is_exclusive_when_two_saves_look_at_once(tmp_path, monkeypatch) -> None:
    """Both saves look before either writes: one lock, one holder (a look-then-write let both hold it)."""
    import threading

    from arraycheckpoint.storage.fsspec_store import FsspecStorage

    url = f"local://{tmp_path}/ck"
    barrier = threading.Barrier(2, timeout=10)
    real_exists = FsspecStorage.exists

    def exists(self, root, key):
        got = real_exists(self, root, key)
        if key == LOCK_KEY:
            barrier.wait()
        return got

    a_done = threading.Event()
    real_write = FsspecStorage.write

    def write(self, root, key, data):  # the second save's lock write lands after the first holds the lock
        if key == LOCK_KEY and b'"b"' in data:
            a_done.wait(10)
        return real_write(self, root, key, data)

    monkeypatch.setattr(FsspecStorage, "exists", exists)
    monkeypatch.setattr(FsspecStorage, "write", write)
    results: dict[str, object] = {}

    def claim(token: str) -> None:
        storage, root = storage_for(url)
        try:
            storage.acquire(root, token)
            results[token] = "held"
            if token == "a":
                a_done.set()
        except CheckpointExistsError as e:
            results[token] = e
            a_done.set()
        except threading.BrokenBarrierError:  # the other never looked: an exclusive create needs no look
            results[token] = "held"

    threads = [threading.Thread(target=claim, args=(t,)) for t in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(str(v) == "held" for v in results.values()) == [False, True], results
