"""Fault-injecting backends for the fault suite: a real fsspec in-memory file system whose object reads and
writes fail transiently at a given rate (seeded), and an S3 server process that can be killed mid-save."""

from __future__ import annotations

import contextlib
import os
import random
import socket
import subprocess
import sys
import threading
import time

import fsspec
from fsspec.implementations.memory import MemoryFileSystem


class FlakyMemoryFS(MemoryFileSystem):
    """fsspec's MemoryFileSystem whose ``pipe_file``/``cat_file`` fail with a dropped connection at ``rate``."""

    protocol = "acpflaky"
    rate = 0.0
    failures = 0
    _rng = random.Random(12)
    _guard = threading.Lock()

    @classmethod
    def set_rate(cls, rate: float, seed: int = 12) -> None:
        cls.rate, cls.failures, cls._rng = rate, 0, random.Random(seed)

    def _maybe_fail(self, path: str) -> None:
        with self._guard:
            fail = self._rng.random() < self.rate
            if fail:
                type(self).failures += 1
        if fail:
            raise ConnectionError(f"connection reset by peer (injected) on {path}")

    def pipe_file(self, path, value, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._maybe_fail(path)
        return super().pipe_file(path, value, *args, **kwargs)

    def cat_file(self, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        self._maybe_fail(path)
        return super().cat_file(path, *args, **kwargs)


fsspec.register_implementation("acpflaky", FlakyMemoryFS, clobber=True)


@contextlib.contextmanager
def environ_restored(*keys: str):  # noqa: ANN201 - a context manager
    """Set what the body sets of ``keys`` in ``os.environ`` back to what it was on leaving (session and
    module fixtures cannot use ``monkeypatch``)."""
    saved = {k: os.environ.get(k) for k in keys}
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class S3Process:
    """A moto S3 server in its own process on 127.0.0.1 (so that a rank can kill it mid-save)."""

    def __init__(self, bucket: str = "acp-faults") -> None:
        self.port = free_port()
        code = (
            "from moto.server import ThreadedMotoServer\nimport time\n"
            f"s = ThreadedMotoServer(ip_address='127.0.0.1', port={self.port}, verbose=False)\n"
            "s.start()\nwhile True: time.sleep(3600)\n"
        )
        self.proc = subprocess.Popen([sys.executable, "-c", code])
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.bucket = bucket
        import boto3

        self.client = boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id="acp-test",
            aws_secret_access_key="acp-test-secret",
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                self.client.create_bucket(Bucket=bucket)
                break
            except Exception:  # noqa: BLE001 - not up yet
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
