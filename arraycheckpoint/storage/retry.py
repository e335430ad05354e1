"""Bounded retries with exponential backoff for the small-object storage operations.

Only *transient* failures are retried: timeouts, throttling (HTTP 429, S3 ``SlowDown``), server errors (5xx)
and dropped connections. Everything else (missing bucket, access denied, disk full, invalid argument) is
*permanent* and fails at once with a :class:`~arraycheckpoint.errors.StorageError` naming the operation and
the path. Every retry is logged on the ``arraycheckpoint`` logger at WARNING level.

Bulk array I/O does not go through here: tensorstore retries its own HTTP requests (the ``s3`` backend
configures ``s3_request_retries``), and local file I/O has no transient failures worth retrying.
"""

from __future__ import annotations

import errno
import logging
import random
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from ..errors import ArrayCheckpointError, StorageError

log = logging.getLogger("arraycheckpoint")

T = TypeVar("T")

_TRANSIENT_ERRNOS = frozenset(
    {errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNABORTED, errno.ECONNREFUSED, errno.EAGAIN, errno.EPIPE}
)
_PERMANENT_ERRNOS = frozenset(
    {errno.ENOSPC, errno.EDQUOT, errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOENT}
)

# Status words of tensorstore/absl, HTTP status codes and S3 error codes that mean "try again".
_TRANSIENT_TEXT = re.compile(
    r"\b(UNAVAILABLE|DEADLINE_EXCEEDED|ABORTED|timed? ?out|timeout|throttl\w*|SlowDown|RequestTimeout|"
    r"Too Many Requests|TooManyRequests|ServiceUnavailable|InternalError|Service Unavailable|"
    r"connection (?:reset|refused|closed|aborted)|broken pipe|"
    r"(?:HTTP|status|code)[ :=]*(?:429|5\d\d))\b",
    re.IGNORECASE,
)
_PERMANENT_TEXT = re.compile(
    r"\b(PERMISSION_DENIED|INVALID_ARGUMENT|NOT_FOUND|FAILED_PRECONDITION|UNAUTHENTICATED|AccessDenied|"
    r"NoSuchBucket|InvalidAccessKeyId|SignatureDoesNotMatch|No space left)\b",
    re.IGNORECASE,
)


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a transient failure is retried.

    Attempt ``k`` (1-based) that fails transiently sleeps ``min(max_delay, initial_delay * multiplier**(k-1))``
    scaled by a random factor in ``[1 - jitter, 1]`` before attempt ``k + 1``; after ``max_attempts`` attempts
    the last error is raised as :class:`StorageError`.
    """

    max_attempts: int = 5
    initial_delay: float = 0.1
    max_delay: float = 5.0
    multiplier: float = 2.0
    jitter: float = 0.5

    def delay(self, attempt: int) -> float:
        """Seconds to sleep after failed attempt ``attempt`` (1-based)."""
        base = min(self.max_delay, self.initial_delay * self.multiplier ** (attempt - 1))
        return base * (1.0 - self.jitter * random.random())


DEFAULT_POLICY = RetryPolicy()


def is_transient(error: BaseException) -> bool:
    """Whether ``error`` is worth retrying (timeout, throttling, 5xx, dropped connection)."""
    if isinstance(error, ArrayCheckpointError):
        return False
    if isinstance(error, (TimeoutError, ConnectionError)):
        return True
    if isinstance(error, OSError) and error.errno is not None:
        if error.errno in _PERMANENT_ERRNOS:
            return False
        if error.errno in _TRANSIENT_ERRNOS:
            return True
    text = str(error)
    if _PERMANENT_TEXT.search(text):
        return False
    return bool(_TRANSIENT_TEXT.search(text))


def retry_call(
    operation: str,
    path: str,
    fn: Callable[[], T],
    policy: RetryPolicy = DEFAULT_POLICY,
    sleep: Callable[[float], None] = time.sleep,
    deadline: float | None = None,
) -> T:
    """Run ``fn`` and retry it on transient failures according to ``policy``.

    Args:
        operation: what is done (``"read"``, ``"write"``, ``"list"``, ...), for messages and logs.
        path: the object or prefix operated on, for messages and logs.
        fn: the operation; it must be idempotent.
        policy: attempts and backoff.
        sleep: the sleep function (a test may pass a recorder).
        deadline: seconds after the first attempt's start past which no new attempt starts (a retry loop over
            a store whose requests time out is bounded in time, not only in attempts); None: attempts only.

    Returns:
        ``fn()``'s result.

    Raises:
        StorageError: at once for a permanent failure, or after ``policy.max_attempts`` transient failures;
            the message names the operation, the path and the last error. Errors of this library
            (:class:`ArrayCheckpointError`) pass through unchanged.
    """
    attempt = 1
    start = time.monotonic()
    while True:
        try:
            return fn()
        except ArrayCheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below
            if not is_transient(e):
                raise _storage_error(operation, path, e, "permanent error, not retried") from e
            if attempt >= policy.max_attempts:
                raise _storage_error(operation, path, e, f"gave up after {attempt} attempts") from e
            wait = policy.delay(attempt)
            elapsed = time.monotonic() - start
            if deadline is not None and elapsed + wait > deadline:
                why = (
                    f"gave up after {attempt} attempts in {elapsed:.1f} s, past its bound of {deadline:.3g} s"
                )
                raise _storage_error(operation, path, e, why) from e
            log.warning(
                "storage %s of %s failed (attempt %d/%d, retrying in %.2fs): %s",
                operation, path, attempt, policy.max_attempts, wait, e,
            )  # fmt: skip
            sleep(wait)
            attempt += 1


def _storage_error(operation: str, path: str, error: BaseException, why: str) -> StorageError:
    code = error.errno if isinstance(error, OSError) and error.errno else None
    msg = f"storage {operation} of {path} failed ({why}): {type(error).__name__}: {error}"
    if code == errno.ENOSPC:
        msg += " -- the file system is full: free space or save elsewhere"
    out = StorageError(msg)
    out.errno = code
    return out


def call_within(
    seconds: float,
    fn: Callable[[], T],
    what: str,
    on_stall: Callable[[str], Callable[[], None]] | None = None,
) -> T:
    """``fn()``, run on a daemon thread and waited for at most ``seconds``: a call into a library that has no
    timeout of its own (a Python file system of fsspec) cannot hang its caller on a store that stops
    answering. The call itself cannot be stopped: it is left to finish or fail on its thread.

    ``on_stall(what)``, when given, is called once the wait timed out while ``fn`` still runs; the callable it
    returns is called (on ``fn``'s thread) when ``fn`` ends after all: a save tracks its requests that may
    still land (:mod:`.stalls`).

    Raises:
        TimeoutError: ``fn`` did not return within ``seconds`` (transient: :func:`retry_call` retries it while
            its deadline allows). ``what`` (the operation and its path) names the thread; the caller's
            error names them.
    """
    box: dict[str, Any] = {}
    done = threading.Event()
    guard = threading.Lock()
    late: list[Callable[[], None]] = []

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            box["error"] = e
        finally:
            with guard:
                done.set()
            for ended in late:
                try:
                    ended()
                except Exception:  # noqa: BLE001 - a daemon thread: logged, never raised
                    log.warning("storage: handling the late end of %s failed", what, exc_info=True)

    threading.Thread(target=run, name=f"acp-store-call {what}"[:64], daemon=True).start()
    if not done.wait(seconds):
        if on_stall is not None:
            with guard:
                if not done.is_set():  # still running: its end is reported (else it ended just now)
                    late.append(on_stall(what))
        raise TimeoutError(f"no answer from the store within {seconds:.3g} s (it stalls)")
    if "error" in box:
        raise box["error"]
    return box["value"]  # type: ignore[no-any-return]
