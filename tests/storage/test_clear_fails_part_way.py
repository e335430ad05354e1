"""A save over an old checkpoint written in place (``memory://``, as on S3) whose clearing of the old objects
fails part way: the old checkpoint's markers went first (it never reads as committed with mixed contents), the
save fails, its abort deletes nothing, and its lock stays, no longer refreshed. After one lease the next save
there takes the lock over as a crashed save's and clears what remains (every key a save's), and commits; the
lock released instead would leave remains without a control file, which a save refuses as not a checkpoint."""

from __future__ import annotations

import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    SaveFailedError,
    StorageError,
)
from arraycheckpoint.storage import locks, register_scheme, storage_for
from arraycheckpoint.storage.base import LOCK_KEY
from arraycheckpoint.storage.memory import MemoryStorage

sys.path.insert(0, str(Path(__file__).parent.parent))
from simworld import run_ranks  # noqa: E402


@pytest.fixture(autouse=True)
def short_lease(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(locks.HEARTBEAT_ENV, "0.1")
    monkeypatch.setenv(locks.LEASE_ENV, "5")  # 0.5 s


class Refuses(MemoryStorage):
    """A store that refuses to delete the arrays' objects (the control files and the lock go)."""

    def delete_key(self, root: str, key: str, guard=None) -> None:
        if not key.startswith("."):
            raise StorageError(f"storage delete of {root}/{key} failed (permanent error): AccessDenied")
        super().delete_key(root, key, guard)


@pytest.fixture
def url() -> Iterator[str]:
    yield f"memory://clear-{uuid.uuid4().hex[:8]}/step_1"
    register_scheme("memory", None)


def test_remains_of_a_failed_clearing_are_removed_by_the_next_save(url: str) -> None:
    acp.save(url, {"w": np.arange(4096.0), "b": np.ones(3)})
    register_scheme("memory", Refuses)

    def save(comm: Any) -> str:  # two ranks: the coordinator's abort and release run
        try:
            acp.save(url, {"w": np.arange(4096.0) + 1, "b": np.zeros(3)}, overwrite=True, comm=comm)
        except (SaveFailedError, StorageError) as e:
            return str(e)
        return "committed"

    outcomes = run_ranks(2, save)
    assert all("AccessDenied" in o for o in outcomes), outcomes
    register_scheme("memory", None)
    store, final = storage_for(url)
    remains = store.list(final)
    assert LOCK_KEY in remains and any(not k.startswith(".") for k in remains), remains
    assert not any(k.startswith(".acp/") for k in remains), remains  # no control file is left
    with pytest.raises(CheckpointNotFoundError):
        acp.load(url, {"w": np.zeros(4096), "b": np.zeros(3)})
    with pytest.raises(CheckpointExistsError, match="in progress"):
        acp.save(url, {"w": np.arange(4096.0) + 2, "b": np.ones(3)})  # within its lease
    time.sleep(0.8)
    acp.save(url, {"w": np.arange(4096.0) + 2, "b": np.full(3, 2.0)})  # takes it over, clears, commits
    back = {"w": np.zeros(4096), "b": np.zeros(3)}
    acp.load(url, back)
    assert np.array_equal(back["w"], np.arange(4096.0) + 2) and np.array_equal(back["b"], np.full(3, 2.0))
    assert store.read(final, LOCK_KEY) is None
