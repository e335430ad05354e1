"""Regions of row-major tensors stored as plain bytes in a file, read as byte ranges through tensorstore.

A tensor stored C-order at ``[begin, end)`` of a file (safetensors data, an uncompressed zip entry) is read
region by region: a box becomes the contiguous runs of the flat layout it covers, runs close enough to each
other are merged into one range read (never fetching more than :data:`MAX_OVERREAD` extra of the region's
own bytes), and the ranges go to the storage's kvstore with a bound on bytes in flight. Nothing here knows a
file format: the sources hand in ``(file, begin, shape, dtype)`` per tensor.
"""

from __future__ import annotations

import math
import os
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks.files import open_regular
from ..errors import CorruptCheckpointError, StorageError
from ..planning.items import LoadShard
from ..planning.regions import Box
from ..runtime.tscontext import context
from .hubcache import locate

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
    """Reads boxes of :class:`StoredTensor` s from one storage root with a bound on bytes in flight.

    Local files are read with ``preadv`` straight into the destination (a C-contiguous target, else one
    buffer per region): no intermediate copy, and nothing is buffered beyond the region. Other storage goes
    through tensorstore's kvstore byte-range reads, ``max_inflight_bytes`` at a time.
    """

    def __init__(self, storage: Any, root: str, max_inflight_bytes: int) -> None:
        import tensorstore as ts

        spec = storage.kvstore_spec(root)
        self._local = _LocalFiles(spec["path"]) if spec.get("driver") == "file" else None
        self._kv = None if self._local else ts.KvStore.open(spec, context=context()).result()
        self.root = root
        self.max_inflight = max_inflight_bytes
        self.fetched = 0
        self.wanted = 0
        self._inflight: deque[tuple[StoredTensor, np.ndarray, int, list[tuple[_Range, Any]], LoadShard]] = (
            deque()
        )
        self._pending = 0

    def submit(self, t: StoredTensor, shard: LoadShard) -> None:
        box = shard.box
        nbytes = box.volume * t.dtype.itemsize
        direct = (
            shard.target is not None
            and shard.target.dtype == t.dtype
            and shard.target.flags.c_contiguous
            and shard.target.flags.writeable
        )
        out = shard.target if direct else np.empty(box.lengths, t.dtype)
        if nbytes == 0:
            self._deliver(shard, out, direct)
            return
        run_bytes, ranges = byte_ranges(t, box)
        self.wanted += nbytes
        self.fetched += sum(r.end - r.begin for r in ranges)
        flat = out.reshape(-1).view(np.uint8)
        if self._local is not None:
            for r in ranges:
                if len(r.pieces) == 1:  # one run: straight into place
                    pos = r.pieces[0][1]
                    self._local.read_into(t, r.begin, flat[pos : pos + run_bytes], self.root)
                else:
                    buf = np.empty(r.end - r.begin, np.uint8)
                    self._local.read_into(t, r.begin, buf, self.root)
                    for at, pos in r.pieces:
                        flat[pos : pos + run_bytes] = buf[at : at + run_bytes]
            self._deliver(shard, out, direct)
            return
        while self._inflight and self._pending + nbytes > self.max_inflight:
            self._drain_one()
        futs = [(r, self._kv.read(t.key, byte_range=slice(r.begin, r.end))) for r in ranges]
        self._inflight.append((t, out, run_bytes, futs, shard))
        self._pending += nbytes

    def finish(self) -> None:
        while self._inflight:
            self._drain_one()
        if self._local is not None:
            self._local.close()

    def _drain_one(self) -> None:
        t, out, run_bytes, futs, shard = self._inflight.popleft()
        flat = out.reshape(-1).view(np.uint8)
        for r, fut in futs:
            try:
                res = fut.result()
            except Exception as e:  # noqa: BLE001
                if isinstance(e, ValueError) and "OUT_OF_RANGE" in str(e):  # the range starts past the end
                    raise CorruptCheckpointError(
                        f"tensor {t.name!r}: {t.key} in {self.root} is shorter than its header says (bytes "
                        f"[{r.begin}, {r.end}) asked); the file is truncated"
                    ) from None
                raise StorageError(f"tensor {t.name!r}: reading {t.key} in {self.root} failed: {e}") from e
            data = res.value if res.state == "value" else b""
            if len(data) != r.end - r.begin:
                raise CorruptCheckpointError(
                    f"tensor {t.name!r}: {t.key} in {self.root} is shorter than its header says "
                    f"(bytes [{r.begin}, {r.end}) asked, {len(data)} read); the file is truncated"
                )
            src = np.frombuffer(data, np.uint8)
            for at, pos in r.pieces:
                flat[pos : pos + run_bytes] = src[at : at + run_bytes]
        self._pending -= out.nbytes
        self._deliver(shard, out, out is shard.target)

    @staticmethod
    def _deliver(shard: LoadShard, array: np.ndarray, direct: bool) -> None:
        if direct:
            return
        if shard.target is not None and shard.target.dtype == array.dtype:
            np.copyto(shard.target, array)
        else:
            shard.sink(array)


class _LocalFiles:
    """Regular files under one directory, opened once each without following symlinks."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fds: dict[str, int] = {}

    def read_into(self, t: StoredTensor, begin: int, dest: np.ndarray, root: str) -> None:
        fd = self._fds.get(t.key)
        if fd is None:
            # no link (but a hub cache snapshot's link to its blob), no FIFO
            opened = open_regular(*locate(self.path, t.key), what=f"tensor {t.name!r}: ")
            if opened is None:
                raise CorruptCheckpointError(f"tensor {t.name!r}: {t.key} in {root} is missing")
            fd = self._fds[t.key] = opened[0]
        view = memoryview(dest)
        done = 0
        while done < len(view):
            n = os.preadv(fd, [view[done:]], begin + done)
            if n <= 0:
                raise CorruptCheckpointError(
                    f"tensor {t.name!r}: {t.key} in {root} is shorter than its header says (bytes "
                    f"[{begin}, {begin + len(view)}) asked, {done} read); the file is truncated"
                )
            done += n

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()
