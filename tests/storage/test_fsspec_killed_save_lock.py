"""The lock a killed one-rank save left on an fsspec URL (no lease) is taken over by the next save on its host.

Before (review23c D6): fsspec locks were never taken over, so once ``acp.dcp.Writer`` claimed its target, a
DCP job killed between its plan and its commit (OOM, preemption) left a lock that refused every later save to
that path, in every process, for ever, with a message that told DCP users (who run no CheckpointManager) no
way out. Now a lock whose one-rank save ran on this host and whose process is gone is taken over (as a lock
file without ``flock`` is); a multi-rank save's lock is not (its other ranks may still write), and the
refusal says how to remove it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import storage_for

pytest.importorskip("torch.distributed.checkpoint")

PRELUDE = """
import os, sys, fsspec, torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from fsspec.implementations.local import LocalFileSystem


class Lfs(LocalFileSystem):
    protocol = ("lfskill",)

    def __init__(self, *a, **kw):
        kw["auto_mkdir"] = True
        super().__init__(*a, **kw)

    @classmethod
    def _strip_protocol(cls, path):
        return LocalFileSystem._strip_protocol(str(path).removeprefix("lfskill://"))


fsspec.register_implementation("lfskill", Lfs, clobber=True)
"""

KILLED = (
    PRELUDE
    + """
import arraycheckpoint as acp


class Killed(DefaultSavePlanner):
    def finish_plan(self, plan):
        os._exit(9)  # killed while its ranks write: its lock stays


dcp.save({"w": torch.arange(4.0)}, storage_writer=acp.dcp.Writer(sys.argv[1]), planner=Killed())
"""
)


@pytest.fixture
def url(tmp_path: Path) -> str:
    exec(compile(PRELUDE, "prelude", "exec"), {})  # the protocol, in this process too
    return f"lfskill://{tmp_path}/ckpt"


def _killed_save(url: str) -> None:
    done = subprocess.run([sys.executable, "-c", KILLED, url], capture_output=True, text=True, timeout=300)
    assert done.returncode == 9, done.stderr[-2000:]
    storage, final = storage_for(url)
    assert storage.read(final, ".acp-lock") is not None


def test_the_next_dcp_save_takes_over_a_killed_one_rank_saves_lock(url: str) -> None:
    import torch.distributed.checkpoint as dcp

    _killed_save(url)
    dcp.save({"w": torch.arange(4.0) + 1}, storage_writer=acp.dcp.Writer(url))  # before: refused, for ever
    back = {"w": torch.zeros(4)}
    dcp.load(back, storage_reader=acp.dcp.Reader(url))
    assert torch.equal(back["w"], torch.arange(4.0) + 1)
    storage, final = storage_for(url)
    assert storage.read(final, ".acp-lock") is None


def test_a_multi_rank_saves_lock_is_refused_naming_how_to_remove_it(url: str) -> None:
    _killed_save(url)
    storage, final = storage_for(url)
    doc = json.loads(storage.read(final, ".acp-lock") or b"{}")
    doc["world"] = 2  # its other ranks may still write: never taken over
    storage.write(final, ".acp-lock", json.dumps(doc).encode())
    with pytest.raises(CheckpointExistsError, match=r"delete_key\(root, '\.acp-lock'\)"):
        acp.save(url, {"w": torch.arange(4.0)})
