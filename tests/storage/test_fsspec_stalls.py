"""A store reached through fsspec that stops answering mid-transfer fails the load or save within its
``timeout=``, naming the path, instead of hanging.

Real components: s3fs (``s3a://``) against a moto S3 server in its own process, stopped with SIGSTOP (the
kernel accepts connections, nothing is ever answered) right before the bulk transfer: the batched ``cat`` of a
load's download, the batched ``pipe`` of a save's upload. fsspec's calls have no timeout of their own (s3fs
waits 60 s per attempt, then retries): both hung for minutes before."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

sys.path.insert(0, str(Path(__file__).parent.parent / "faults"))
from flaky import S3Process, environ_restored  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint import storage  # noqa: E402
from arraycheckpoint.storage.fsspec_store import FsspecStorage  # noqa: E402

_ENV = {
    "AWS_ACCESS_KEY_ID": "acp-test",
    "AWS_SECRET_ACCESS_KEY": "acp-test-secret",
    "AWS_REGION": "us-east-1",
}


@pytest.fixture(scope="module")
def process() -> Iterator[S3Process]:
    with environ_restored(*_ENV, "ACP_LIVENESS_TIMEOUT"):
        os.environ.update(_ENV)
        os.environ.pop("ACP_LIVENESS_TIMEOUT", None)
        s3 = S3Process(bucket="acp-fsspec-stalls")
        try:
            yield s3
        finally:
            s3.stop()


@pytest.fixture
def server(process: S3Process) -> Iterator[S3Process]:
    try:
        yield process
    finally:
        os.kill(process.proc.pid, signal.SIGCONT)
        storage.register_scheme("s3a", None)


def _in_thread(fn: Any, seconds: float) -> dict[str, Any]:
    """Run ``fn`` on a daemon thread for at most ``seconds``: its error (None: none) and its duration."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            fn()
            outcome["error"] = None
        except Exception as e:  # noqa: BLE001 - any error will do; hanging is the defect
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting on a stalled store after {seconds} s"
    return outcome


@pytest.mark.parametrize("where", ["download", "pack end", "members"])
def test_a_load_whose_reads_stall_fails_within_its_timeout(
    server: S3Process, tmp_path: Path, where: str
) -> None:
    """The server stops answering right before: the batched ``cat`` of an array's chunk files (``download``:
    a checkpoint without packs), the ranged read of a pack's end (its directory), or the merged ranged reads
    of the members before that end (a pack of 400 KiB): each fails the load within its ``timeout=``."""
    pid = server.proc.pid

    class Stalls(FsspecStorage):
        downloading = False

        def _download(self, root: str, spec: dict[str, Any]) -> None:
            self.downloading = True
            super()._download(root, spec)

        def _find_sizes(self, base: str) -> dict[str, int | None]:
            found = super()._find_sizes(base)
            if self.downloading and where == "download":  # listed: the batched cat meets a stalled server
                os.kill(pid, signal.SIGSTOP)
            return found

        def read_suffix(self, root: str, key: str, want: int) -> Any:
            if where == "pack end":
                os.kill(pid, signal.SIGSTOP)
            return super().read_suffix(root, key, want)

        def ranged_reads(self, root: str) -> Any:
            reads = super().ranged_reads(root)
            real = reads.read

            def read(key: str, byte_range: Any = None) -> Any:
                if where == "members":  # the pack's end was read: its members before it meet a stall
                    os.kill(pid, signal.SIGSTOP)
                return real(key, byte_range)

            reads.read = read
            return reads

    local = tmp_path / "ck"
    big = np.arange(96 * 1024, dtype=np.float32)
    state = {"m": {"w": np.arange(64.0), "b": np.ones(3), "big": big}}
    options = {"plan_options": acp.PlanOptions(pack_array_bytes=0)} if where == "download" else {}
    acp.save(local, state, **options)
    assert (local / ".acp" / "packs").exists() != (where == "download")
    for path in sorted(p for p in local.rglob("*") if p.is_file()):  # the same objects a save there writes
        key = f"load/{where}/{path.relative_to(local).as_posix()}".replace(" ", "-")
        server.client.put_object(Bucket=server.bucket, Key=key, Body=path.read_bytes())
    url = f"s3a://{server.bucket}/load/{where}".replace(" ", "-")
    storage.register_scheme("s3a", lambda: Stalls("s3a", {"endpoint_url": server.endpoint}))
    target = {"m": {k: np.zeros_like(v) for k, v in state["m"].items()}}
    outcome = _in_thread(lambda: acp.load(url, target, timeout=2), 30)
    error = outcome["error"]
    assert error is not None, "the load reported success from a store that never answered"
    assert "stalls" in str(error) and f"s3a://{server.bucket}/load" in str(error), error
    assert outcome["seconds"] < 15, outcome


def test_a_save_whose_upload_stalls_fails_within_its_timeout_and_commits_nothing(server: S3Process) -> None:
    pid = server.proc.pid

    class StallsAfterClaim(FsspecStorage):
        def acquire(self, final: str, token: str) -> None:
            super().acquire(final, token)
            os.kill(
                pid, signal.SIGSTOP
            )  # the batched upload, the metadata and the commit meet a stalled server

    storage.register_scheme("s3a", lambda: StallsAfterClaim("s3a", {"endpoint_url": server.endpoint}))
    url = f"s3a://{server.bucket}/save"
    outcome = _in_thread(lambda: acp.save(url, {"w": np.arange(1000.0), "b": np.ones(7)}, timeout=2), 60)
    error = outcome["error"]
    assert error is not None, "the save reported success to a store that never answered"
    assert "stalls" in str(error) and f"{server.bucket}/save" in str(error), error
    assert outcome["seconds"] < 40, outcome
    os.kill(pid, signal.SIGCONT)
    listed = server.client.list_objects_v2(Bucket=server.bucket, Prefix="save/")
    assert not [o["Key"] for o in listed.get("Contents", []) if o["Key"].endswith("/.acp/committed")]


def test_call_within_returns_raises_or_gives_up_in_time() -> None:
    from arraycheckpoint.storage.retry import call_within, is_transient

    assert call_within(5, lambda: 42, "read of x") == 42
    with pytest.raises(KeyError):
        call_within(5, lambda: {}["k"], "read of x")
    stuck = threading.Event()
    start = time.monotonic()
    with pytest.raises(TimeoutError, match="no answer from the store within 0.2 s") as info:
        call_within(0.2, stuck.wait, "read of x")
    assert time.monotonic() - start < 2 and is_transient(info.value)
    stuck.set()


def test_bulk_batches_stay_within_their_size() -> None:
    from arraycheckpoint.storage import fsspec_store

    cap = fsspec_store._BATCH_BYTES
    sizes = {"a": cap // 2, "b": cap // 2, "c": 1, "d": 2 * cap, "e": None, "f": 5}
    assert fsspec_store._batches(sizes) == [["a", "b"], ["c"], ["d"], ["e"], ["f"]]
