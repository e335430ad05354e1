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
