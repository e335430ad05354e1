"""N simulated ranks in one process: real saves and loads by many "ranks" without a process group.

:class:`SimWorld` holds the state that N :class:`SimCommunicator` instances share; each rank runs in its own
thread (:func:`run_ranks`) and the collectives meet at a :class:`threading.Barrier`. Each rank thread gets its
own :class:`~arraycheckpoint.engine.Engine` (the process-wide one runs one save at a time, as one process
does), so ``acp.save(..., comm=comm)`` / ``acp.load(..., comm=comm)`` run the real pipelines, write real files
and read them back: the data plane at a world size the gloo tests cannot reach on one small machine.
"""

from __future__ import annotations

import gc
import threading
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

import numpy as np

import arraycheckpoint.api as acp_api
from arraycheckpoint.engine import Engine
from arraycheckpoint.engine import engine as process_engine
from arraycheckpoint.runtime.collectives import Communicator

T = TypeVar("T")


class SimWorld:
    """What the ranks of one simulated world share: a barrier, one slot per rank, a mailbox matrix."""

    def __init__(self, size: int, timeout: float = 120.0) -> None:
        self.size = size
        self.barrier = threading.Barrier(size, timeout=timeout)
        self.slots: list[Any] = [None] * size
        self.mail: list[list[np.ndarray | None]] = [[None] * size for _ in range(size)]
        self.session = uuid.uuid4().hex[:12]
        self.calls = 0  # collectives run (counted by rank 0)
        self.received = [
            0
        ] * size  # payload bytes each rank received from the other ranks (as gloo moves them)

    def communicators(self) -> list[SimCommunicator]:
        return [SimCommunicator(self, r) for r in range(self.size)]


class SimCommunicator(Communicator):
    """Rank ``rank`` of a :class:`SimWorld`; every collective is two barrier waits (publish, then read)."""

    def __init__(self, world: SimWorld, rank: int) -> None:
        self._w = world
        self._rank = rank

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._w.size

    @property
    def session_id(self) -> str:
        return self._w.session

    def _exchange(self, mine: Any) -> list[Any]:
        w = self._w
        w.slots[self._rank] = mine
        w.barrier.wait()
        out = list(w.slots)
        if self._rank == 0:
            w.calls += 1
        w.barrier.wait()  # nobody publishes the next collective's value before every rank has read this one
        return out

    def all_gather_bytes(self, data: bytes) -> list[bytes]:
        out = [bytes(d) for d in self._exchange(bytes(data))]
        # counted as TorchCommunicator's all-gather moves them: every payload padded to the longest
        self._w.received[self._rank] += (self._w.size - 1) * max(len(d) for d in out)
        return out

    def broadcast_bytes(self, data: bytes | None, src: int = 0) -> bytes:
        out = bytes(self._exchange(bytes(data or b"") if self._rank == src else b"")[src])
        self._w.received[self._rank] += len(out) if self._rank != src else 0
        return out

    def all_reduce_min(self, values: Sequence[int]) -> list[int]:
        got = self._exchange([int(v) for v in values])
        return [min(col) for col in zip(*got, strict=True)]

    def all_to_all_bytes(self, send: Sequence[np.ndarray], recv_sizes: Sequence[int]) -> list[np.ndarray]:
        w, me = self._w, self._rank
        for dst in range(w.size):
            w.mail[me][dst] = np.array(send[dst], dtype=np.uint8, copy=True).reshape(-1)
        w.barrier.wait()
        out = []
        for src in range(w.size):
            got = w.mail[src][me]
            assert got is not None and got.size == recv_sizes[src], (src, me, recv_sizes[src])
            out.append(got)
            w.received[me] += got.size if src != me else 0
        w.barrier.wait()
        return out


_local = threading.local()


def _thread_engine() -> Engine:
    eng = getattr(_local, "engine", None)
    return eng if eng is not None else process_engine()


@contextmanager
def per_thread_engines() -> Iterator[None]:
    """Inside: ``acp.save``/``acp.load`` in a thread of :func:`run_ranks` use that rank's own engine."""
    saved = acp_api.engine
    acp_api.engine = _thread_engine  # type: ignore[assignment]
    try:
        yield
    finally:
        acp_api.engine = saved  # type: ignore[assignment]


def _import_frameworks() -> None:
    """Import torch before the threads start: N threads importing it lazily at once see it half built."""
    try:
        import torch  # noqa: F401
    except ImportError:
        pass


def run_ranks(
    size: int, fn: Callable[[SimCommunicator], T], timeout: float = 120.0, world: SimWorld | None = None
) -> list[T]:
    """Run ``fn(comm)`` for every rank of ``world`` (default: a fresh world of ``size`` ranks), one thread
    each, and return the results in rank order. The first rank's error is re-raised (the barrier is aborted
    so no rank hangs)."""
    _import_frameworks()
    world = world or SimWorld(size, timeout)
    size = world.size
    results: list[Any] = [None] * size
    errors: list[BaseException | None] = [None] * size

    def body(comm: SimCommunicator) -> None:
        _local.engine = Engine()
        try:
            results[comm.rank] = fn(comm)
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors[comm.rank] = e
            world.barrier.abort()
        finally:
            _local.engine.wait_idle()
            _local.engine = None

    threads = [
        threading.Thread(target=body, args=(c,), name=f"sim-rank-{c.rank}", daemon=True)
        for c in world.communicators()
    ]
    with per_thread_engines():
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout)
    gc.enable()  # gc_paused in concurrent loads may leave it off
    if any(t.is_alive() for t in threads):
        raise TimeoutError(f"simulated ranks still running after {timeout} s")
    real = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if real or any(errors):
        raise (real or [e for e in errors if e is not None])[0]
    return results
