"""``acp.dcp.Writer`` claims its target as ``acp.save`` does: the lock (a lease on object stores) before any rank
writes, and, writing in place, the old checkpoint's commit marker removed first.

Before, the Writer took no lock and wrote over a committed checkpoint in place with its marker still there: a
save killed between its writes and its commit (here: right after every rank's chunks landed, before the
metadata) left ``step_1``'s marker and metadata over ``step_2``'s chunk files, a committed checkpoint that
loaded weights of one save and the step counter of another. Without a lock, another job's manager cleanup
also removed a Writer's staging directory (local disk) or its objects (object stores) mid-save, and two
Writers saving to one target mixed their files.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.storage import LocalStorage, storage_for

pytest.importorskip("torch.distributed.checkpoint")

SAVES = """
import os, sys, time
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
import arraycheckpoint as acp
from arraycheckpoint.storage import register_scheme
from arraycheckpoint.storage import LocalStorage
from arraycheckpoint.storage.s3 import S3Storage

url, flag = sys.argv[1], Path(sys.argv[2])
scheme = "s3" if url.startswith("s3://") else "file"


class StopsBeforeCommit(S3Storage if scheme == "s3" else LocalStorage):
    # the second save stops once its writes landed, before its metadata and marker: the test kills it there
    def flush(self, root):
        super().flush(root)
        if os.environ.get("ACP_STOP_SAVE"):
            flag.touch()
            time.sleep(120)


register_scheme(scheme, StopsBeforeCommit)
dcp.save({"w": torch.full((256,), 1.0), "step": 1}, storage_writer=acp.dcp.Writer(url))
os.environ["ACP_STOP_SAVE"] = "1"
dcp.save({"w": torch.full((256,), 2.0), "step": 2}, storage_writer=acp.dcp.Writer(url))
"""


def _stopped_before_commit(url: str, flag: Path) -> subprocess.Popen:
    """The process running :data:`SAVES`, once its second save stopped before its commit."""
    proc = subprocess.Popen([sys.executable, "-c", SAVES, url, str(flag)])
    deadline = time.monotonic() + 120
    while not flag.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"the second save never reached its commit (exit code {proc.poll()})")
        time.sleep(0.05)
    return proc


def test_a_writer_killed_before_its_commit_leaves_no_mixed_committed_checkpoint(
    s3_server, s3_prefix: str, tmp_path: Path
) -> None:
    url = f"{s3_prefix}/step"
    proc = _stopped_before_commit(url, tmp_path / "stopped")
    proc.kill()
    proc.wait()
    backend, root = storage_for(url)
    if backend.is_committed(root):  # before: step_1's marker over step_2's chunks
        back = {"w": torch.zeros(256), "step": 0}
        import torch.distributed.checkpoint as dcp

        dcp.load(back, storage_reader=acp.dcp.Reader(url))
        assert torch.equal(back["w"], torch.full((256,), float(back["step"]))), (back["step"], back["w"][:3])


def test_another_jobs_cleanup_keeps_a_writers_staging_in_flight(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    proc = _stopped_before_commit(str(root / "step_2"), tmp_path / "stopped")
    try:
        staged = [p.name for p in root.iterdir() if ".acp-staging-" in p.name]
        assert staged, sorted(p.name for p in root.iterdir())
        LocalStorage().cleanup_leftovers(str(root))  # a second job's manager starting on the root
        assert all((root / name).is_dir() for name in staged)  # before: removed as a crashed save's
    finally:
        proc.kill()
        proc.wait()
