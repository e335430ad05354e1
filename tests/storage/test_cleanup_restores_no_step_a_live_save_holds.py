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

import numpy as np

import arraycheckpoint as acp
from arraycheckpoint.storage import LocalStorage

HOLD = """
import sys, time
from arraycheckpoint.storage import storage_for
backend, final = storage_for(sys.argv[1])
backend.acquire(final, "live")
print("held", flush=True)
time.sleep(120)
"""


def test_cleanup_leaves_the_copies_of_a_step_a_live_save_replaces(tmp_path: Path) -> None:
    older = tmp_path / "step_5.acp-old-.step_5.acp-staging-dead"  # an overwrite that crashed long ago
    acp.save(str(tmp_path / "s"), {"w": np.full(3, 1)})
    os.rename(tmp_path / "s", older)
    time.sleep(0.01)  # distinct commit times
    acp.save(str(tmp_path / "step_5"), {"w": np.full(3, 2)})  # the step as committed now

    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(tmp_path / "step_5")], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        # the live save's commit: its first rename moved the committed step aside; its second is next
        newest = tmp_path / "step_5.acp-old-.step_5.acp-staging-live"
        os.rename(tmp_path / "step_5", newest)
        LocalStorage().cleanup_leftovers(str(tmp_path))
        assert not (tmp_path / "step_5").exists()  # before: the older copy, put back under the live save
        assert older.is_dir() and newest.is_dir()
    finally:
        holder.kill()
        holder.wait()
    # that save is gone (crashed between its renames): the newest copy is the step's
    LocalStorage().cleanup_leftovers(str(tmp_path))
    back = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(tmp_path / "step_5"), back)
    assert np.array_equal(back["w"], np.full(3, 2))
    assert sorted(os.listdir(tmp_path)) == ["step_5"]
