"""A load from an object store that stops answering fails within the load's ``timeout=`` (session 20 review:
``engine/load.py`` did not hand it to its storage, so each request waited ``ACP_LIVENESS_TIMEOUT``, 300 s)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from flaky import S3Process  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint import storage  # noqa: E402
from arraycheckpoint.storage.s3 import S3Storage  # noqa: E402

_ENV = {
    "AWS_ACCESS_KEY_ID": "acp-test",
    "AWS_SECRET_ACCESS_KEY": "acp-test-secret",
    "AWS_REGION": "us-east-1",
}


def test_a_load_from_a_stalled_store_fails_within_its_timeout(monkeypatch) -> None:
    for key, value in _ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("ACP_LIVENESS_TIMEOUT", raising=False)
    server = S3Process()
    storage.register_scheme("s3", lambda: S3Storage(endpoint=server.endpoint, max_retries=1))
    url = f"s3://{server.bucket}/ck"
    outcome: dict[str, Any] = {}

    def load() -> None:
        start = time.monotonic()
        try:
            acp.load(url, {"w": np.zeros(8)}, timeout=2)
        except Exception as e:  # noqa: BLE001 - any error will do; hanging is the defect
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    try:
        acp.save(url, {"w": np.arange(8.0)})
        os.kill(server.proc.pid, signal.SIGSTOP)
        thread = threading.Thread(target=load, daemon=True)
        thread.start()
        thread.join(8)
        assert not thread.is_alive(), "load(timeout=2) from a stalled store did not return within 8 s"
        assert "error" in outcome and url in str(outcome["error"])
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
        storage.register_scheme("s3", None)
        server.stop()
