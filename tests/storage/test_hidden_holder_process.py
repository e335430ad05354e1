"""A lock's holder on this machine whose ``/proc`` entry this process may not read (``/proc`` mounted with
``hidepid``, common on shared HPC nodes: other users' processes are hidden) is alive, not gone: its lease or
heartbeat decides. It was judged gone at once, and a one-rank save's live lock taken over.

The hidden ``/proc`` entry is simulated (this suite runs as one user, and a non-root reader cannot import the
package here); the process is real and ``kill(pid, 0)``, which ``hidepid`` does not hide, answers for it."""

from __future__ import annotations

import builtins
import dataclasses
import json
import os
import subprocess
import sys
import time

import pytest

from arraycheckpoint.storage import lease, locks


@pytest.fixture
def hidden_proc(monkeypatch: pytest.MonkeyPatch):
    """A live process whose ``/proc/<pid>/stat`` cannot be opened by this one (PermissionError, as hidepid)."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    real_open = builtins.open

    def hiding_open(file, *args, **kwargs):
        if str(file) == f"/proc/{proc.pid}/stat":
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", hiding_open)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_a_hidden_live_process_is_not_gone_and_a_reaped_one_is(hidden_proc) -> None:
    assert locks.process_start(hidden_proc.pid) == locks.HIDDEN
    hidden_proc.kill()
    hidden_proc.wait()
    assert locks.process_start(hidden_proc.pid) is None  # kill(pid, 0): no such process


def test_a_one_rank_saves_lease_held_by_a_hidden_process_is_not_taken_over(hidden_proc) -> None:
    me = locks.this_owner("x")
    if not me.boot_id:
        pytest.skip("no boot id on this host: a holder's process is never known to be gone")
    doc = {**json.loads(lease.body("live")), "world": 1, "pid": hidden_proc.pid, "start": 12345}
    assert lease.stale_reason(lease.parse(json.dumps(doc).encode())) is None
    hidden_proc.kill()
    hidden_proc.wait()
    assert "is gone" in (lease.stale_reason(lease.parse(json.dumps(doc).encode())) or "")


def test_a_lock_file_held_by_a_hidden_process_is_judged_by_its_heartbeat(hidden_proc, tmp_path) -> None:
    owner = dataclasses.replace(locks.this_owner("live"), pid=hidden_proc.pid, start=12345)
    lock = tmp_path / ".acp-lock"
    lock.write_bytes(locks.owner_document(owner))
    assert locks.crashed_without_flock(lock, lock.stat(), owner) is None  # fresh heartbeat: live
    old = time.time() - 3600
    os.utime(lock, (old, old))
    assert "not refreshed" in (locks.crashed_without_flock(lock, lock.stat(), owner) or "")
