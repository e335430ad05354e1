"""Host staging buffers for snapshots and device loads: allocated once, prefaulted, pinned, reused.

The pool hands out host arrays of a given shape and dtype and takes them back when a save's writes (or a
load's host-to-device copies) are done. Buffers are keyed by byte size, so a save of the same state reuses
the same memory every time.

Memory comes from anonymous ``mmap`` regions whose pages are all faulted in when they are mapped (by the
kernel, or by page-locking them): a snapshot never page-faults fresh memory on its blocking path. Buffers under :data:`SMALL_BYTES` are carved out
of shared slabs so that thousands of small tensors cost a few mappings, not thousands.

When a :class:`Pinner` is installed (the torch adapter installs one as soon as the process uses CUDA), every
region is page-locked with ``cudaHostRegister`` so that device copies run at full bus speed and asynchronously.
Pinned bytes are bounded by a budget (:func:`set_pinned_budget`, ``ARRAYCHECKPOINT_PINNED_BYTES``, default half
the physical memory); past it the pool first releases idle pinned buffers, then falls back to pageable memory
and logs a warning once. The pool does no I/O and knows no framework.
"""

from __future__ import annotations

import logging
import mmap
import os
import threading
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

log = logging.getLogger("arraycheckpoint")

ALIGN = 64  # bytes: what vectorised copies and jax's zero-copy device_put want
SMALL_BYTES = 1 << 20  # buffers below this share slabs
SLAB_BYTES = 32 << 20
PINNED_BUDGET_ENV = "ARRAYCHECKPOINT_PINNED_BYTES"


class Pinner(Protocol):
    """Page-locks host memory for a device runtime (``cudaHostRegister``)."""

    def pin(self, address: int, nbytes: int) -> bool:
        """Lock ``[address, address + nbytes)``; False when the runtime refuses (the memory stays pageable)."""
        ...

    def unpin(self, address: int) -> None: ...


def _physical_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # pragma: no cover - not POSIX
        return 64 << 30


def default_pinned_budget() -> int:
    env = os.environ.get(PINNED_BUDGET_ENV)
    if env:
        return int(env)
    return _physical_bytes() // 2


class _Region:
    """One anonymous mapping, prefaulted, possibly pinned; unpinned and unmapped when collected."""

    def __init__(self, nbytes: int, pinner: Pinner | None) -> None:
        self.nbytes = nbytes
        # Every page is faulted in here, never on a snapshot's blocking path: by pinning (cudaHostRegister
        # populates the range itself: 0.4 s/GiB on an H100 host against 0.6 s/GiB to touch the pages and
        # 0.05 s/GiB more to pin them), by the kernel at map time (MAP_POPULATE), or by touching every page.
        populate = getattr(mmap, "MAP_POPULATE", 0) if pinner is None else 0
        self.map = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | populate)
        if nbytes >= 2 << 20 and not populate and hasattr(mmap, "MADV_HUGEPAGE"):
            self.map.madvise(mmap.MADV_HUGEPAGE)  # fewer faults and TLB misses
        self.array = np.frombuffer(self.map, dtype=np.uint8)
        self.address = self.array.ctypes.data
        self.pinned = bool(pinner is not None and pinner.pin(self.address, nbytes))
        if self.pinned:
            weakref.finalize(self, _unpin, pinner, self.address)
        elif not populate:
            self.array[:: mmap.PAGESIZE] = 0


def _unpin(pinner: Pinner, address: int) -> None:
    try:
        pinner.unpin(address)
    except Exception:  # noqa: BLE001 - interpreter shutdown with the runtime already gone
        pass


@dataclass(eq=False)
class _Block:
    """A byte range of a region handed out as one buffer."""

    region: _Region
    offset: int
    nbytes: int

    def array(self) -> np.ndarray:
        return self.region.array[self.offset : self.offset + self.nbytes]

    @property
    def pinned(self) -> bool:
        return self.region.pinned


def _round(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostBufferPool:
    """Host staging buffers reused from save to save (and load to load).

    ``take`` returns a C-contiguous, 64-byte-aligned array; ``give`` returns arrays obtained from ``take``
    (views of them are fine: the pool finds the buffer by its address). Thread-safe.
    """

    def __init__(self, pinned_budget: int | None = None, pinner: Pinner | None = None) -> None:
        self._lock = threading.Lock()
        self._pinner = pinner
        self.pinned_budget = default_pinned_budget() if pinned_budget is None else pinned_budget
        self._free: dict[int, list[_Block]] = {}  # by rounded byte size
        self._in_use: dict[int, _Block] = {}  # by address
        self._idle_large: OrderedDict[int, _Block] = OrderedDict()  # free standalone regions, oldest first
        self._slab: _Region | None = None
        self._slab_used = 0
        self._slabs: list[_Region] = []
        self._warned = False
        self._reserved: set[int] = set()  # byte sizes reserve() prepared (take_idle hands out only those)
        self.pinned_bytes = 0
        self.pageable_bytes = 0
        self.hits = 0
        self.misses = 0

    # ---------------------------------------------------------------------------------------- config
    @property
    def pinner(self) -> Pinner | None:
        return self._pinner

    def set_pinner(self, pinner: Pinner | None) -> None:
        """Pin regions allocated from now on (idle pageable buffers are dropped so they get pinned anew)."""
        with self._lock:
            if pinner is self._pinner:
                return
            self._pinner = pinner
            if pinner is not None:
                self._drop_idle(pinned=False)

    def set_pinned_budget(self, nbytes: int) -> None:
        with self._lock:
            self.pinned_budget = int(nbytes)

    # ------------------------------------------------------------------------------------- take/give
    def take(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
        """A buffer of ``shape`` and ``dtype`` (contents undefined)."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = _round(max(nbytes, 1))
        with self._lock:
            free = self._free.get(size)
            if free:
                block = free.pop()
                self._idle_large.pop(id(block), None)
                self.hits += 1
            else:
                block = self._allocate(size)
                self.misses += 1
            self._in_use[block.region.address + block.offset] = block
        return block.array()[:nbytes].view(dtype).reshape(shape)

    def take_idle(self, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray | None:
        """An idle buffer of ``shape`` and ``dtype`` (as :meth:`take`) of a size :meth:`reserve` prepared, or
        None: never allocates. A snapshot that copies parts of a region carves them out of the buffer
        ``acp.prepare`` reserved for the whole region, when there is one."""
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        size = _round(max(nbytes, 1))
        with self._lock:
            free = self._free.get(size) if size in self._reserved else None
            if not free:
                return None
            block = free.pop()
            self._idle_large.pop(id(block), None)
            self.hits += 1
            self._in_use[block.region.address + block.offset] = block
        return block.array()[:nbytes].view(dtype).reshape(shape)

    def give(self, buffers: Iterable[np.ndarray]) -> None:
        """Return buffers from :meth:`take`; arrays the pool did not hand out are ignored."""
        with self._lock:
            for b in buffers:
                block = self._in_use.pop(_address(b), None)
                if block is None:
                    continue
                self._free.setdefault(block.nbytes, []).append(block)
                if block.offset == 0 and block.region.nbytes == block.nbytes:
                    self._idle_large[id(block)] = block

    def is_pinned(self, buf: np.ndarray) -> bool:
        with self._lock:
            block = self._in_use.get(_address(buf))
        return block is not None and block.pinned

    def reserve(self, sizes: Iterable[tuple[tuple[int, ...], np.dtype]]) -> None:
        """Allocate (prefault, pin) buffers for these shapes now, so a later save finds them ready."""
        taken = [self.take(shape, dtype) for shape, dtype in sizes]
        with self._lock:
            self._reserved.update(_round(max(b.nbytes, 1)) for b in taken)
        self.give(taken)

    def clear(self) -> None:
        """Forget every idle buffer (their memory goes back to the system once no array refers to it)."""
        with self._lock:
            self._free.clear()
            self._idle_large.clear()
            self._reserved.clear()
            self._slab, self._slab_used = None, 0
            live = {id(b.region): b.region for b in self._in_use.values()}.values()
            self._slabs = [r for r in live if r in self._slabs]
            self.pinned_bytes = sum(r.nbytes for r in live if r.pinned)
            self.pageable_bytes = sum(r.nbytes for r in live if not r.pinned)

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "pinned_bytes": self.pinned_bytes,
                "pageable_bytes": self.pageable_bytes,
                "pinned_budget": self.pinned_budget,
                "buffers_in_use": len(self._in_use),
                "buffers_idle": sum(len(v) for v in self._free.values()),
                "hits": self.hits,
                "misses": self.misses,
            }

    # ------------------------------------------------------------------------------------- internals
    def _allocate(self, size: int) -> _Block:
        if size < SMALL_BYTES:
            if self._slab is None or self._slab_used + size > self._slab.nbytes:
                self._slab = self._region(SLAB_BYTES)
                self._slabs.append(self._slab)
                self._slab_used = 0
            block = _Block(self._slab, self._slab_used, size)
            self._slab_used += size
            return block
        return _Block(self._region(size), 0, size)

    def _region(self, nbytes: int) -> _Region:
        pinner = self._pinner
        if pinner is not None and self.pinned_bytes + nbytes > self.pinned_budget:
            self._drop_idle(pinned=True, need=self.pinned_bytes + nbytes - self.pinned_budget)
            if self.pinned_bytes + nbytes > self.pinned_budget:
                pinner = None
                if not self._warned:
                    self._warned = True
                    log.warning(
                        "arraycheckpoint: the pinned host buffer budget (%d MiB) is exhausted; staging in pageable "
                        "memory from here on, which makes device copies slower and synchronous. Raise it with "
                        "acp.prepare(state, pinned_bytes=...) or %s.",
                        self.pinned_budget >> 20,
                        PINNED_BUDGET_ENV,
                    )
        region = _Region(nbytes, pinner)
        if region.pinned:
            self.pinned_bytes += nbytes
        else:
            self.pageable_bytes += nbytes
        return region

    def _drop_idle(self, pinned: bool, need: int | None = None) -> None:
        """Release idle standalone buffers (pinned or pageable ones), oldest first, until ``need`` is freed."""
        freed = 0
        for key, block in list(self._idle_large.items()):
            if need is not None and freed >= need:
                break
            if block.pinned != pinned:
                continue
            del self._idle_large[key]
            self._free[block.nbytes].remove(block)
            if pinned:
                self.pinned_bytes -= block.nbytes
            else:
                self.pageable_bytes -= block.nbytes
            freed += block.nbytes


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


_shared: HostBufferPool | None = None
_shared_lock = threading.Lock()


def shared_pool() -> HostBufferPool:
    """The process-wide pool: the engine stages snapshots in it and :func:`arraycheckpoint.prepare` fills it."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = HostBufferPool()
        return _shared


def set_pinned_budget(nbytes: int) -> None:
    """Bound the page-locked bytes the process-wide pool may hold (the rest is staged in pageable memory)."""
    shared_pool().set_pinned_budget(nbytes)
