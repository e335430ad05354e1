"""The save lock on an fsspec object store (``s3a://`` through s3fs 2026.2, on a moto server) is created with
a conditional write: s3fs maps ``open(path, "xb")`` to a ``PutObject`` with ``If-None-Match: *``, which the
server refuses (412) when the lock exists. So of eight saves creating it at once exactly one wins, and a
create never overwrites a lock it did not see (the check-then-write fallback, for file systems without an
exclusive create, would)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from arraycheckpoint import storage
from arraycheckpoint.storage import lease, storage_for
from arraycheckpoint.storage.base import LOCK_KEY

pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")


@pytest.fixture
def s3a_root(s3_server, s3_prefix) -> Iterator[str]:
    storage.configure("s3a", endpoint_url=s3_server.endpoint)
    try:
        yield s3_prefix.replace("s3://", "s3a://", 1)
    finally:
        storage.configure("s3a", endpoint_url=None)


def test_of_eight_concurrent_fsspec_lock_creates_one_wins(s3a_root: str) -> None:
    final = f"{s3a_root}/step_1"
    results: list[tuple[bool, str]] = []
    start = threading.Barrier(8)

    def create(i: int) -> None:
        backend, _ = storage_for(final)
        start.wait()
        results.append((backend._create_lock(final, lease.body(f"racer{i}")), f"racer{i}"))

    threads = [threading.Thread(target=create, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [name for won, name in results if won]
    assert len(winners) == 1, results
    assert storage_for(final)[0]._lock_token(final) == winners[0]


def test_an_fsspec_lock_create_never_overwrites_a_lock_it_did_not_see(
    s3a_root: str, s3_server, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = f"{s3a_root}/step_1"
    key = final.split(f"{s3_server.bucket}/", 1)[1] + f"/{LOCK_KEY}"
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=key, Body=lease.body("first-0"))
    backend, _ = storage_for(final)
    monkeypatch.setattr(type(backend), "exists", lambda self, root, k: False)  # a look that missed it
    assert backend._create_lock(final, lease.body("second-1")) is False
    body = s3_server.client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
    assert lease.parse(body)["token"] == "first-0"
