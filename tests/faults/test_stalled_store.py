"""A store that stops answering (its server stopped with SIGSTOP: connections are accepted by the kernel, no
request is ever answered). A save used to wait forever on the first request; now every request and retry loop
is bounded by the save's ``timeout=``, the error names the path, and nothing is committed. Real components: a
moto S3 server process on loopback and tensorstore's S3 driver; the mid-save case runs in a subprocess (curl's
low-speed watchdog is read once per process, when tensorstore creates its HTTP transport)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from flaky import S3Process, environ_restored

import arraycheckpoint as acp
from arraycheckpoint import storage
from arraycheckpoint.errors import ArrayCheckpointError
from arraycheckpoint.storage.s3 import S3Storage

_ENV = {
    "AWS_ACCESS_KEY_ID": "acp-test",
    "AWS_SECRET_ACCESS_KEY": "acp-test-secret",
    "AWS_REGION": "us-east-1",
}


def _keys(server: S3Process, prefix: str) -> list[str]:
    listed = server.client.list_objects_v2(Bucket=server.bucket, Prefix=prefix)
    return sorted(o["Key"] for o in listed.get("Contents", []))


@pytest.fixture
def server() -> Any:
    with environ_restored(*_ENV):
        os.environ.update(_ENV)
        s3 = S3Process()
        try:
            yield s3
        finally:
            os.kill(s3.proc.pid, signal.SIGCONT)
            s3.stop()


def test_a_save_to_a_stalled_store_fails_within_its_timeout_naming_the_path(server: S3Process) -> None:
    """The target check's first HEAD request was never answered and the save hung forever (tensorstore's S3
    requests carry no timeout). Now it fails within about its timeout, naming the object it waited for."""
    storage.register_scheme("s3", lambda: S3Storage(endpoint=server.endpoint, max_retries=1))
    url = f"s3://{server.bucket}/stalled"
    outcome: dict[str, Any] = {}

    def save() -> None:
        start = time.monotonic()
        try:
            acp.save(url, {"w": np.arange(100.0)}, timeout=2)
            outcome["error"] = None
        except ArrayCheckpointError as e:
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    try:
        os.kill(server.proc.pid, signal.SIGSTOP)
        thread = threading.Thread(target=save, daemon=True)
        thread.start()
        thread.join(60)
        assert not thread.is_alive(), "the save to a stalled store did not return within 60 s"
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        storage.register_scheme("s3", None)
    error = outcome["error"]
    assert error is not None, "the save reported success against a store that never answered"
    assert "stalled" in str(error) and "no answer" in str(error), error
    assert outcome["seconds"] < 30, outcome
    assert not _keys(server, "stalled/")


_MID_SAVE = r"""
import json, os, signal, sys, time
import numpy as np
import arraycheckpoint as acp
from arraycheckpoint import storage
from arraycheckpoint.storage.s3 import S3Storage

endpoint, bucket, pid = sys.argv[1], sys.argv[2], int(sys.argv[3])

class StallsAfterClaim(S3Storage):
    def acquire(self, final, token):
        super().acquire(final, token)
        os.kill(pid, signal.SIGSTOP)  # the chunk uploads, the metadata and the commit meet a stalled server

storage.register_scheme("s3", lambda: StallsAfterClaim(endpoint=endpoint, max_retries=0, low_speed_seconds=1))
start = time.monotonic()
try:
    acp.save(f"s3://{bucket}/mid", {"w": np.arange(1000.0), "b": np.ones(7)}, timeout=2)
    error = None
except Exception as e:
    error = f"{type(e).__name__}: {e}"
print(json.dumps({"error": error, "seconds": time.monotonic() - start}))
"""


def test_a_store_stalling_mid_save_fails_the_save_within_bounds_and_commits_nothing(
    server: S3Process, tmp_path: Path
) -> None:
    """The server stops answering once the save holds its lock: the chunk uploads used to wait forever (no
    transfer timeout in tensorstore's S3 driver). curl's low-speed watchdog now aborts them, the save fails
    naming the path, and no commit marker is written."""
    script = tmp_path / "mid_save.py"
    script.write_text(_MID_SAVE)
    env = {**os.environ, **_ENV, "PYTHONPATH": os.pathsep.join(sys.path)}
    for key in ("TENSORSTORE_CURL_LOW_SPEED_TIME_SECONDS", "TENSORSTORE_CURL_LOW_SPEED_LIMIT_BYTES"):
        env.pop(key, None)
    proc = subprocess.Popen(
        [sys.executable, str(script), server.endpoint, server.bucket, str(server.proc.pid)],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        pytest.fail("a save whose store stalled mid-save did not return within 90 s")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] is not None, "the save reported success against a store that stopped answering"
    assert f"s3://{server.bucket}/mid" in result["error"], result
    assert result["seconds"] < 60, result
    time.sleep(0.5)  # requests the stopped server had queued are answered now
    assert "mid/.acp/committed" not in _keys(server, "mid/")


def test_retention_on_a_store_that_stalls_after_the_commit_is_bounded(server: S3Process) -> None:
    """The store stops answering right after a managed save committed: the retention pass (and so the save's
    ``result()``) waited ACP_LIVENESS_TIMEOUT (300 s) per request; the manager's storage now takes the bound
    of its saves' ``timeout=``. The committed step is reported committed; retention is retried later."""

    class StallsAfterCommit(S3Storage):
        armed = False

        def commit(self, staging: str, final: str, overwrite: bool) -> None:
            super().commit(staging, final, overwrite)
            if StallsAfterCommit.armed:
                os.kill(server.proc.pid, signal.SIGSTOP)

    storage.register_scheme("s3", lambda: StallsAfterCommit(endpoint=server.endpoint, max_retries=0))
    root = f"s3://{server.bucket}/run"
    try:
        mgr = acp.CheckpointManager(root, keep_last=1, save_options={"timeout": 2})
        mgr.save(1, {"w": np.arange(8.0)}).result()
        StallsAfterCommit.armed = True
        handle = mgr.save(2, {"w": np.arange(8.0) + 1})
        handle.result(timeout=30)  # raised TimeoutError: retention still waiting on the stalled store
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        storage.register_scheme("s3", None)
    assert "run/step_00000002/.acp/committed" in _keys(server, "run/")
    mgr.close()
