"""Read uncompressed chunk files straight into their destination: one copy per byte.

The mirror of :func:`arraycheckpoint.engine.shardfile.encode`: a chunk file is a zarr v3 ``sharding_indexed``
shard, every inner chunk's little-endian bytes followed by their ``crc32c``, then the index (``(offset,
nbytes)`` as little-endian uint64 per inner chunk) and the index's ``crc32c``. Tensorstore reads such a file
into its own buffers, checksums it in software and copies the bytes into the destination; here
(:func:`read_shard`) each inner chunk a destination holds whole and contiguously is read by ``preadv`` into the
destination itself, the others into one staging buffer (then the part wanted is copied out), and both
checksums are verified with the hardware CRC32C. A chunk file read whole, in exactly the layout a save writes,
is read in order (its inner chunks, their checksums and the index scattered where they belong); a part of one
reads the index first, then each run of consecutive inner chunks it needs. Either way the reads are ``preadv``
calls of about :data:`_BLOCK` bytes, each block checksummed right after it lands, while it is still in the
core's cache: the copy and the checksum are one pass over memory, not two.

:func:`read_shard` reads a chunk file wherever it lies: a file of its own (:class:`ChunkReader`, arrays in
their own directories), a member of a pack (:mod:`.packread`, at the member's offset in the pack), or bytes
already in memory (a member fetched with one ranged read from an object store: no further staging).

Only the layout a save writes is read here (every inner chunk the region needs present at its exact size
inside the file; tensorstore leaves out an edge chunk's inner chunks beyond the array); anything else returns
None and the caller reads that region through tensorstore, which reads every valid zarr shard (or, for a
format-6 pack member, reports the damage). The files were checked first
(:func:`arraycheckpoint.audit.scan.check_chunk_files`: regular files, no link on the path, sizes bounded); a file
is opened without following a link all the same. A checksum that does not match raises
:class:`CorruptCheckpointError` naming the tensor and the file.
"""

from __future__ import annotations

import math
import os
import struct
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..checks.files import open_regular
from ..codecs import CODEC_PRESET, numpy_dtype
from ..codecs.crc import extend as crc_extend
from ..errors import CorruptCheckpointError
from ..planning.regions import Box, intersect
from . import shardfile

#: buffers of one ``preadv`` (Linux's IOV_MAX)
_MAX_IOV = 1024
#: staged bytes of one read (each reader thread's staging buffer holds at most this, or one inner chunk)
_MAX_STAGING = 8 << 20
#: bytes read and checksummed at a time (:class:`_Reads`): small enough to stay in a core's cache between
#: the copy into the destination and the checksum (the best of 64 KiB-4 MiB, ``benchmarks/bench_crc.py``)
_BLOCK = 256 << 10

#: where a chunk file's bytes are: an open file descriptor, or the bytes themselves (uint8) in memory
Source = int | np.ndarray
#: ``(region, destination array of that region)``: the destination has the region's shape, the stored dtype
Dest = tuple[Box, np.ndarray]
#: the bytes just before a chunk file read along with it (a pack member's local header): ``(length,
#: check)``, ``check(bytes)`` -> how far past the expected start the file really starts (0), or None: refused
Lead = tuple[int, Callable[[bytes], int | None]]


def available() -> bool:
    """Whether this interpreter has the hardware CRC32C on a little-endian host (else tensorstore reads)."""
    return shardfile.HARDWARE_CRC and np.little_endian


class ShardLayout:
    """The decoding constants of one uncompressed array's chunk files (edge chunks padded to the full chunk)."""

    def __init__(self, tm: Any) -> None:
        self.dtype = numpy_dtype(tm.dtype)  # native order, little-endian
        self.chunk = tuple(max(int(c), 1) for c in tm.chunk_shape)
        self.inner = tuple(max(int(i), 1) for i in tm.inner_chunk_shape)
        self.grid = tuple(c // i for c, i in zip(self.chunk, self.inner))
        self.n_inner = math.prod(self.grid)
        self.inner_bytes = math.prod(self.inner) * self.dtype.itemsize
        self.table_len = 16 * self.n_inner + 4
        #: bytes of a chunk file in exactly the layout a save writes
        self.nbytes = self.n_inner * (self.inner_bytes + 4) + self.table_len
        self._starts: list[tuple[int, ...]] | None = None
        self._table: bytes | None = None

    def starts(self) -> list[tuple[int, ...]]:
        """Each inner chunk's offset inside its chunk, in C order (the order of the index)."""
        if self._starts is None:
            self._starts = [tuple(p * i for p, i in zip(pos, self.inner)) for pos in np.ndindex(*self.grid)]
        return self._starts

    def exact_table(self) -> bytes:
        """The index and its crc32c of a chunk file in exactly the layout a save writes."""
        if self._table is None:
            step = self.inner_bytes + 4
            index = struct.pack(
                f"<{2 * self.n_inner}Q", *(v for k in range(self.n_inner) for v in (k * step, step))
            )
            self._table = index + shardfile.crc32c(index).to_bytes(4, "little")
        return self._table


def layout_of(tm: Any, cache: dict[tuple[Any, ...], ShardLayout]) -> ShardLayout:
    """The :class:`ShardLayout` of array ``tm``, shared through ``cache`` by the arrays of one layout."""
    key = (tm.dtype, tuple(tm.chunk_shape), tuple(tm.inner_chunk_shape))
    lay = cache.get(key)
    if lay is None:
        lay = cache[key] = ShardLayout(tm)
    return lay


class Staging:
    """One reusable staging buffer (grown on demand) for the inner chunks no destination takes whole."""

    def __init__(self) -> None:
        self._buf = np.empty(0, np.uint8)

    def get(self, nbytes: int) -> np.ndarray:
        if self._buf.nbytes < nbytes:
            self._buf = np.empty(max(nbytes, 2 * self._buf.nbytes), np.uint8)
        return self._buf[:nbytes]


def read_shard(
    src: Source,
    at: int,
    size: int,
    lay: ShardLayout,
    origin: tuple[int, ...],
    dests: Sequence[Dest],
    staging: Staging,
    damaged: Callable[[str], Exception],
    lead: Lead | None = None,
) -> tuple[int, int] | None:
    """Read the chunk file of ``size`` bytes at ``at`` in ``src`` (the chunk at ``origin``) into every
    destination its inner chunks meet (inner chunks that meet none are neither read nor checked).

    ``lead`` reads the bytes right before the file along with it and checks them first (a pack member's local
    header). Returns ``(bytes read straight into destinations, bytes staged then copied)``, or None when the
    file is not in the layout a save writes (or ``lead`` refuses its bytes); ``damaged(why)`` is raised on a
    checksum that does not match (the destinations may then hold some of the file's bytes).
    """
    wanted = _within_one(lay, origin, dests)
    staged = 0
    for k, start in enumerate(lay.starts() if not wanted else ()):
        block = Box(tuple(o + s for o, s in zip(origin, start)), lay.inner)
        hits = []
        for box, out in dests:
            part = intersect(block, box)
            if part is not None:
                hits.append((part, box, out))
        if hits:
            landing = _landing(block, hits)
            staged += landing is None
            wanted.append((k, block, hits, landing))
    if not wanted:
        return 0, 0
    if (
        size == lay.nbytes
        and len(wanted) == lay.n_inner
        and 2 * lay.n_inner + 2 <= _MAX_IOV
        and (staged * lay.inner_bytes <= _MAX_STAGING or not isinstance(src, int))
    ):
        # the whole file in one read (lead, inner chunks and their crc32c, index), checked once it is in
        head = bytearray(lead[0] if lead is not None else 0)
        table = bytearray(lay.table_len)
        reads = _Reads(src, at, wanted, lay, staging)
        if not reads.read(head, table):
            return None
        if lead is not None:
            shift = lead[1](bytes(head))
            if shift is None:
                return None
            if shift:  # the file starts further on (a local header with an extra field): read it from there
                return read_shard(src, at + shift, size, lay, origin, dests, staging, damaged)
        if table == lay.exact_table():
            return reads.finish(damaged)
        # a sound index of another order (or a damaged one): read by the index, as a part is
        return _read_by_index(src, at, size, lay, wanted, staging, damaged, bytes(table))
    if lead is not None:
        shift = lead[1](bytes(_pread(src, lead[0], at - lead[0])))
        if shift is None:
            return None
        at += shift
    return _read_by_index(src, at, size, lay, wanted, staging, damaged)


def _read_by_index(
    src: Source,
    at: int,
    size: int,
    lay: ShardLayout,
    wanted: list[_Item],
    staging: Staging,
    damaged: Callable[[str], Exception],
    table: bytes | None = None,
) -> tuple[int, int] | None:
    """:func:`read_shard` of a part of a file, or of a file in another layout: its index first (``table``,
    when already read), then each run of consecutive inner chunks wanted with one read."""
    if not lay.table_len <= size <= lay.nbytes:
        return None
    table_at = size - lay.table_len
    raw = table if table is not None else bytes(_pread(src, lay.table_len, at + table_at))
    if len(raw) != lay.table_len:
        return None
    if raw != lay.exact_table() and shardfile.crc32c(raw[:-4]) != int.from_bytes(raw[-4:], "little"):
        raise damaged("the shard index's crc32c does not match")
    entries = struct.unpack(f"<{2 * lay.n_inner}Q", raw[:-4])
    step = lay.inner_bytes + 4
    runs: list[tuple[int, list[_Item]]] = []
    end = -1
    room = 0  # staged bytes the current run may still take
    for item in wanted:
        offset, nbytes = entries[2 * item[0]], entries[2 * item[0] + 1]
        if nbytes != step or offset + nbytes > table_at:
            return None
        need = lay.inner_bytes if item[3] is None and isinstance(src, int) else 0
        if offset == end and len(runs[-1][1]) < _MAX_IOV // 2 and need <= room:
            runs[-1][1].append(item)
            room -= need
        else:
            runs.append((offset, [item]))
            room = _MAX_STAGING - need
        end = offset + nbytes
    direct = staged = 0
    for offset, items in runs:
        reads = _Reads(src, at + offset, items, lay, staging)
        if not reads.read():
            return None
        d, s = reads.finish(damaged)
        direct, staged = direct + d, staged + s
    return direct, staged


#: an inner chunk to read: its index in the chunk file, its box, ``(part, region, destination)`` of every
#: destination region it meets, and where it is read straight into (None: the staging buffer); an inner
#: chunk of :func:`_within_one` has neither box nor hits (it lands whole in its one destination, nothing to
#: copy afterwards)
_Item = tuple[int, "Box | None", list[tuple[Box, Box, np.ndarray]], "np.ndarray | None"]


def _within_one(lay: ShardLayout, origin: tuple[int, ...], dests: Sequence[Dest]) -> list[_Item]:
    """The inner chunks of the chunk at ``origin`` when it lies wholly inside one destination's region and
    every inner chunk is a contiguous part of that destination (a shard holding whole chunks: FSDP2, DDP, a
    plain model), each read straight into it; else ``[]`` (then :func:`read_shard` intersects every inner
    chunk with every region). The same landings as the general path, without a box per inner chunk."""
    if len(dests) != 1:
        return []
    box, out = dests[0]
    rel = [o - b for o, b in zip(origin, box.offsets)]
    if len(rel) != len(lay.chunk) or any(r < 0 or r + c > n for r, c, n in zip(rel, lay.chunk, box.lengths)):
        return []
    inner = lay.inner
    items: list[_Item] = []
    for k, start in enumerate(lay.starts()):
        dest = out[(*(slice(r + s, r + s + i) for r, s, i in zip(rel, start, inner)), ...)]
        if not dest.flags.c_contiguous:
            return []
        items.append((k, None, [], dest.reshape(-1).view(np.uint8)))
    return items


def _landing(block: Box, hits: list[tuple[Box, Box, np.ndarray]]) -> np.ndarray | None:
    """The bytes (uint8) of a destination that holds the inner chunk ``block`` whole and contiguously, moved
    first among ``hits``; None when none does."""
    for h, (part, box, out) in enumerate(hits):
        if part == block:
            dest = out[(*part.slices(box), ...)]  # a view, also of a 0-d array
            if dest.flags.c_contiguous:
                hits.insert(0, hits.pop(h))
                return dest.reshape(-1).view(np.uint8)
    return None


class _Reads:
    """Consecutive inner chunks of a chunk file, read in one go from ``at``: each one's data lands where
    :func:`_landing` found a destination taking it whole and contiguously, else in the staging buffer (or,
    for bytes in memory, stays where it is), then is copied to every other destination it meets.

    Every byte is checksummed right after it lands, in blocks of at most :data:`_BLOCK` bytes read by one
    ``preadv`` each (or copied from memory), while the block is still in the core's cache: reading a whole
    file first and checksumming it afterwards read every byte from memory twice (measured 1.3x slower,
    ``benchmarks/bench_crc.py``). The checksums are compared in :meth:`finish`, once the caller has checked
    what was read along (a pack member's local header, the index)."""

    def __init__(self, src: Source, at: int, items: list[_Item], lay: ShardLayout, staging: Staging) -> None:
        self.src, self.at, self.items, self.lay = src, at, items, lay
        ib = lay.inner_bytes
        self.direct: list[np.ndarray | None] = [item[3] for item in items]
        #: each inner chunk's computed crc32c (filled by :meth:`read`)
        self.sums = [0] * len(items)
        step = ib + 4
        if isinstance(src, int):
            n = sum(d is None for d in self.direct)
            buf = staging.get(n * ib) if n else None
            self.crc: Any = memoryview(bytearray(4 * len(items)))
            self.data: list[Any] = []
            j = 0
            for d in self.direct:
                if d is None:
                    d, j = buf[j * ib : (j + 1) * ib], j + 1  # type: ignore[index]
                self.data.append(d)
        else:  # in memory already: staged data and checksums are views of it
            view = src[at : at + len(items) * step]
            self.crc = view.reshape(-1, step)[:, ib:].reshape(-1) if len(view) == len(items) * step else None
            self.data = [
                d if d is not None else view[j * step : j * step + ib] for j, d in enumerate(self.direct)
            ]

    def read(self, head: bytearray | None = None, tail: bytearray | None = None) -> bool:
        """Read the inner chunks (and ``head`` just before them, ``tail`` just after), checksum each block as
        it lands and copy each inner chunk into the destinations not yet holding it; False: cut short."""
        if isinstance(self.src, int):
            return self._read_file(self.src, head or bytearray(), tail or bytearray())
        ib, step = self.lay.inner_bytes, self.lay.inner_bytes + 4
        before = len(head) if head is not None else 0
        after = len(tail) if tail is not None else 0
        mem = self.src
        want = before + len(self.items) * step + after
        if self.at - before < 0 or self.at - before + want > len(mem) or self.crc is None:
            return False
        if before:
            head[:] = mem[self.at - before : self.at].tobytes()  # type: ignore[index]
        if after:
            end = self.at + len(self.items) * step
            tail[:] = mem[end : end + after].tobytes()  # type: ignore[index]
        for j, d in enumerate(self.data):
            at, landed, crc = self.at + j * step, self.direct[j] is not None, 0
            for s in range(0, ib, _BLOCK):
                block = d[s : s + _BLOCK]
                if landed:
                    block[...] = mem[at + s : at + s + len(block)]
                crc = crc_extend(crc, block)
            self.sums[j] = crc
            self._spread(j)
        return True

    def _read_file(self, fd: int, head: bytearray, tail: bytearray) -> bool:
        """:meth:`read` from a file: ``preadv`` calls of about :data:`_BLOCK` bytes each (a block of a large
        inner chunk, or several small inner chunks with their checksums). The blocks are memoryviews (a
        slice costs less than an array's), summed into :attr:`sums` right after the call that fills them."""
        ib, last, step = self.lay.inner_bytes, len(self.items) - 1, _BLOCK
        room = _MAX_IOV - 3
        at = self.at - len(head)
        bufs: list[Any] = [head] if head else []
        want = len(head)
        blocks: list[tuple[int, memoryview]] = []  # (inner chunk, block) the pending call reads
        ended: list[int] = []  # inner chunks whose last block (and checksum) it reads
        sums, crc, spread = self.sums, self.crc, self._spread
        for j, d in enumerate(self.data):
            view = memoryview(d).cast("B")
            for s in range(0, ib, step):
                block = view[s : s + step]
                bufs.append(block)
                blocks.append((j, block))
                want += len(block)
                if s + step < ib:
                    if want < step and len(bufs) < room:
                        continue
                else:
                    bufs.append(crc[4 * j : 4 * j + 4])
                    want += 4
                    ended.append(j)
                    if j == last:
                        if tail:
                            bufs.append(tail)
                            want += len(tail)
                    elif want < step and len(bufs) < room:
                        continue
                if os.preadv(fd, bufs, at) != want:
                    return False
                for k, b in blocks:
                    sums[k] = crc_extend(sums[k], b)
                for k in ended:
                    spread(k)
                at += want
                bufs, blocks, ended, want = [], [], [], 0
        return True

    def _spread(self, j: int) -> None:
        """Copy inner chunk ``j`` (just read) into every destination it meets that does not hold it yet."""
        hits, landed = self.items[j][2], self.direct[j] is not None
        if landed and len(hits) <= 1:  # (none: an inner chunk of _within_one)
            return
        block = self.items[j][1]
        assert block is not None
        block_data = self.data[j].view(self.lay.dtype).reshape(self.lay.inner)
        for part, box, out in hits[1:] if landed else hits:
            out[(*part.slices(box), ...)] = block_data[part.slices(block)]

    def finish(self, damaged: Callable[[str], Exception]) -> tuple[int, int]:
        """Compare every inner chunk's crc32c with the one stored after it; returns ``(bytes read straight
        into a destination, bytes copied from the staging buffer)``."""
        lay = self.lay
        crc = bytes(self.crc)
        for j, (k, *_rest) in enumerate(self.items):
            if self.sums[j] != int.from_bytes(crc[4 * j : 4 * j + 4], "little"):
                pos = [int(p) for p in np.unravel_index(k, lay.grid)] if lay.grid else []
                raise damaged(f"inner chunk {pos}'s crc32c does not match")
        staged = sum(d is None for d in self.direct) * lay.inner_bytes
        return len(self.items) * lay.inner_bytes - staged, staged


def _pread(src: Source, nbytes: int, offset: int) -> bytes | np.ndarray:
    if isinstance(src, int):
        return os.pread(src, nbytes, offset)
    return src[max(offset, 0) : max(offset + nbytes, 0)] if offset >= 0 else src[:0]


class ChunkReader:
    """Reads regions of a local checkpoint's unpacked, uncompressed arrays on a small thread pool."""

    def __init__(self, root: str, meta: Any, threads: int) -> None:
        from ..format.metadata import chunk_key_separator

        self._root = root.rstrip("/")
        self._meta = meta
        self._sep = chunk_key_separator(meta.format_version)
        self._preset = getattr(meta, "codec_preset", None) == CODEC_PRESET
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="acp-read")
        self._lock = threading.Lock()
        self._local = threading.local()  # each reader thread's staging buffer
        self._layouts: dict[tuple[Any, ...], ShardLayout] = {}
        #: bytes read straight into destinations, and through a staging buffer (then copied once more)
        self.direct_bytes = 0
        self.scratch_bytes = 0

    def handles(self, name: str) -> bool:
        """Whether the array ``name`` is read here (its own directory, uncompressed, this codec preset)."""
        tm = self._meta.tensors[name]
        return self._preset and tm.pack is None and tm.compression is None

    def submit(self, name: str, box: Box, out: np.ndarray) -> list[Future[bool]]:
        """Start reading region ``box`` of array ``name`` into ``out`` (its shape, the stored dtype, any
        strides); one future per chunk file, True once its part is in ``out``, False when the file is not in
        the layout a save writes (read that region through tensorstore then)."""
        tm = self._meta.tensors[name]
        if box.volume == 0:
            return []
        lay = layout_of(tm, self._layouts)
        chunk = tuple(tm.chunk_shape)
        first = [o // c for o, c in zip(box.offsets, chunk)]
        last = [(o + n - 1) // c for o, n, c in zip(box.offsets, box.lengths, chunk)]
        futures = []
        for rel in np.ndindex(*(b - a + 1 for a, b in zip(first, last))):
            index = tuple(a + i for a, i in zip(first, rel))
            futures.append(self._pool.submit(self._read_chunk, tm, index, box, out, lay))
        return futures

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _read_chunk(
        self, tm: Any, index: tuple[int, ...], box: Box, out: np.ndarray, lay: ShardLayout | None = None
    ) -> bool:
        lay = lay or ShardLayout(tm)
        key = self._sep.join(["c", *map(str, index)])
        path = f"{self._root}/{tm.name}/{key}"
        # opened below the root one component at a time, never through a link, non-blocking, and refused
        # unless a regular file: the file checks ran before, but the file may have been swapped since (a
        # FIFO opened blocking hung the reader; a link handed to tensorstore was followed)
        opened = open_regular(self._root, f"{tm.name}/{key}", what=f"tensor {tm.name!r}: ")
        if opened is None:
            return False  # tensorstore reports a missing file in its own words
        fd, size = opened
        try:
            staging = getattr(self._local, "staging", None)
            if staging is None:
                staging = self._local.staging = Staging()
            origin = tuple(i * c for i, c in zip(index, lay.chunk))
            got = read_shard(
                fd, 0, size, lay, origin, [(box, out)], staging, lambda why: _corrupt(tm, path, why)
            )
            if got is None:
                return False
            with self._lock:
                self.direct_bytes += got[0]
                self.scratch_bytes += got[1]
            return True
        finally:
            os.close(fd)


def _corrupt(tm: Any, path: str, why: str) -> CorruptCheckpointError:
    return CorruptCheckpointError(
        f"tensor {tm.name!r}: {path} is damaged: {why} (DATA_LOSS: digest mismatch)"
    )
