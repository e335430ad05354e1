"""Reads of packs' ends (their ZIP directories) issued ahead of the walk that checks them, on object stores.

A reader of a format-6 checkpoint checks each rank's packs one after another
(:class:`arraycheckpoint.audit.rankpacks.RankPacks`): each starts with one read of the pack's end (a suffix
GET), which on S3 or GCS costs a round trip of 20-50 ms; a load, ``verify`` or ``export`` of a checkpoint of
1,000 ranks paid thousands of them in a row. :class:`EndReads` issues the reads the walk will make, in its
order, on at most :data:`WORKERS` threads, at most :data:`AHEAD` of them not yet taken by the walk (each at
most :data:`arraycheckpoint.audit.packdir._PACK_TAIL_BYTES`: 8 MiB held at most). The walk takes each one
(:func:`arraycheckpoint.audit.packdir._pack_directory`) and parses and checks it as it did the bytes it read
itself: the same requests with the same ranges, the same checks and errors, each directory in the same order;
only their round trips overlap. A read that fails is raised by the walk where it would have met it. Each read
keeps its own bound (the ``timeout=`` of the store: botocore's timeouts, the deadline of an fsspec read).
"""

from __future__ import annotations

import contextvars
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from . import packdir

#: the most ends read at once by one walk
WORKERS = 16
#: the most ends read ahead and not yet taken by the walk (memory: each at most 256 KiB)
AHEAD = 32

#: what a read ahead is known by: (pack key, bytes asked for from its end, the bound of its directory)
Job = tuple[str, int, int | None]


class EndReads:
    """The ends of the packs ``jobs`` (in the order the walk takes them) of the checkpoint ``base`` on the
    object store ``storage``, read ahead (see the module docstring); :meth:`close` when the walk ends."""

    def __init__(self, storage: Any, base: str, jobs: Iterable[Job]) -> None:
        self._storage, self._base = storage, base
        self._jobs: list[Job] = list(dict.fromkeys(jobs))
        self._planned = set(self._jobs)
        self._next = 0  # the next job to issue
        self._issued: dict[Job, Future[Any]] = {}  # issued, not yet taken
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._context = contextvars.copy_context()  # the reads run as they would on the walk's thread
        self._fill()

    def take(self, key: str, want: int, max_directory_bytes: int | None) -> Any:
        """What :func:`arraycheckpoint.audit.packdir.read_end` returns for these arguments, read ahead (its
        error raised here), or :data:`arraycheckpoint.audit.packdir.NOT_AHEAD` when it was not planned or not
        yet issued: the caller reads it."""
        job = (key, want, max_directory_bytes)
        with self._lock:
            future = self._issued.pop(job, None)
            if future is None:
                self._planned.discard(job)  # read by the caller: never issued here
                return packdir.NOT_AHEAD
        self._fill()
        return future.result()  # bounded by the read's own deadline

    def _fill(self) -> None:
        """Issue planned reads, in order, while fewer than :data:`AHEAD` wait to be taken."""
        with self._lock:
            while len(self._issued) < AHEAD and self._next < len(self._jobs):
                job = self._jobs[self._next]
                self._next += 1
                if job not in self._planned:
                    continue
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(
                        min(WORKERS, len(self._jobs)), thread_name_prefix="acp-ends"
                    )
                self._issued[job] = self._pool.submit(self._context.copy().run, self._read, job)

    def _read(self, job: Job) -> Any:
        key, want, max_directory_bytes = job
        return packdir.read_end(self._storage, self._base, key, want, max_directory_bytes)

    def close(self) -> None:
        """Cancel the reads not started (a walk that failed, or a plan the walk did not follow); those running
        end within their own bounds, waited on by nobody."""
        with self._lock:
            self._next = len(self._jobs)
            issued, self._issued = list(self._issued.values()), {}
            pool, self._pool = self._pool, None
        for f in issued:
            f.cancel()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
