"""No name a local save creates beside its target holds the target's name (storage/localnames.py).

Frameworks find steps by a pattern over the entries of the checkpoint folder (torchtitan
``re.search(r"step-(\\d+)")``, HF Trainer ``checkpoint-\\d+``, accelerate ``checkpoint_\\d+``): the lock, the
staging directory, the holder of an overwritten copy and the trash never match one, for any target. An
overwrite save killed between its two renames leaves the old copy in ``.acp-old-<token>/<step>``: cleanup puts
it back under its step. A save refuses a target whose lock of an older version (``.<name>.acp-lock``) a live
process holds, and an older version's leftovers are still removed.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from lease_helpers import lock_held

import arraycheckpoint as acp
from arraycheckpoint.storage import localnames as names
from arraycheckpoint.storage.local import LocalStorage

#: the step patterns of torchtitan, HF Trainer, accelerate, and their underscore/dash variants
PATTERNS = [re.compile(p) for p in (r"step-(\d+)", r"step_(\d+)", r"checkpoint-(\d+)", r"checkpoint_(\d+)")]


@pytest.mark.parametrize("step", ["step-3", "step_00000003", "checkpoint-3", "checkpoint_3", "global_step3"])
def test_no_name_of_ours_matches_a_step_pattern(tmp_path: Path, step: str) -> None:
    final = str(tmp_path / step)
    lock = names.lock_path(final)
    made = [
        lock.name,
        lock.name + ".takeover",
        os.path.basename(names.staging_path(final, "3f2a9c0d1e4b-12")),  # engine tokens: <session>-<n>
        os.path.basename(names.staging_path(final, "0123456789ab")),  # the DCP writer's
        os.path.basename(names.old_holder(final, "3f2a9c0d1e4b-12")),
        os.path.basename(names.trash_path(final)),
    ]
    for name in made:
        assert step not in name and not any(p.search(name) for p in PATTERNS), name
        assert names.classify(name) is not None or name.endswith(".takeover"), name
    assert lock.parent == tmp_path and names.lock_path(tmp_path / "other") != lock  # one lock per target


OVERWRITE_THEN_HANG = """
import os, sys, time, numpy as np
import arraycheckpoint as acp
root, flag = sys.argv[1], sys.argv[2]
real = os.rename
def rename(src, dst, *a, **k):
    if ".acp-staging-" in os.path.basename(str(src)):  # the commit's second rename
        open(flag, "w").close()
        time.sleep(600)
    return real(src, dst, *a, **k)
os.rename = rename
acp.save(os.path.join(root, sys.argv[3]), {"w": np.full(3, 9)}, overwrite=True)
"""


@pytest.mark.parametrize("step", ["step-5", "checkpoint-5"])
def test_an_overwrite_killed_between_its_renames_is_put_back(tmp_path: Path, step: str) -> None:
    """torchtitan's scan and HF Trainer's (``get_last_checkpoint``, and ``sort_checkpoints``, which its
    ``save_total_limit`` rotation deletes from) see no step while the old copy is aside."""
    from transformers.trainer_utils import get_last_checkpoint, sort_checkpoints

    acp.save(str(tmp_path / step), {"w": np.full(3, 5)})
    flag = tmp_path.parent / f"{tmp_path.name}-flag"
    proc = subprocess.Popen([sys.executable, "-c", OVERWRITE_THEN_HANG, str(tmp_path), str(flag), step])
    try:
        deadline = time.monotonic() + 120
        while not flag.exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the save never reached its commit"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    left = sorted(os.listdir(tmp_path))
    assert sort_checkpoints(str(tmp_path)) == [] and get_last_checkpoint(str(tmp_path)) is None, left
    assert not any(p.search(n) for n in left for p in PATTERNS), left  # the step is aside, under no step name
    holders = [n for n in left if n.startswith(names.OLD)]
    assert len(holders) == 1 and os.listdir(tmp_path / holders[0]) == [step], left
    mgr = acp.CheckpointManager(str(tmp_path), step_prefix=step[:-1])
    assert sorted(os.listdir(tmp_path)) == [step], (os.listdir(tmp_path), mgr.removed)
    if step.startswith("checkpoint-"):
        assert get_last_checkpoint(str(tmp_path)) == str(tmp_path / step)
    back = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(tmp_path / step), back)
    assert np.array_equal(back["w"], np.full(3, 5))  # the committed copy, put back


HOLD_LEGACY = """
import fcntl, os, sys, time
from arraycheckpoint.storage import locks
fd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o644)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
os.pwrite(fd, locks.owner_document(locks.this_owner("old-1")), 0)
print("held", flush=True)
time.sleep(120)
"""


def test_a_live_lock_of_an_older_version_is_respected_and_its_leftovers_removed(tmp_path: Path) -> None:
    final = tmp_path / "step-1"
    legacy = tmp_path / ".step-1.acp-lock"
    staging = tmp_path / ".step-1.acp-staging-old-1"
    staging.mkdir()
    (staging / ".metadata").write_bytes(b"x")
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LEGACY, str(legacy)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(acp.CheckpointExistsError, match=re.escape(str(legacy))):
            acp.save(str(final), {"w": np.arange(3)})
        assert LocalStorage().cleanup_leftovers(str(tmp_path)) == []  # its save is in flight: all stays
    finally:
        holder.kill()
        holder.wait()
    removed = LocalStorage().cleanup_leftovers(str(tmp_path))  # crashed now: its lock and staging go
    assert sorted(removed) == sorted([str(legacy), str(staging)]) and os.listdir(tmp_path) == []
    acp.save(str(final), {"w": np.arange(3)})
    assert sorted(os.listdir(tmp_path)) == ["step-1"]


def test_a_replaced_copy_of_a_save_in_flight_stays_until_that_save_is_gone(tmp_path: Path) -> None:
    """A save between its two renames (its lock live): the copy it moved aside (``.acp-old-<its token>``) is
    neither put back nor removed by another job's cleanup; once that save is gone, it is put back."""
    acp.save(str(tmp_path / "s"), {"w": np.full(3, 7)})
    holder_dir = tmp_path / f"{names.OLD}live-1"
    holder_dir.mkdir()
    os.rename(tmp_path / "s", holder_dir / "step-7")
    with lock_held(str(tmp_path / "step-7"), "live-1"):
        assert LocalStorage().cleanup_leftovers(str(tmp_path)) == []
        assert os.listdir(holder_dir) == ["step-7"] and not (tmp_path / "step-7").exists()
    removed = LocalStorage().cleanup_leftovers(str(tmp_path))
    assert removed == [str(names.lock_path(tmp_path / "step-7"))]  # the holder is put back, not removed
    assert sorted(os.listdir(tmp_path)) == ["step-7"]
    back = {"w": np.zeros(3, dtype=np.int64)}
    acp.load(str(tmp_path / "step-7"), back)
    assert np.array_equal(back["w"], np.full(3, 7))


@pytest.mark.parametrize(
    "name",
    [
        ".acp-staging-mine",
        ".acp-old-mine",
        ".acp-trash-mine",
        "step_5.acp-old-x",
        ".acp-lock-0123456789abcdef",
    ],
)
def test_a_target_named_as_a_leftover_of_ours_is_refused(tmp_path: Path, name: str) -> None:
    """Review23e S2: a checkpoint saved under one of our names was taken by a manager's cleanup for a crashed
    save's leftover and deleted (or "restored" to another step). Such a target is refused, naming it, and
    nothing is written."""
    with pytest.raises(acp.errors.UnsafeNameError, match=re.escape(str(tmp_path / name))):
        acp.save(str(tmp_path / name), {"w": np.ones(3)})
    assert os.listdir(tmp_path) == []
    assert LocalStorage().cleanup_leftovers(str(tmp_path)) == []
