"""Something other than a lock file at a target's lock path (``.acp-lock-<h>``: a FIFO, a directory, a link)
refuses the save with an error that says so, naming it; nothing is committed, and what is there is kept.

Before: the save was refused as "another save to ... is in progress (lock ... held by ?); wait for it", which no
wait ever ends: no save holds such a path, and none takes it over."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage.localnames import lock_path


@pytest.mark.parametrize("kind", ["fifo", "directory", "link", "dangling link"])
def test_a_lock_path_that_is_no_lock_file_is_named_not_waited_for(tmp_path: Path, kind: str) -> None:
    lock = lock_path(tmp_path / "ck")
    kept = tmp_path / "notes.txt"
    kept.write_text("mine")
    if kind == "fifo":
        os.mkfifo(lock)
    elif kind == "directory":
        lock.mkdir()
        (lock / "x").write_text("x")
    elif kind == "link":
        lock.symlink_to(kept)
    else:
        lock.symlink_to(tmp_path / "absent")
    with pytest.raises(CheckpointExistsError) as caught:
        acp.save(tmp_path / "ck", {"m": {"w": np.arange(4, dtype=np.float32)}})
    message = str(caught.value)
    assert str(lock) in message and "not a lock file" in message, message
    assert "in progress" not in message and "wait for it" not in message, message
    assert not (tmp_path / "ck").exists()
    assert os.path.lexists(lock) and kept.read_text() == "mine"
