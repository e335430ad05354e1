"""Ranged reads of objects through fsspec, shaped as tensorstore's key-value store reads.

A load reads packed members with ranged reads (:mod:`arraycheckpoint.engine.coalesce` merges them into few
spans, issued ahead; :mod:`arraycheckpoint.audit.packdir` reads a pack's end to check its directory). On
``s3://`` those go to tensorstore's key-value store of the packs' directory; tensorstore cannot call a Python
file system, so for every other fsspec URL :class:`FsspecRanges` answers the same calls
(``read(key, byte_range=slice(start, stop))`` returning a future of a result with ``state`` and ``value``)
with ``fs.cat_file(path, start=, end=)``: one ranged GET per call on s3fs, gcsfs and HTTP, a ``seek`` and a
``read`` on a mounted file system. Before, an fsspec load downloaded every pack of the checkpoint whole.

Each call runs on one of at most :data:`_WORKERS` threads of its file system (the spans issued ahead are fetched
at once, as tensorstore fetches its futures; a check reading a thousand local headers queues them) and is
bounded like every fsspec call of the backend: the stall bound (the load's ``timeout=``) plus a second per MiB
asked for (:meth:`~.fsspec_store.FsspecStorage._bounded`), counted from when a worker starts it. A read still
queued fails once its store answered no call for the stall bound while it waited and the earliest of its calls
in flight is past its own bound (a store that stops answering: its reads fail within about their bound,
whatever the file system's own retries); reads queued behind a slow but live store's (or behind other loads')
wait for it (each answer is progress, and so is a call still within its bound). A wait on a
read's future (``result()``) ends by then too, and a transient error is retried while the bound allows. A load
that fails cancels its reads not yet started (:class:`~arraycheckpoint.engine.coalesce.SpanReader`), and at
most :data:`_CALLS` calls into one file system are left unanswered at once (each on a thread that cannot be
stopped: a read finding them all taken fails at its bound instead of starting another; another store's reads
are not held up by them; a call whose thread could not start gives its slot back at once). A reply longer
than the range asked for
(a server that ignores ``Range`` sends the whole object) is sliced when it is the whole object, refused
otherwise. A range past the object's end reads as what the object holds of it
(nothing, where it starts past the end: S3's ``416``), a missing object as ``state == "missing"``, so the
pack readers handle both as they handle tensorstore's answers (a member cut short is read alone and refused).
"""

from __future__ import annotations

import errno
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Future
from typing import Any, NamedTuple

from ..checks.bounds import MAX_OBJECT_BYTES
from ..errors import StorageError
from .fsspec_store import _MIN_BYTES_PER_SECOND, _bounded_cat
from .httpread import is_http, read_range
from .retry import retry_call

log = logging.getLogger("arraycheckpoint")

#: bytes assumed for the time bound of a read of a whole object of unknown size
_WHOLE_GUESS = 64 << 20
#: the most ranged reads running at once on one store (each waits on a bounded call of its own)
_WORKERS = 32
#: the most calls into one store unanswered at once (running, or left on their threads by a read that timed
#: out: a stalled store holds each until it answers)
_CALLS = 2 * _WORKERS
#: the most calls unanswered at once in the process, over all stores (stores keyed by options that differ on
#: every load would otherwise each leave their own)
_PROCESS_CALLS = 4 * _CALLS
#: seconds an idle worker waits for a read before it ends
_IDLE_SECONDS = 10.0
#: seconds a wait on a read's future gives its worker past the read's deadline to report the read's own error
_GRACE = 0.5

_guard = threading.Lock()
_process_calls = threading.BoundedSemaphore(_PROCESS_CALLS)


class _Store:
    """What the reads of one file system share: their workers (at most :data:`_WORKERS` threads, a queue of
    their own: one store's hung calls never hold up another's reads), its calls left unanswered (at most
    :data:`_CALLS`), when it last answered a call (``time.monotonic()``: progress, which a queued read
    waits on) and the deadlines of its calls not answered yet (a call still within its own bound is a slow but
    live store's, which a queued read waits for too)."""

    def __init__(self, fs: Any) -> None:
        self.calls = threading.BoundedSemaphore(_CALLS)
        self.answered = time.monotonic()
        #: the deadline of each call sent and not answered yet, by a number of its own (:class:`_Call`)
        self.running: dict[int, float] = {}
        self.jobs: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.workers = 0
        #: whether a reply of this file system may be the whole object whatever range was asked (HTTP: a
        #: server may ignore ``Range``; any other once it sent more than was asked for)
        self.whole_replies = is_http(fs)

    def earliest(self) -> float | None:
        """The earliest deadline of this store's calls not answered yet (None: none is in flight)."""
        with _guard:
            return min(self.running.values(), default=None)

    def submit(self, job: Callable[[], None]) -> None:
        """Run ``job`` on one of this store's workers (daemons: a read never holds the interpreter's exit),
        starting one while fewer than :data:`_WORKERS` run. Raises when no worker runs and none can start (a
        process at its thread limit): the caller cancels the job's future, so no later worker sends it."""
        self.jobs.put(job)
        with _guard:
            if self.workers < _WORKERS:
                self.workers += 1
                try:
                    threading.Thread(target=self._work, name="acp-ranged-read", daemon=True).start()
                except BaseException:  # no thread (a process at its limit): not counted
                    self.workers -= 1
                    if self.workers == 0:
                        raise
                    log.debug("storage: no new ranged-read thread; %d running serve the read", self.workers)

    def _work(self) -> None:
        while True:
            try:
                job = self.jobs.get(timeout=_IDLE_SECONDS)
            except queue.Empty:
                with _guard:  # a job put meanwhile is seen here, or its submitter sees this worker gone
                    if self.jobs.empty():
                        self.workers -= 1
                        return
                continue
            try:
                job()  # hands its outcome to its future
            except BaseException:  # noqa: BLE001 - a worker outlives any job
                log.warning("storage: a ranged read failed outside its future", exc_info=True)


#: the state of each file system, by its class and options (instances made with the same options share one:
#: fsspec makes one per thread, each load may run on its own, and a hung store's calls must count against
#: every load of it); small, and holds no file system. Held weakly: an entry lives while a worker, a read's
#: future or a call (hung ones too) holds it, so options that differ on every load (rotated credentials) do
#: not pile up
_stores: weakref.WeakValueDictionary[tuple[str, str], _Store] = weakref.WeakValueDictionary()
#: numbers the calls of :attr:`_Store.running`
_call_ids = itertools.count()


def _store_of(fs: Any, path: str = "") -> _Store:
    try:  # fsspec's own token names the thread that made the instance too (instances are per thread)
        from fsspec.utils import tokenize

        token = tokenize(type(fs).__module__, type(fs).__qualname__, getattr(fs, "storage_options", {}))
    except Exception:  # noqa: BLE001 - options that cannot be tokenized: this instance alone
        token = f"id-{id(fs)}"
    if is_http(fs):  # one HTTP file system serves every host: each host is a store of its own
        from urllib.parse import urlsplit

        token += "@" + urlsplit(path).netloc
    key = (type(fs).__qualname__, token)
    with _guard:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = _Store(fs)
        return store


class ReadResult(NamedTuple):
    """What a read returns, as tensorstore's ``KvStore.ReadResult``: ``"value"`` or ``"missing"``, and the bytes."""

    state: str
    value: bytes


class _Read(Future):  # type: ignore[type-arg]
    """A read's future whose ``result()`` ends once the read is past its bound (and :data:`_GRACE`), or, while
    it is still queued, once its store answered nothing for the stall bound: it is cancelled then and refused
    as a stall."""

    def __init__(self, store: _Store, stall: float, bound: float, where: str) -> None:
        super().__init__()
        self.store = store
        self.stall = stall  # seconds without an answer from the store after which a queued read fails
        self.bound = bound  # seconds the read may take once started
        self.asked = time.monotonic()
        self.deadline: float | None = None  # once started: when it is past its bound
        self._where = where

    def waited_since(self) -> float:
        """Since when the read, not yet started, waited without its store answering a call."""
        return max(self.asked, self.store.answered)

    def _stalls_at(self) -> float:
        """When the read, not yet started, counts as waiting on a stalled store: the stall bound after its
        store's last answer (or its own start), and not before the earliest call in flight there is past its
        own bound (a slow but live store's calls, each within its bound, keep it waiting)."""
        return max(self.waited_since() + self.stall, self.store.earliest() or 0.0)

    def stalled(self, now: float) -> bool:
        """Whether the read, not yet started, waited for the stall bound without progress."""
        return now > self._stalls_at()

    def _end(self) -> float:
        """When a wait on the read gives up: its bound from its start, or, queued, when it counts as stalled
        (:meth:`_stalls_at`) (plus :data:`_GRACE` for the worker to report the read's own error)."""
        if self.deadline is not None:
            return self.deadline + _GRACE
        return self._stalls_at() + _GRACE

    def result(self, timeout: float | None = None) -> Any:
        if timeout is not None:
            return super().result(timeout)
        while True:
            try:
                return super().result(max(0.0, min(self._end() - time.monotonic(), 1.0)))
            except CancelledError:  # refused before it started: its store answered nothing while it waited
                break
            except TimeoutError:
                if self.done():  # it ended just now (or its own error was a timeout): its outcome
                    return super().result(0)
                if time.monotonic() < self._end():  # as of now: it started, or its store answered, meanwhile
                    continue
            if self.deadline is None and not self.cancel():
                continue  # it started just now: its own bound decides
            break
        bound = self.bound if self.deadline is not None else self.stall
        raise StorageError(
            f"storage read of {self._where} failed: no answer within its bound of {bound:.3g} s (the store stalls)"
        ) from None


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
        self._sizes: dict[str, int | None] = {}  # objects' sizes asked for by this reader (one load)

    def read(self, key: str, byte_range: slice | None = None) -> Future[ReadResult]:
        """Bytes ``byte_range`` of the object ``key`` (``slice(start, stop)``; ``slice(-n, None)``: its last
        ``n`` bytes; None: all of it), fetched on a worker thread, within its bound from now on (see the
        module docstring)."""
        path = self._storage._rpath(self._root, key)
        start = None if byte_range is None else byte_range.start
        stop = None if byte_range is None else byte_range.stop
        bound = _bound(self._storage, start, stop)
        store = _store_of(self._storage.fs, path)
        out = _Read(store, float(self._storage.stall_bound()), bound, self._storage.normalize(path))
        if start is not None and start >= 0 and stop is not None and stop <= start:
            out.set_result(ReadResult("value", b""))  # nothing to ask for (fsspec reads 0-0 as everything)
            return out
        with self._guard:
            self.requests += 1
            self.requested_bytes += (
                (stop - start) if start is not None and stop is not None else max(0, -(start or 0))
            )

        def run() -> None:
            if out.stalled(time.monotonic()):
                out.cancel()  # its store answered nothing while it waited: refused by result() as a stall
            if not out.set_running_or_notify_cancel():
                return  # cancelled while queued: never sent
            out.deadline = time.monotonic() + bound
            try:
                out.set_result(fetch(self._storage, path, start, stop, out.deadline, self._sizes, store))
            except BaseException as e:  # noqa: BLE001 - handed to whoever waits on the future
                out.set_exception(e)

        try:
            store.submit(run)
        except BaseException:
            out.cancel()  # queued with no worker to run it: never sent by a later one
            raise
        return out


def _bound(storage: Any, start: int | None, stop: int | None) -> float:
    """Seconds a read of ``[start, stop)`` may take (the stall bound plus a second per MiB asked for)."""
    if start is None and stop is None:
        nbytes = _WHOLE_GUESS
    elif start is not None and stop is None:
        nbytes = -start if start < 0 else _WHOLE_GUESS
    else:
        nbytes = (stop or 0) - (start or 0)
    return float(storage.stall_bound() + nbytes / _MIN_BYTES_PER_SECOND)


def fetch(
    storage: Any,
    path: str,
    start: int | None,
    stop: int | None,
    deadline: float | None = None,
    sizes: dict[str, int | None] | None = None,
    store: _Store | None = None,
) -> ReadResult:
    """``[start, stop)`` of the object at the file system path ``path`` of the fsspec backend ``storage``
    (see :meth:`FsspecRanges.read`), retried by the backend on transient errors and ended by ``deadline``
    (``time.monotonic()``; None: the read's bound from now)."""
    fs = storage.fs
    if store is None:
        store = _store_of(fs, path)
    bound = _bound(storage, start, stop)
    if deadline is None:
        deadline = time.monotonic() + bound
    where = storage.normalize(path)

    def op(call: _Call) -> ReadResult:
        if not call.begin():
            raise TimeoutError("abandoned before it began")  # its slots were given back: nobody waits on it
        try:
            if start is None and stop is None:
                return ReadResult("value", _bounded_cat(fs, path, MAX_OBJECT_BYTES))
            if is_http(fs):  # streamed: never more of a reply than the range (httpread)
                return ReadResult("value", read_range(fs, path, start, stop, MAX_OBJECT_BYTES))
            data = bytes(fs.cat_file(path, start=start, end=stop))
            return ReadResult("value", _as_asked(fs, path, where, data, start, stop, store, sizes))
        except FileNotFoundError:
            return ReadResult("missing", b"")
        except OSError as e:  # a range starting past the object's end (S3: 416 InvalidRange)
            if _past_the_end(e):
                return ReadResult("value", b"")
            raise
        finally:
            store.answered = time.monotonic()  # an answer, whatever it says: the store is alive
            call.end()

    def attempt() -> ReadResult:
        left = deadline - time.monotonic()
        if left > 0 and store.calls.acquire(timeout=left):
            if _process_calls.acquire(timeout=max(0.0, deadline - time.monotonic())):
                call = _Call(store, deadline)
                try:
                    left = deadline - time.monotonic()
                    return storage._bounded("read", where, lambda: op(call), seconds=left)  # type: ignore[no-any-return]
                except BaseException:
                    call.abandon()  # its thread never ran it (none could start): its slots back now
                    raise
            store.calls.release()
        raise TimeoutError(
            f"no answer from the store within {bound:.3g} s (it stalls: {_CALLS} calls into it, or "
            f"{_PROCESS_CALLS} in the process, are left unanswered)"
        )

    result: ReadResult = retry_call(
        "read", where, attempt, storage.retry_policy, deadline=max(0.0, deadline - time.monotonic())
    )
    return result


class _Call:
    """One call into a store, holding one of its slots and one of the process's (taken by the caller) until
    it ends, or until it is abandoned before it began (its thread could not start): whichever comes first
    gives them back, once; a call abandoned so returns at once if its thread starts after all."""

    def __init__(self, store: _Store, deadline: float) -> None:
        self._store = store
        self._id = next(_call_ids)
        self._state = "waiting"  # then "running", "abandoned" or "ended"
        with _guard:
            store.running[self._id] = deadline

    def begin(self) -> bool:
        """Whether the call may run (it was not abandoned)."""
        with _guard:
            if self._state != "waiting":
                return False
            self._state = "running"
            return True

    def abandon(self) -> None:
        """Give the slots back unless the call began (a call that began gives them back when it ends)."""
        with _guard:
            if self._state != "waiting":
                return
            self._state = "abandoned"
        self._free()

    def end(self) -> None:
        """The call that began ended (answered or failed): its slots back."""
        with _guard:
            self._state = "ended"
        self._free()

    def _free(self) -> None:
        with _guard:
            self._store.running.pop(self._id, None)
        self._store.calls.release()
        _process_calls.release()


def _as_asked(
    fs: Any,
    path: str,
    where: str,
    data: bytes,
    start: int | None,
    stop: int | None,
    store: _Store | None = None,
    sizes: dict[str, int | None] | None = None,
) -> bytes:
    """``data``, a reply to a read of ``[start, stop)``, as that range: a server that ignores ``Range`` sends
    the whole object, which is cut to it. The object's size is asked for when the reply is longer than the
    range, or, from a file system whose replies may be whole objects (``store.whole_replies``), for a range at
    an offset (a whole object can be as long as the range, or shorter where the range reaches past its end):
    once per object and reader (``sizes``: one load). Where the size is unknown (a server that sends none), a
    reply no longer than the range is taken as it; any other reply of the wrong length is refused."""
    start = start or 0
    if start < 0:  # the last -start bytes: a whole object no longer than that is its own suffix
        if len(data) <= -start:
            return data
        size = _size(fs, path, sizes)
        if size == len(data):
            return data[start:]
        raise _not_the_range(where, data, -start, size)
    asked = None if stop is None else stop - start
    longer = asked is not None and len(data) > asked
    whole = store is None or store.whole_replies
    if not longer and (start == 0 or not whole):
        return data  # the range (or what the object holds of it), or the whole object from its start
    if store is not None:
        store.whole_replies = True
    size = _size(fs, path, sizes)
    if size is None:
        if longer:
            raise _not_the_range(where, data, asked, size)
        return data
    if len(data) == size and (longer or start > 0):  # the whole object (a range at an offset is shorter)
        return data[start:stop]
    if len(data) != max(0, min(size, size if stop is None else stop) - start):
        raise _not_the_range(where, data, asked, size)
    return data


def _size(fs: Any, path: str, sizes: dict[str, int | None] | None) -> int | None:
    """The size of the object at ``path`` (None where the file system does not know it), asked for once per
    ``sizes``."""
    if sizes is not None and path in sizes:
        return sizes[path]
    got = fs.size(path)
    size = int(got) if isinstance(got, int) and got >= 0 else None
    if sizes is not None:
        sizes[path] = size
    return size


def _not_the_range(where: str, data: bytes, asked: int | None, size: int | None) -> StorageError:
    return StorageError(
        f"storage read of {where} failed: {len(data)} bytes came back for a range of "
        f"{'the rest' if asked is None else asked} bytes, and the object is {'?' if size is None else size} bytes: "
        "the server's reply is "
        "not the range asked for"
    )


def _past_the_end(error: OSError) -> bool:
    text = str(error)
    return (
        "InvalidRange" in text
        or "not satisfiable" in text
        or (error.errno == errno.EINVAL and "range" in text.lower())
    )
