"""Regions of row-major tensors stored as plain bytes in a file, read as byte ranges through tensorstore.

A tensor stored C-order at ``[begin, end)`` of a file (safetensors data, an uncompressed zip entry) is read
region by region: a box becomes the contiguous runs of the flat layout it covers, runs close enough to each
other are merged into one range read (never fetching more than :data:`MAX_OVERREAD` extra of the region's
own bytes), and the ranges go to the storage's kvstore with a bound on bytes in flight. Nothing here knows a
file format: the sources hand in ``(file, begin, shape, dtype)`` per tensor.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._tscontext import context
from ..errors import CorruptCheckpointError, StorageError
from ..items import LoadShard
from ..regions import Box

#: merged reads fetch at most this fraction more than the region's own bytes
MAX_OVERREAD = 0.1


@dataclass(frozen=True)
class StoredTensor:
    """Where a tensor's bytes are: file key (relative to the source root), offset, global shape, dtype."""

    name: str
    key: str
    begin: int
    shape: tuple[int, ...]
    dtype: np.dtype[Any]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def runs(shape: tuple[int, ...], box: Box) -> tuple[int, Iterator[int]]:
    """The contiguous runs of ``box`` in the C-order layout of ``shape``: (run length, run starts), elements."""
    ndim = len(shape)
    k = ndim  # dims k.. are covered whole
    while k > 0 and box.offsets[k - 1] == 0 and box.lengths[k - 1] == shape[k - 1]:
        k -= 1
    if k == 0:
        return math.prod(shape), iter((0,))
    inner = math.prod(shape[k:])
    length = box.lengths[k - 1] * inner
    strides = [math.prod(shape[i + 1 :]) for i in range(ndim)]
    outer = [range(o, o + n) for o, n in zip(box.offsets[: k - 1], box.lengths[: k - 1])]
    base = box.offsets[k - 1] * strides[k - 1]

    def starts() -> Iterator[int]:
        if any(len(r) == 0 for r in outer):
            return
        for idx in np.ndindex(*(len(r) for r in outer)) if outer else [()]:
            yield base + sum((outer[i][j]) * strides[i] for i, j in enumerate(idx))

    return length, starts()


@dataclass
class _Range:
    begin: int  # bytes, in the file
    end: int
    pieces: list[tuple[int, int]] = field(default_factory=list)  # (offset in range, offset in output), bytes


def byte_ranges(t: StoredTensor, box: Box) -> tuple[int, list[_Range]]:
    """Merge the runs of ``box`` into range reads; returns (run bytes, ranges)."""
    length, starts = runs(t.shape, box)
    item = t.dtype.itemsize
    run_bytes = length * item
    out: list[_Range] = []
    pos = 0
    for s in starts:
        b = t.begin + s * item
        last = out[-1] if out else None
        if last is not None and b >= last.end and b - last.end <= MAX_OVERREAD * run_bytes:
            last.pieces.append((b - last.begin, pos))
            last.end = b + run_bytes
        else:
            out.append(_Range(b, b + run_bytes, [(0, pos)]))
        pos += run_bytes
    return run_bytes, out


class RangeReader:
    """Reads boxes of :class:`StoredTensor` s from one storage root with a bound on bytes in flight."""

    def __init__(self, storage: Any, root: str, max_inflight_bytes: int) -> None:
        import tensorstore as ts

        self._kv = ts.KvStore.open(storage.kvstore_spec(root), context=context()).result()
        self.root = root
        self.max_inflight = max_inflight_bytes
        self.fetched = 0
        self.wanted = 0
        self._inflight: deque[tuple[StoredTensor, Box, int, list[tuple[_Range, Any]], Callable]] = deque()
        self._pending = 0

    def submit(self, t: StoredTensor, shard: LoadShard) -> None:
        box = shard.box
        nbytes = box.volume * t.dtype.itemsize
        if nbytes == 0:
            self._deliver(shard, np.empty(box.lengths, t.dtype))
            return
        run_bytes, ranges = byte_ranges(t, box)
        while self._inflight and self._pending + nbytes > self.max_inflight:
            self._drain_one()
        futs = [(r, self._kv.read(t.key, byte_range=slice(r.begin, r.end))) for r in ranges]
        self._inflight.append((t, box, run_bytes, futs, lambda a, s=shard: self._deliver(s, a)))
        self._pending += nbytes
        self.wanted += nbytes
        self.fetched += sum(r.end - r.begin for r in ranges)

    def finish(self) -> None:
        while self._inflight:
            self._drain_one()

    def _drain_one(self) -> None:
        t, box, run_bytes, futs, deliver = self._inflight.popleft()
        flat = np.empty(box.volume * t.dtype.itemsize, np.uint8)
        for r, fut in futs:
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001
                raise StorageError(f"tensor {t.name!r}: reading {t.key} in {self.root} failed: {e}") from e
            data = memoryview(res.value) if res.state == "value" else memoryview(b"")
            if len(data) != r.end - r.begin:
                raise CorruptCheckpointError(
                    f"tensor {t.name!r}: {t.key} in {self.root} is shorter than its header says "
                    f"(bytes [{r.begin}, {r.end}) asked, {len(data)} read); the file is truncated"
                )
            src = np.frombuffer(data, np.uint8)
            for at, pos in r.pieces:
                flat[pos : pos + run_bytes] = src[at : at + run_bytes]
        self._pending -= box.volume * t.dtype.itemsize
        deliver(flat.view(t.dtype).reshape(box.lengths))

    @staticmethod
    def _deliver(shard: LoadShard, array: np.ndarray) -> None:
        if shard.target is not None and shard.target.dtype == array.dtype:
            np.copyto(shard.target, array)
        else:
            shard.sink(array)
