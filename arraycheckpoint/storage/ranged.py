"""Ranged reads of objects through fsspec, shaped as tensorstore's key-value store reads.

A load reads packed members with ranged reads (:mod:`arraycheckpoint.engine.coalesce` merges them into few
spans, issued ahead; :mod:`arraycheckpoint.audit.packdir` reads a pack's end to check its directory). On
``s3://`` those go to tensorstore's key-value store of the packs' directory; tensorstore cannot call a Python
file system, so for every other fsspec URL :class:`FsspecRanges` answers the same calls
(``read(key, byte_range=slice(start, stop))`` returning a future of a result with ``state`` and ``value``)
with ``fs.cat_file(path, start=, end=)``: one ranged GET per call on s3fs, gcsfs and HTTP, a ``seek`` and a
``read`` on a mounted file system. Before, an fsspec load downloaded every pack of the checkpoint whole.

Each call runs as soon as it is asked for, on one of at most :data:`_WORKERS` threads of the process (the
spans issued ahead are fetched at once, as tensorstore fetches its futures; a check reading a thousand local
headers queues them), is bounded like every fsspec call of the backend (the stall bound, the
load's ``timeout=``, plus a second per MiB asked for: :meth:`~.fsspec_store.FsspecStorage._retry`) and
retried on transient errors within that bound: a store that stops answering fails the read, naming the path,
whatever the file system's own retries. A range past the object's end reads as what the object holds of it
(nothing, where it starts past the end: S3's ``416``), a missing object as ``state == "missing"``, so the
pack readers handle both as they handle tensorstore's answers (a member cut short is read alone and refused).
"""

from __future__ import annotations

import errno
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, NamedTuple

from ..checks.bounds import MAX_OBJECT_BYTES
from .fsspec_store import _bounded_cat

#: bytes assumed for the time bound of a read of a whole object of unknown size
_WHOLE_GUESS = 64 << 20
#: the most ranged reads running at once in a process (each waits on a bounded call of its own)
_WORKERS = 32
#: seconds an idle worker waits for a read before it ends
_IDLE_SECONDS = 10.0

_jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
_workers = 0
_guard = threading.Lock()


def _submit(job: Callable[[], None]) -> None:
    """Run ``job`` on a worker thread (daemon: a read never holds the interpreter's exit), starting one while
    fewer than :data:`_WORKERS` run."""
    global _workers
    _jobs.put(job)
    with _guard:
        if _workers < _WORKERS:
            _workers += 1
            threading.Thread(target=_work, name="acp-ranged-read", daemon=True).start()


def _work() -> None:
    global _workers
    while True:
        try:
            job = _jobs.get(timeout=_IDLE_SECONDS)
        except queue.Empty:
            with _guard:  # a job put meanwhile is seen here, or its submitter sees this worker gone
                if _jobs.empty():
                    _workers -= 1
                    return
            continue
        job()  # never raises: it hands its outcome to its future


class ReadResult(NamedTuple):
    """What a read returns, as tensorstore's ``KvStore.ReadResult``: ``"value"`` or ``"missing"``, and the bytes."""

    state: str
    value: bytes


class FsspecRanges:
    """Ranged reads of the objects below ``root`` of the fsspec backend ``storage`` (see the module docstring).

    ``requests`` and ``requested_bytes`` count the calls sent and the bytes they asked for (a suffix read
    counts its length; a whole object nothing until it is read)."""

    def __init__(self, storage: Any, root: str) -> None:
        self._storage = storage
        self._root = root
        self._guard = threading.Lock()
        self.requests = 0
        self.requested_bytes = 0

    def read(self, key: str, byte_range: slice | None = None) -> Future[ReadResult]:
        """Bytes ``byte_range`` of the object ``key`` (``slice(start, stop)``; ``slice(-n, None)``: its last
        ``n`` bytes; None: all of it), fetched on a thread of its own from now on."""
        path = self._storage._rpath(self._root, key)
        start = None if byte_range is None else byte_range.start
        stop = None if byte_range is None else byte_range.stop
        out: Future[ReadResult] = Future()
        if start is not None and start >= 0 and stop is not None and stop <= start:
            out.set_result(ReadResult("value", b""))  # nothing to ask for (fsspec reads 0-0 as everything)
            return out
        with self._guard:
            self.requests += 1
            self.requested_bytes += (
                (stop - start) if start is not None and stop is not None else max(0, -(start or 0))
            )

        def run() -> None:
            try:
                out.set_result(fetch(self._storage, path, start, stop))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                out.set_exception(e)

        _submit(run)
        return out


def fetch(storage: Any, path: str, start: int | None, stop: int | None) -> ReadResult:
    """``[start, stop)`` of the object at the file system path ``path`` of the fsspec backend ``storage``
    (see :meth:`FsspecRanges.read`), bounded in time and retried by the backend."""
    fs = storage.fs
    if start is None and stop is None:
        nbytes = _WHOLE_GUESS
    elif start is not None and stop is None:
        nbytes = -start if start < 0 else _WHOLE_GUESS
    else:
        nbytes = (stop or 0) - (start or 0)

    def op() -> ReadResult:
        try:
            if start is None and stop is None:
                return ReadResult("value", _bounded_cat(fs, path, MAX_OBJECT_BYTES))
            return ReadResult("value", bytes(fs.cat_file(path, start=start, end=stop)))
        except FileNotFoundError:
            return ReadResult("missing", b"")
        except OSError as e:  # a range starting past the object's end (S3: 416 InvalidRange)
            if _past_the_end(e):
                return ReadResult("value", b"")
            raise

    result: ReadResult = storage._retry("read", f"{storage.scheme}://{path}", op, nbytes)
    return result


def _past_the_end(error: OSError) -> bool:
    text = str(error)
    return (
        "InvalidRange" in text
        or "not satisfiable" in text
        or (error.errno == errno.EINVAL and "range" in text.lower())
    )
