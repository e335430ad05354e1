"""CUDA copies for snapshots and loads: pinned host buffers, a side stream per device, events as fences.

Snapshot (device -> host): each CUDA region is copied with ``non_blocking=True`` on a dedicated copy stream
that first waits for the work already queued on the caller's current stream, into a page-locked buffer of the
process-wide :mod:`~arraycheckpoint.runtime.hostpool`. The copy returns a :class:`CopyFence` (a CUDA event and a
reference to the source tensor, so its memory cannot be freed and reused while the copy reads it); the engine
completes ``future.staged`` and starts writing only once every fence has fired. The caller's thread is not
blocked by the copies: training may run its next forward and backward pass while they proceed.

Parameters must not be written before ``staged`` completes. The common writer is ``optimizer.step()``:
a global optimizer step pre-hook makes the current stream wait (on the device, without blocking the host) for
the last snapshot's copies, so a loop that forgets ``fut.staged.result()`` still saves the right values.
Other in-place writes (BatchNorm running statistics in a forward pass, ``p.data.copy_``) need
``fut.staged.result()`` first.

Load (host -> device): regions are read into pinned buffers, copied to the device asynchronously on the copy
stream, and the current stream waits for them on the device; each buffer returns to the pool once its copy
has fired, and pinned bytes waiting for copies are bounded (:data:`MAX_PENDING_H2D_BYTES`).

This module deliberately does nothing for CPU tensors, and never initialises CUDA itself.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

import numpy as np
import torch

from ...runtime.hostpool import HostBufferPool, shared_pool

MAX_PENDING_H2D_BYTES = 1 << 30


class CudaPinner:
    """Page-locks host memory with ``cudaHostRegister`` (portable: valid for every device)."""

    def pin(self, address: int, nbytes: int) -> bool:
        return int(torch.cuda.cudart().cudaHostRegister(address, nbytes, 1)) == 0

    def unpin(self, address: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(address)


_lock = threading.Lock()
_streams: dict[int, torch.cuda.Stream] = {}
_last_snapshot: dict[int, torch.cuda.Event] = {}
_hook_installed = False


def use_cuda(pool: HostBufferPool | None = None) -> None:
    """Pin the pool's buffers from now on and guard optimizer steps (idempotent; called on CUDA tensors)."""
    global _hook_installed
    pool = pool or shared_pool()
    if not isinstance(pool.pinner, CudaPinner):
        pool.set_pinner(CudaPinner())
    if not _hook_installed:
        with _lock:
            if not _hook_installed:
                from torch.optim.optimizer import register_optimizer_step_pre_hook

                register_optimizer_step_pre_hook(_before_optimizer_step)
                _hook_installed = True


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    s = _streams.get(index)
    if s is None:
        with _lock:
            s = _streams.get(index)
            if s is None:
                s = _streams[index] = torch.cuda.Stream(device=index)
    return s


class CopyFence:
    """Completion of one device copy; holds the source tensor alive until :meth:`wait` returns."""

    __slots__ = ("event", "_held")

    def __init__(self, event: torch.cuda.Event, held: Any) -> None:
        self.event = event
        self._held = held

    def done(self) -> bool:
        return self.event.query()

    def wait(self) -> None:
        """Block (sleeping, not spinning: the training loop keeps its cores) until the copy has landed."""
        self.event.synchronize()
        self._held = None


def snapshot_copy(src: torch.Tensor, dst: torch.Tensor) -> CopyFence:
    """Queue ``dst.copy_(src)`` (device to host) on the copy stream; returns its fence."""
    if _returns.pending:
        _returns.reclaim(shared_pool(), MAX_PENDING_H2D_BYTES)
    device = src.device
    side = copy_stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        dst.copy_(src.reshape(dst.shape), non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(side)
    _last_snapshot[device.index if device.index is not None else torch.cuda.current_device()] = event
    return CopyFence(event, src)


def _before_optimizer_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """Order the step's parameter writes after the last snapshot's reads, on the device."""
    if not _last_snapshot:
        return
    for index, event in list(_last_snapshot.items()):
        if not event.query():
            torch.cuda.current_stream(index).wait_event(event)
        _last_snapshot.pop(index, None)


# ------------------------------------------------------------------------------------------------ loads
class _Returns:
    """Pinned load buffers waiting for their host-to-device copies; returned to the pool once fired."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: deque[tuple[torch.cuda.Event, np.ndarray]] = deque()
        self.pending = 0

    def add(self, event: torch.cuda.Event, buf: np.ndarray) -> None:
        with self._lock:
            self._queue.append((event, buf))
            self.pending += buf.nbytes

    def reclaim(self, pool: HostBufferPool, bound: int) -> None:
        """Give back fired buffers; wait for the oldest copies while more than ``bound`` bytes are pending."""
        done = []
        with self._lock:
            while self._queue and (self.pending > bound or self._queue[0][0].query()):
                event, buf = self._queue.popleft()
                event.synchronize()
                self.pending -= buf.nbytes
                done.append(buf)
        pool.give(done)


_returns = _Returns()


def staging_buffer(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """A pinned host buffer to read a region into before it goes to the device."""
    pool = shared_pool()
    _returns.reclaim(pool, MAX_PENDING_H2D_BYTES)
    return pool.take(shape, dtype)


def upload(view: torch.Tensor, host: torch.Tensor, buf: np.ndarray) -> None:
    """Copy ``host`` (a view of pool buffer ``buf``) into the CUDA tensor ``view`` asynchronously.

    The caller's current stream waits for the copy on the device, so anything it runs next sees the loaded
    values; ``buf`` returns to the pool once the copy has fired.
    """
    device = view.device
    current = torch.cuda.current_stream(device)
    side = copy_stream(device)
    side.wait_stream(current)
    with torch.no_grad(), torch.cuda.stream(side):
        view.copy_(host.reshape(view.shape), non_blocking=True)
        event = torch.cuda.Event(blocking=True)
        event.record(side)
    view.record_stream(side)
    current.wait_event(event)
    _returns.add(event, buf)


def finish_loads() -> None:
    """Wait for every queued host-to-device copy and return its buffer (tests, and before freeing memory)."""
    _returns.reclaim(shared_pool(), 0)
