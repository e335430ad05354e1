"""A manager's start-up cleanup never puts a replaced copy back into a step whose save is in flight.

A save that replaces a committed step (``overwrite``) renames the old one aside
(``<step>.acp-old-.<step>.acp-staging-<token>``), then its own staging into place. A copy aside whose step is
gone is a crashed overwrite's, and cleanup puts the newest back. Before, cleanup did so while another job's
save of that step was between its two renames (its lock live): an older crashed overwrite's copy went into
the step, the live save's own rename then failed (the step was no longer absent), and the copy it had moved
aside, the newest committed one, was deleted by the next cleanup as a replaced copy of a step that exists.
Now every copy of a step whose lock is live stays as it is; once that save is gone, the newest goes back.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from lease_helpers import lock_held

import arraycheckpoint as acp
from arraycheckpoint.storage import LocalStorage


def test_cleanup_leaves_the_copies_of_a_step_a_live_save_replaces(tmp_path: Path) -> None:
    older = tmp_path / "step_5.acp-old-.step_5.acp-staging-dead"  # an overwrite that crashed long ago
    acp.save(str(tmp_path / "s"), {"w": np.full(3, 1)})
    os.rename(tmp_path / "s", older)
    time.sleep(0.01)  # distinct commit times
    acp.save(str(tmp_path / "step_5"), {"w": np.full(3, 2)})  # the step as committed now

    with lock_held(str(tmp_path / "step_5"), "live"):
        # the live save's commit: its first rename moved the committed step aside; its second is next
        newest = tmp_path / "step_5.acp-old-.step_5.acp-staging-live"
        os.rename(tmp_path / "step_5", newest)
        LocalStorage().cleanup_leftovers(str(tmp_path))
        assert not (tmp_path / "step_5").exists()  # before: the older copy, put back under the live save
        assert older.is_dir() and newest.is_dir()
    # that save is gone (crashed between its renames): the newest copy is the step's
    LocalStorage().cleanup_leftovers(str(tmp_path))
    back = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(tmp_path / "step_5"), back)
    assert np.array_equal(back["w"], np.full(3, 2))
    assert sorted(os.listdir(tmp_path)) == ["step_5"]


CLEANUP = """
import sys
from arraycheckpoint.storage import LocalStorage
LocalStorage().cleanup_leftovers(sys.argv[1])
"""


def test_cleanup_leaves_a_crashed_overwrites_holder_while_a_live_save_overwrites_its_step(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Review23e D2: a holder ``.acp-old-<token>/step_5`` (a crashed overwrite's older copy) names no step in
    its own name; cleanup in another process put it back under a live overwrite of step_5 between its two
    renames, that save failed, and the newest copy was lost (step_5 held the oldest)."""
    from arraycheckpoint.storage import local

    acp.save(str(tmp_path / "v0"), {"w": np.zeros(4)})
    crashed = tmp_path / ".acp-old-aaaaaaaaaaaa"  # save A died between its renames, long ago
    crashed.mkdir()
    os.rename(tmp_path / "v0", crashed / "step_5")
    time.sleep(0.01)  # distinct commit times
    acp.save(str(tmp_path / "step_5"), {"w": np.ones(4)})  # committed later; no cleanup ran since

    real, ran = os.rename, []

    def rename(src: Any, dst: Any) -> None:
        real(src, dst)
        if ".acp-old-" in str(dst) and not ran:  # save B between its renames: another job's cleanup starts
            ran.append(subprocess.run([sys.executable, "-c", CLEANUP, str(tmp_path)], timeout=300))

    monkeypatch.setattr(local.os, "rename", rename)
    acp.save(str(tmp_path / "step_5"), {"w": np.full(4, 2.0)}, overwrite=True)  # before: SaveFailedError
    monkeypatch.setattr(local.os, "rename", real)
    assert ran and ran[0].returncode == 0
    LocalStorage().cleanup_leftovers(str(tmp_path))
    back = {"w": np.full(4, -1.0)}
    acp.load(str(tmp_path / "step_5"), back)
    assert np.array_equal(back["w"], np.full(4, 2.0))  # before: zeros (the oldest copy)
    assert sorted(os.listdir(tmp_path)) == ["step_5"]


def test_an_overwrite_that_cannot_put_the_old_copy_back_says_where_it_is(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """When an overwrite's own rename fails and the copy it moved aside cannot go back (something took the
    step meanwhile), the error names where that copy is kept (before: a bare OSError of the put-back)."""
    from arraycheckpoint.storage import local

    acp.save(str(tmp_path / "step_5"), {"w": np.ones(4)})
    real = os.rename

    def rename(src: Any, dst: Any) -> None:
        real(src, dst)
        if ".acp-old-" in str(dst) and not (tmp_path / "step_5").exists():  # another writer takes the step
            (tmp_path / "step_5").mkdir()
            (tmp_path / "step_5" / "theirs.txt").write_text("x")

    monkeypatch.setattr(local.os, "rename", rename)
    with pytest.raises(acp.errors.SaveFailedError, match=r"it is kept at .*\.acp-old-[^/]+/step_5"):
        acp.save(str(tmp_path / "step_5"), {"w": np.full(4, 2.0)}, overwrite=True)
    monkeypatch.setattr(local.os, "rename", real)
    LocalStorage().cleanup_leftovers(
        str(tmp_path)
    )  # before: deleted it (a replaced copy of a step that exists)
    (kept,) = [p for p in tmp_path.iterdir() if p.name.startswith(".acp-old-")]
    back = {"w": np.zeros(4)}
    acp.load(str(kept / "step_5"), back)
    assert np.array_equal(back["w"], np.ones(4))
