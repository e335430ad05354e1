"""A job killed (SIGKILL) at each phase of a managed save, then a fresh manager on the same root: the newest
committed step is the previous one (or the killed save's own, once its commit landed), it loads bit-exactly,
and the start-up cleanup removes every leftover of the killed save (staging directories, locks, uncommitted
step prefixes). Real components: a subprocess per kill, the local file system and a moto S3 server process."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from flaky import S3Process

from arraycheckpoint import CheckpointManager, storage
from arraycheckpoint.storage.base import LOCK_KEY
from arraycheckpoint.storage.s3 import S3Storage

_JOB = r"""
import os, signal, sys
import numpy as np
from arraycheckpoint import CheckpointManager, storage
from arraycheckpoint.storage import LocalStorage
from arraycheckpoint.storage.s3 import S3Storage

root, phase, endpoint = sys.argv[1], sys.argv[2], sys.argv[3]
Base = S3Storage if root.startswith("s3://") else LocalStorage

STEP2 = set()  # step 2's staging roots (a local one is named after no step)

class Dies(Base):
    def staging_root(self, final, token):
        staging = super().staging_root(final, token)
        if final.endswith("2"):
            STEP2.add(staging)
        return staging
    def acquire(self, final, token):
        super().acquire(final, token)
        if phase == "claimed" and final.endswith("2"):
            os.kill(os.getpid(), signal.SIGKILL)
    def flush(self, root_):
        super().flush(root_)
        if phase == "written" and root_ in STEP2:
            os.kill(os.getpid(), signal.SIGKILL)
    def commit(self, staging, final, overwrite):
        if phase == "committing" and final.endswith("2"):
            self.write(staging, ".acp/metadata.json", b"{}")  # half-way: whatever the commit wrote so far
            os.kill(os.getpid(), signal.SIGKILL)
        super().commit(staging, final, overwrite)
        if phase == "committed" and final.endswith("2"):
            os.kill(os.getpid(), signal.SIGKILL)

scheme = "s3" if root.startswith("s3://") else "file"
kwargs = {"endpoint": endpoint, "max_retries": 1} if scheme == "s3" else {}
storage.register_scheme(scheme, lambda: Dies(**kwargs))
mgr = CheckpointManager(root, keep_last=1)
mgr.save(1, {"w": np.arange(16.0)}).result()
mgr.save(2, {"w": np.arange(16.0) + 100}).result()
"""

# the commit phases run always; the earlier ones (seconds each, like them) with the slow cases
PHASES = [
    pytest.param("claimed", marks=pytest.mark.slow),
    pytest.param("written", marks=pytest.mark.slow),
    "committing",
    "committed",
]


@pytest.fixture(scope="module")
def s3() -> S3Process:
    server = S3Process()
    yield server
    server.stop()


def _leftovers(root: str, s3: S3Process) -> list[str]:
    if root.startswith("s3://"):
        prefix = root.split("/", 3)[3] + "/"
        listed = s3.client.list_objects_v2(Bucket=s3.bucket, Prefix=prefix).get("Contents", [])
        keys = [o["Key"][len(prefix) :] for o in listed]
        return sorted(
            k for k in keys if k.endswith(LOCK_KEY) or not k.startswith(("step_00000001/", "step_00000002/"))
        )
    return sorted(n for n in os.listdir(root) if n.startswith("."))


@pytest.mark.parametrize("backend", ["local", "s3"])
@pytest.mark.parametrize("phase", PHASES)
def test_a_job_killed_mid_save_restarts_on_the_last_committed_step(
    backend: str, phase: str, tmp_path: Path, s3: S3Process, monkeypatch
) -> None:
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "acp-test", "AWS_SECRET_ACCESS_KEY": "acp-test-secret"}
    env.update(AWS_REGION="us-east-1", PYTHONPATH=os.pathsep.join(sys.path))
    root = str(tmp_path / "run") if backend == "local" else f"s3://{s3.bucket}/{tmp_path.name}"
    script = tmp_path / "job.py"
    script.write_text(_JOB)
    run = subprocess.run(
        [sys.executable, str(script), root, phase, s3.endpoint], env=env, capture_output=True, timeout=120
    )
    assert run.returncode == -9, run.stderr.decode()[-2000:]
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION"):
        monkeypatch.setenv(key, env[key])
    if backend == "s3":
        storage.register_scheme("s3", lambda: S3Storage(endpoint=s3.endpoint))
    try:
        mgr = CheckpointManager(root, keep_last=1)
        expected = 2 if phase == "committed" else 1
        assert mgr.latest_step() == expected
        out = {"w": np.zeros(16)}
        mgr.restore(state=out)
        assert np.array_equal(out["w"], np.arange(16.0) + (100 if expected == 2 else 0))
        assert _leftovers(root, s3) == []
        mgr.close()
    finally:
        storage.register_scheme("s3", None)
