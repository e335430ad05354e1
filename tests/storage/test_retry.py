"""Retry policy of the small-object storage operations: what is transient, bounds, logging, fail-fast."""

from __future__ import annotations

import errno
import logging
import time

import pytest

from arraycheckpoint.errors import CheckpointExistsError, StorageError
from arraycheckpoint.storage.retry import RetryPolicy, is_transient, retry_call


@pytest.mark.parametrize(
    "error",
    [
        TimeoutError("read timed out"),
        ConnectionResetError("connection reset by peer"),
        OSError(errno.ETIMEDOUT, "Connection timed out"),
        ValueError("UNAVAILABLE: HTTP status code 503 SlowDown"),
        ValueError("DEADLINE_EXCEEDED: request took too long"),
        RuntimeError("HTTP 429 Too Many Requests"),
        RuntimeError("An error occurred (InternalError) status 500"),
    ],
)
def test_transient(error: BaseException) -> None:
    assert is_transient(error)


@pytest.mark.parametrize(
    "error",
    [
        OSError(errno.ENOSPC, "No space left on device"),
        PermissionError(errno.EACCES, "Permission denied"),
        FileNotFoundError(errno.ENOENT, "missing"),
        ValueError("PERMISSION_DENIED: AccessDenied"),
        ValueError("NOT_FOUND: NoSuchBucket"),
        ValueError("INVALID_ARGUMENT: bad key"),
        CheckpointExistsError("already there"),
    ],
)
def test_permanent(error: BaseException) -> None:
    assert not is_transient(error)


def test_transient_failures_are_retried_with_growing_backoff(caplog: pytest.LogCaptureFixture) -> None:
    calls = []
    sleeps: list[float] = []

    def flaky() -> str:
        calls.append(1)
        if len(calls) < 4:
            raise TimeoutError("timed out")
        return "ok"

    policy = RetryPolicy(max_attempts=5, initial_delay=0.1, max_delay=0.25, multiplier=2.0, jitter=0.0)
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        assert retry_call("read", "s3://b/k", flaky, policy, sleep=sleeps.append) == "ok"
    assert len(calls) == 4
    assert sleeps == [0.1, 0.2, 0.25]
    messages = [r.getMessage() for r in caplog.records if r.name == "arraycheckpoint"]
    assert len(messages) == 3 and all("read of s3://b/k" in m for m in messages)


def test_retries_are_bounded() -> None:
    calls = []

    def always() -> None:
        calls.append(1)
        raise ConnectionResetError("connection reset")

    with pytest.raises(StorageError, match=r"storage list of s3://b/p failed \(gave up after 3 attempts\)"):
        retry_call("list", "s3://b/p", always, RetryPolicy(max_attempts=3), sleep=lambda s: None)
    assert len(calls) == 3


def test_permanent_failure_is_not_retried_and_keeps_errno() -> None:
    calls = []

    def full() -> None:
        calls.append(1)
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(StorageError, match="write of /data/ck/x failed.*file system is full") as info:
        retry_call("write", "/data/ck/x", full, sleep=lambda s: pytest.fail("slept on a permanent error"))
    assert len(calls) == 1
    assert info.value.errno == errno.ENOSPC


def test_library_errors_pass_through() -> None:
    def refused() -> None:
        raise CheckpointExistsError("held")

    with pytest.raises(CheckpointExistsError):
        retry_call("lock", "x", refused, sleep=lambda s: None)


def test_jitter_stays_within_bounds() -> None:
    policy = RetryPolicy(initial_delay=1.0, max_delay=8.0, jitter=0.5)
    for attempt in range(1, 8):
        d = policy.delay(attempt)
        cap = min(8.0, 2.0 ** (attempt - 1))
        assert cap * 0.5 <= d <= cap


def test_retries_are_bounded_in_time_naming_the_path() -> None:
    """Attempts that each time out (a stalled store) stop once the operation's time bound is spent, however
    many attempts the policy would allow; the error names the operation, the path and the bound."""
    calls = []

    def stalls() -> None:
        calls.append(1)
        raise TimeoutError("no answer from the store within 0.05 s (it stalls)")

    policy = RetryPolicy(max_attempts=1000, initial_delay=0.02, max_delay=0.02, jitter=0.0)
    with pytest.raises(
        StorageError,
        match=r"storage read of s3://b/p/k failed \(gave up after \d+ attempts in .*past its bound of 0.1 s\)",
    ):
        retry_call("read", "s3://b/p/k", stalls, policy, sleep=time.sleep, deadline=0.1)
    assert 2 <= len(calls) <= 10


def test_a_tiny_save_timeout_does_not_fail_a_healthy_stores_requests() -> None:
    """The save's ``timeout=`` bounds each storage request; no request counts as stalled before 1 s."""
    import numpy as np

    import arraycheckpoint as acp
    from arraycheckpoint.storage import MemoryStorage

    backend = MemoryStorage()
    backend.stall_timeout = 1e-6
    assert backend.stall_bound() == 1.0
    url = "memory://retry-tests/tiny-timeout"
    acp.save(url, {"w": np.arange(5.0)}, timeout=1e-6)
    assert np.array_equal(acp.load(url, {"w": np.zeros(5)})["w"], np.arange(5.0))
