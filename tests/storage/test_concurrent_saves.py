"""Two jobs saving to one object-store prefix at once. A save that found the other save's lock at its target
check (state "leftover": a crashed save's, as far as it could tell) and took the lock after that save committed
and released it deleted the committed checkpoint it never was asked to overwrite, and wrote its own in its
place. Now only one commits, the other says so, and nothing of the committed one is deleted."""

from __future__ import annotations

import json

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import storage_for
from arraycheckpoint.storage.base import LOCK_KEY

FIRST = {"extra_state": {"w": np.arange(6, dtype=np.float32)}}


@pytest.fixture(params=["memory", "fsspec", "s3"])
def url(request) -> str:
    if request.param == "memory":
        return f"memory://concurrent-saves/{request.node.name}"
    if request.param == "fsspec":
        return f"local://{request.getfixturevalue('tmp_path')}/ck"
    return request.getfixturevalue("s3_prefix") + "/ck"


def test_a_save_that_saw_the_others_lock_never_deletes_what_that_save_committed(url: str) -> None:
    storage, root = storage_for(url)
    storage.write(root, LOCK_KEY, json.dumps({"token": "first", "time": 0}).encode())  # the first save runs
    storage.check_target(root, overwrite=False)  # the second save looks: a lock, no marker ("leftover")
    storage.delete_key(root, LOCK_KEY)
    acp.save(url, FIRST)  # the first save commits and releases its lock
    before = storage.list(root)
    with pytest.raises(CheckpointExistsError, match="while this one was starting"):
        storage.acquire(root, "second")
    assert storage.list(root) == before  # nothing deleted, no lock left behind
    back = acp.load(url, {"extra_state": {"w": np.zeros(6, np.float32)}})["extra_state"]["w"]
    assert np.array_equal(back, FIRST["extra_state"]["w"])
