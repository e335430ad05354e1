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
import re
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


def test_of_two_takers_of_a_killed_saves_lock_only_one_holds_it(
    url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review23e D3: a taker that read the dead lock and paused, while another took it over, then deleted that
    one's live lock and created its own: both saves held the target. Now a takeover holds a sentinel while it
    reads the lock again and replaces it."""
    import inspect
    import threading

    _killed_save(url)
    sa, final = storage_for(url)
    sb, _ = storage_for(url)
    a_done, b_paused = threading.Event(), threading.Event()
    real_read = type(sb).read

    def read(self: object, root: str, key: str, *a: object, **k: object) -> object:
        out = real_read(self, root, key, *a, **k)
        if self is sb and key == ".acp-lock" and inspect.stack()[1].function == "_replace_dead_lock":
            b_paused.set()
            a_done.wait(30)  # B read the dead lock again; A takes it over meanwhile
        return out

    monkeypatch.setattr(type(sb), "read", read)
    results: dict[str, str] = {}

    def take(token: str, storage: object) -> None:
        try:
            storage.acquire(final, token)  # type: ignore[attr-defined]
            results[token] = "acquired"
        except CheckpointExistsError:
            results[token] = "refused"
        finally:
            if token == "tokA":
                a_done.set()

    b = threading.Thread(target=take, args=("tokB", sb))
    b.start()
    assert b_paused.wait(60)
    take("tokA", sa)
    b.join()
    assert sorted(results.values()) == ["acquired", "refused"]  # before: both acquired
    winner = [t for t, r in results.items() if r == "acquired"][0]
    assert sa._lock_token(final) == winner
    assert [k for k in sa.children(final) if k.startswith(".acp-lock.takeover")] == []


def test_a_sentinel_left_by_a_crashed_taker_does_not_block_the_takeover(url: str) -> None:
    """A taker that crashed holding the sentinel: once it is stale (older than a lease) the next taker makes
    the next one and takes the lock over; a fresh one (a taker at it) refuses."""
    import time

    from arraycheckpoint.storage import lease

    _killed_save(url)
    storage, final = storage_for(url)
    storage.write(final, ".acp-lock.takeover", lease.body("busy"))
    with pytest.raises(CheckpointExistsError):
        acp.save(url, {"w": torch.arange(4.0)})
    storage.write(final, ".acp-lock.takeover", lease.body("crashed", at=time.time() - 10_000))
    acp.save(url, {"w": torch.arange(4.0) + 2})
    back = {"w": torch.zeros(4)}
    acp.load(url, back)
    assert torch.equal(back["w"], torch.arange(4.0) + 2)
    assert [k for k in storage.children(final) if k.startswith(".acp")] == [".acp"]


def test_a_target_holding_only_a_crashed_takers_sentinel_is_saved_to(url: str) -> None:
    """A sentinel is ours: a target holding one (its taker crashed) is a leftover the next save clears, not
    the user's objects it refuses."""
    from arraycheckpoint.storage import lease

    storage, final = storage_for(url)
    storage.write(final, ".acp-lock.takeover-0123456789abcdef", lease.body("crashed", at=1.0))
    acp.save(url, {"w": torch.arange(4.0)})
    assert [k for k in storage.children(final) if k.startswith(".acp-lock")] == []


def test_a_chain_of_crashed_takers_is_refused_naming_their_sentinels(url: str) -> None:
    """As many crashed takers in a row as a takeover passes: the save is refused naming the stale sentinels and
    how to remove them (before, review23f D2: "another save is in progress", naming only the dead lock), and
    once they and the lock are deleted as it says, the save goes through."""
    import hashlib
    import time

    from arraycheckpoint.storage import lease
    from arraycheckpoint.storage.claims import _TAKEOVER_LINKS, TAKEOVER_KEY

    _killed_save(url)
    storage, final = storage_for(url)
    key, keys = TAKEOVER_KEY, []
    for i in range(_TAKEOVER_LINKS):
        body = lease.body(f"crashed{i}", at=time.time() - 10_000)
        storage.write(final, key, body)
        keys.append(key)
        key = f"{TAKEOVER_KEY}-{hashlib.sha256(body).hexdigest()[:16]}"
    with pytest.raises(CheckpointExistsError, match=r"crashed in turn.*" + re.escape(keys[-1])):
        acp.save(url, {"w": torch.arange(4.0)})
    for k in [*keys, ".acp-lock"]:
        storage.delete_key(final, k)
    acp.save(url, {"w": torch.arange(4.0) + 1})
    back = {"w": torch.zeros(4)}
    acp.load(url, back)
    assert torch.equal(back["w"], torch.arange(4.0) + 1)
