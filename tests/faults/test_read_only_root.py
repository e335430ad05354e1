"""A run's checkpoint root on a read-only mount (an evaluation job reading a training run's checkpoints): a
manager's start-up cleanup that could not delete an uncommitted step raised, so the manager could not even be
constructed there (with the default ``cleanup=True``). Now what cannot be removed is kept with a warning
naming it, and the manager restores the newest committed step bit-exactly. Real components: a tmpfs mounted
and remounted read-only (needs root; skipped elsewhere)."""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from arraycheckpoint import CheckpointManager
from arraycheckpoint.errors import StorageError


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Path]:
    point = tmp_path / "mnt"
    point.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(point)], check=True, capture_output=True
        )
    except (OSError, subprocess.CalledProcessError) as e:
        pytest.skip(f"cannot mount a tmpfs here ({e})")
    try:
        yield point
    finally:
        subprocess.run(["umount", str(point)], check=False)


def test_a_manager_on_a_read_only_root_keeps_leftovers_and_restores(mount: Path, caplog) -> None:
    root = mount / "run"
    w = np.arange(64, dtype=np.float32)
    with CheckpointManager(root) as mgr:
        mgr.save(1, {"w": w}).result()
        mgr.save(2, {"w": w + 1}).result()
    os.remove(root / "step_00000002" / ".acp" / "committed")  # a step whose deletion or save did not finish
    subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        mgr = CheckpointManager(root)  # raised StorageError: Read-only file system
    assert mgr.removed == []
    assert any(f"could not remove {root}/step_00000002" in r.getMessage() for r in caplog.records)
    assert mgr.latest_step() == 1
    out = {"w": np.zeros(64, np.float32)}
    mgr.restore(state=out)
    assert np.array_equal(out["w"], w)
    with pytest.raises(StorageError, match=str(root)):
        mgr.save(3, {"w": w}).result()
    mgr.close()
    assert sorted(os.listdir(root)) == ["step_00000001", "step_00000002"]
