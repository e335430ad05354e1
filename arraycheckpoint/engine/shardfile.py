"""Write stored chunk files of the default codec preset without tensorstore's array machinery.

A chunk file of an uncompressed array (:func:`arraycheckpoint.codecs.array_metadata` with ``compression=None``)
is a zarr v3 ``sharding_indexed`` shard: every inner chunk's little-endian bytes followed by their ``crc32c``,
in C order of the inner chunk grid, then the index (``(offset, nbytes)`` as little-endian uint64 per inner
chunk, C order) and the index's ``crc32c``. That is simple enough to produce here, and doing so lets a save

* write a small tensor with one file write instead of opening a tensorstore array for it (the open, not the
  bytes, dominated saves of many small tensors);
* checksum with the hardware CRC32C (:mod:`arraycheckpoint.codecs.crc`) straight from the source buffer,
  and, on a local file system, hand the source buffer to ``writev(2)`` without copying it into a write
  buffer first (tensorstore copies it and checksums in software).

Compressed arrays and partial edge chunks still go through tensorstore, except the edge chunks of packed
arrays (:mod:`arraycheckpoint.planning.packing`), padded here to the full chunk shape (:func:`padded`). Nothing is read here: loads go through
tensorstore (or zarr-python), which verify both checksums, so a file this module got wrong fails its first read.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import struct
import sys
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from ..codecs import crc
from ..errors import StorageError
from ..planning.regions import Box
from ..runtime.workers import busy
from . import direct, summed


def _hardware_crc() -> bool:
    if crc.in_hardware():
        return True
    # Measured on a 16-core machine whose interpreter lacked it: a 1 GiB save took 8x the raw write's CPU
    # time and held up to max_inflight_bytes in tensorstore's write buffers (+1.2 GiB peak RSS, not +55 MiB).
    logging.getLogger("arraycheckpoint").warning(
        "no hardware CRC32C in this interpreter (%s): whole chunks are written through tensorstore instead "
        "(more CPU, and up to max_inflight_bytes of write buffers); `python -m pip install crc32c` for the "
        "fast path",
        sys.executable,
    )
    return False


#: whether this module encodes the chunk files of whole chunks (packed arrays are always encoded here, with
#: whatever CRC32C this interpreter has: the plan decides packing identically on every rank)
HARDWARE_CRC = _hardware_crc()

Buffer = bytes | np.ndarray


def can_encode(layout: Any, chunk: Box, dtype: np.dtype[Any]) -> bool:
    """Whether :func:`encode` produces ``chunk``'s file of ``layout``: uncompressed, a whole chunk inside the
    array (no padding), little-endian data, and a hardware CRC32C available."""
    return (
        HARDWARE_CRC
        and np.little_endian
        and layout.compression is None
        and chunk.volume > 0
        and tuple(chunk.lengths) == tuple(layout.chunk_shape)
        and dtype.byteorder in ("<", "=", "|")
    )


def chunk_key(layout: Any, chunk: Box, separator: str = ".") -> str:
    """The chunk's key under its array (``default`` chunk key encoding; format 3's ``.`` separator)."""
    index = [o // c for o, c in zip(chunk.offsets, layout.chunk_shape)]
    return separator.join(["c", *map(str, index)])


#: CRC32C of a buffer (bytes or a C-contiguous array, not copied): :func:`arraycheckpoint.codecs.crc.crc32c`
crc32c = crc.crc32c


def encode(data: np.ndarray, inner_chunk_shape: tuple[int, ...], deferred: bool = False) -> list[Any]:
    """The shard file of ``data`` (one whole chunk) in inner chunks of ``inner_chunk_shape``, as the list of
    buffers to write one after the other (views of ``data`` where the inner chunks are contiguous in it).

    ``deferred``: for a writer that sums as it writes (:mod:`.summed`: ``writer.summing``), the CRC32C of
    each inner chunk of at least :data:`.summed.SLICE_BYTES` is left to it (:data:`.summed.DEFERRED`)."""
    if data.nbytes < _SMALL_BLOCK and tuple(data.shape) == tuple(inner_chunk_shape):
        # one small inner chunk (the chunk of every small tensor): the whole file in one buffer, its bytes
        # (C order), their CRC32C and a cached index
        block = data.tobytes()
        raw_index, index_crc = _one_block_index(len(block))
        return [b"".join((block, crc.crc32c(block).to_bytes(4, "little"), raw_index, index_crc))]
    grid = tuple(c // i for c, i in zip(data.shape, inner_chunk_shape))
    if all(g == 1 for g in grid):
        blocks = [_flat_bytes(data)]
    else:
        blocks = [
            _flat_bytes(data[tuple(slice(p * i, (p + 1) * i) for p, i in zip(pos, inner_chunk_shape))])
            for pos in np.ndindex(*grid)
        ]
    parts: list[Any] = []
    index = []
    offset = 0
    for block in blocks:
        if deferred and block.nbytes >= summed.SLICE_BYTES:
            parts += (block, summed.DEFERRED)
        else:
            parts += (block, crc.crc32c(block).to_bytes(4, "little"))
        index += (offset, block.nbytes + 4)
        offset += block.nbytes + 4
    raw_index = struct.pack(f"<{len(index)}Q", *index)
    parts += (raw_index, crc.crc32c(raw_index).to_bytes(4, "little"))
    return parts


#: below this many bytes, a one-chunk file is joined into one buffer (its bytes copied: cheaper than three)
_SMALL_BLOCK = 1 << 12


@functools.lru_cache(maxsize=256)
def _one_block_index(nbytes: int) -> tuple[bytes, bytes]:
    """The index of a shard file holding one inner chunk of ``nbytes`` bytes, and the index's CRC32C."""
    raw = struct.pack("<2Q", 0, nbytes + 4)
    return raw, crc32c(raw).to_bytes(4, "little")


def padded(data: np.ndarray, chunk_shape: tuple[int, ...]) -> np.ndarray:
    """``data`` (an edge chunk cut at the array's end) padded to the full ``chunk_shape`` with the fill value
    (zero, :func:`arraycheckpoint.codecs.presets.array_metadata`), as zarr writes edge chunks; ``data``
    itself when it is whole."""
    if tuple(data.shape) == tuple(chunk_shape):
        return data
    out = np.zeros(chunk_shape, dtype=data.dtype)
    out[tuple(slice(0, n) for n in data.shape)] = data
    return out


def _flat_bytes(a: np.ndarray) -> np.ndarray:
    """``a``'s bytes in C order as a 1-D uint8 array (a view when ``a`` is C-contiguous)."""
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def file_writer(storage: Any, root: str) -> KvWriter | FileWriter:
    """A writer of files under ``root`` (a fresh staging location) of ``storage``: ``writev`` on a thread
    pool for a local file system, the storage's tensorstore key-value store else."""
    import tensorstore as ts

    from ..runtime.tscontext import context
    from ..storage.local import LocalStorage

    if isinstance(storage, LocalStorage):
        cpus = os.cpu_count() or 2
        return FileWriter(root, threads=max(2, min(8, cpus)))
    return KvWriter(ts.KvStore.open(storage.kvstore_spec(root), context=context()).result())


def write_documents(storage: Any, root: str, docs: dict[str, bytes]) -> None:
    """Write small documents (``key -> bytes``) under a fresh staging ``root`` and wait for them: plain
    exclusive file creations on a local file system (tensorstore's ``file`` store writes each key through a
    temporary file and a rename), the key-value store else. Durability is the caller's flush."""
    writer = file_writer(storage, root)
    try:
        futures = [(key, writer.write(key, [doc])) for key, doc in docs.items()]
        writer.flush()
        for key, fut in futures:
            try:
                fut.result()
            except Exception as e:
                raise OSError(f"writing {key} under {root} failed: {e}") from e
    finally:
        writer.close()


class KvWriter:
    """Writes files through a tensorstore key-value store (any storage backend): one joined copy per file."""

    #: takes whole files only: no CRC32C left to it (:mod:`.summed`)
    summing = False

    def __init__(self, kvstore: Any) -> None:
        self._kv = kvstore

    def write(self, key: str, parts: list[Buffer]) -> Any:
        data = parts[0] if len(parts) == 1 and isinstance(parts[0], bytes) else b"".join(parts)
        return self._kv.write(key, data)

    def write_pack(self, key: str, members: list[tuple[str, list[Buffer]]]) -> Any:
        """Write the pack ``key`` holding ``members`` (:mod:`.packfile`) as one object."""
        from .packfile import zip_bytes

        return self._kv.write(key, zip_bytes(members))

    def open_pack(self, key: str, members: list[tuple[str, int]]) -> Any:
        """The pack ``key`` of ``members`` (``(key, bytes)`` in order): written as one object once every member
        arrived (:class:`.packstream.WholePack`)."""
        from .packstream import WholePack

        return WholePack(key, members, lambda held: self.write_pack(key, held))

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


#: Small files are grouped into one pool task per this many bytes or :data:`BATCH_FILES` files.
BATCH_BYTES = 4 << 20
BATCH_FILES = 128
#: Most threads creating small files (one per 4 cores below that).
SMALL_FILE_THREADS = 4


class FileWriter:
    """Writes files under a fresh local directory with ``writev(2)`` from the source buffers, on a thread pool.

    Small files are grouped, so that one pool task creates many (a hand-off per 16 KiB file cost more than the
    write): a batch's future is returned for each of its files, and the batch is handed to the pool when it
    is full or at :meth:`flush`. The directory is a save's private staging directory: no other writer, nothing
    to replace atomically (the commit renames the whole directory), and durability comes from the storage's
    one flush before the commit. Files are created exclusively and never through a symbolic link.
    """

    #: sums the CRC32C of large blocks as it writes them (:mod:`.summed`)
    summing = True

    def __init__(self, root: str, threads: int) -> None:
        self._root = root.rstrip("/")
        self._dirs: set[str] = set()
        os.makedirs(self._root, exist_ok=True)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="acp-write")
        #: large files go through an aligned staging buffer and ``O_DIRECT`` here (:mod:`.direct`)
        self._direct = direct.suits(self._root)
        # batches of small files go to threads of their own, one per 4 cores: on 2 cores, creating files and
        # directories under one parent from several threads contended on the parent's lock and cost 1.5x the
        # CPU time for no gain in wall time; on 16 cores, 4 threads created 2,000 arrays' files 2.3x faster
        small = max(1, min(SMALL_FILE_THREADS, (os.cpu_count() or 1) // 4))
        self._small = ThreadPoolExecutor(max_workers=small, thread_name_prefix="acp-write-small")
        # one thread starts the device write-back of written files and closes them (start_writeback can
        # block on a full device queue: the writing threads go on copying meanwhile)
        self._writeback = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acp-writeback")
        self._batch: list[tuple[str, list[Buffer]]] = []
        self._batch_bytes = 0
        self._batch_future: Future[None] = Future()
        self._packs: list[Any] = []  # packs streamed member by member (open_pack) not yet complete
        #: files handed to the write-back thread and not yet closed there (:attr:`closing`)
        self._closing = 0
        self._closing_lock = threading.Lock()
        #: the first file whose close failed on the write-back thread, and the error (raised by close())
        self._failure: tuple[str, OSError] | None = None

    def write(self, key: str, parts: list[Buffer]) -> Future[None]:
        nbytes = sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)
        if nbytes >= BATCH_BYTES:
            return self._pool.submit(self._write_files, [(key, parts)])
        self._batch.append((key, parts))
        self._batch_bytes += nbytes
        fut = self._batch_future
        if self._batch_bytes >= BATCH_BYTES or len(self._batch) >= BATCH_FILES:
            self.flush()
        return fut

    def open_pack(self, key: str, members: list[tuple[str, int]]) -> Any:
        """Create the pack file ``key`` of ``members`` (``(key, bytes)`` in pack order), written member by
        member as each is added (:class:`.packstream.StreamedPack`), on the pool."""
        from . import packstream

        self._make_parents(key)
        path = f"{self._root}/{key}"

        def submit(task: Any, nbytes: int) -> None:
            (self._pool if nbytes >= BATCH_BYTES else self._small).submit(_labelled(path, task))

        pack = packstream.StreamedPack(
            path,
            members,
            submit,
            lambda task: self._later(_labelled(path, task)),
            functools.partial(self._release, path=path),
            start_writeback,
            WRITEBACK_BYTES,
            direct.Staged.take if self._direct else None,
        )
        self._packs.append(pack)
        return pack

    def _later(self, task: Any) -> None:
        """Run ``task`` on the write-back thread, after what was handed to it before (inline once closed)."""
        try:
            self._writeback.submit(task)
        except RuntimeError:
            task()

    def flush(self) -> None:
        """Hand the pending batch of small files (and of every open pack's members) to the pool (call before
        waiting on any returned future)."""
        live = [pack for pack in self._packs if not pack.complete]  # a complete one handed its last batch on
        for pack in live:
            pack.flush()
        self._packs = live
        if not self._batch:
            return
        batch, fut = self._batch, self._batch_future
        self._batch, self._batch_bytes, self._batch_future = [], 0, Future()

        def run() -> None:
            try:
                self._write_files(batch)
            except BaseException as e:  # noqa: BLE001 - reported through the batch's future
                fut.set_exception(e)
            else:
                fut.set_result(None)

        self._small.submit(run)

    def close(self) -> None:
        """Wait for every write and every file's close.

        Raises:
            StorageError: a file's close (on the write-back thread) failed, naming the file: a file system
                may report a failed write only there (NFS: ``EIO``, ``ENOSPC``, ``EDQUOT``), so the save
                must fail and commit nothing.
        """
        self.flush()
        self._small.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        for pack in self._packs:  # packs a failed save left incomplete: closed and removed
            pack.abandon()
        self._writeback.shutdown(wait=True)  # every file closed before the caller's flush
        if self._failure is not None:
            path, e = self._failure
            failing = sys.exc_info()[1]
            why = f"writing {path} failed when the file was closed: {e}"
            if failing is not None:  # called while the save's own error propagates: keep it, with a note
                failing.add_note(why)
                return
            raise StorageError(why) from e

    def _write_files(self, files: list[tuple[str, list[Buffer]]]) -> None:
        for key, parts in files:
            path = f"{self._root}/{key}"
            with busy(path):  # a write that never returns is named at exit (runtime.workers)
                self._make_parents(key)
                _write_file(path, parts, functools.partial(self._release, path=path), self._direct)

    def _release(self, fd: int, nbytes: int, path: str) -> None:
        """Close written file ``fd`` (``path``); files of at least :data:`WRITEBACK_BYTES` start their device
        write-back first, on the write-back thread, where a failed close is recorded for :meth:`close`."""
        if not WRITEBACK or nbytes < WRITEBACK_BYTES:
            _close(fd)  # a failure is raised to the writing thread, and so to the file's future
            return

        @_labelled(path)
        def run() -> None:
            try:
                start_writeback(fd)
            finally:
                try:
                    _close(fd)
                except OSError as e:
                    if self._failure is None:
                        self._failure = (path, e)
                finally:
                    with self._closing_lock:
                        self._closing -= 1

        with self._closing_lock:
            self._closing += 1
        try:
            self._writeback.submit(run)
        except RuntimeError:  # shut down (a write after close): close it here rather than leak it
            with self._closing_lock:
                self._closing -= 1
            _close(fd)

    @property
    def closing(self) -> int:
        """Written files whose descriptor the write-back thread has yet to close."""
        return self._closing

    def settle(self) -> None:
        """Wait until the write-back thread has closed every file handed to it so far."""
        try:
            self._writeback.submit(lambda: None).result()
        except RuntimeError:  # shut down: it closed everything
            pass

    def _make_parents(self, key: str) -> None:
        # one mkdir per new directory, top down (os.makedirs probes bottom up: failed mkdirs and stats);
        # two threads may both try one: the loser's FileExistsError is fine
        parts = key.split("/")[:-1]
        for i in range(1, len(parts) + 1):
            sub = "/".join(parts[:i])
            if sub not in self._dirs:
                try:
                    os.mkdir(f"{self._root}/{sub}")
                except FileExistsError:
                    pass
                self._dirs.add(sub)


def _labelled(path: str, task: Any = None) -> Any:
    """``task`` run as writing ``path`` (:func:`~arraycheckpoint.runtime.workers.busy`: named at exit when it
    never returns); without ``task``, a decorator."""
    if task is None:
        return functools.partial(_labelled, path)

    @functools.wraps(task)
    def run() -> None:
        with busy(path):
            task()

    return run


#: ``sync_file_range(2)`` flag: start writing the range's dirty pages back, do not wait for it.
_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None
#: start each file's write-back as soon as it is written (see :func:`start_writeback`)
WRITEBACK = True
#: files below this size are only closed (their write-back is left to the flush)
WRITEBACK_BYTES = 1 << 20


def start_writeback(fd: int, offset: int = 0, nbytes: int = 0) -> None:
    """Ask the kernel to start writing ``fd``'s dirty pages (``nbytes`` from ``offset``; 0: to the end) to the
    device now, without waiting (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``; elsewhere nothing).

    Durability still comes from the storage's one flush (``syncfs``) before the commit; this only moves the
    device writes of each file under the writes of the next ones, so that flush finds little left to do
    instead of a rank's whole checkpoint (measured: the flush was half of an FSDP2 save until durable).
    """
    global _sync_file_range
    if not WRITEBACK:
        return
    if _sync_file_range is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).sync_file_range
            fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            fn.restype = ctypes.c_int
            _sync_file_range = fn
        except (OSError, AttributeError):
            _sync_file_range = False
    if _sync_file_range:
        _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE)  # advisory: a failure changes nothing


def _nbytes(part: Any) -> int:
    return int(part.nbytes) if isinstance(part, np.ndarray) else len(part)


#: ``os.close`` (a name of its own so the fault tests can make a close fail as NFS's may)
_close = os.close


def _write_file(path: str, parts: list[Any], release: Any = None, staged: bool = False) -> None:
    """Create ``path`` holding ``parts`` (CRC32C left to the writer summed as written: :mod:`.summed`);
    ``release(fd, nbytes)`` takes over closing the written file (else it is closed here). ``staged``: a large
    file is gathered in a staging buffer and written with ``O_DIRECT`` (:mod:`.direct`) where one is free."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags, 0o644)
    stage = None  # taken once the file is open: an open that fails holds no staging budget
    try:
        stage = direct.Staged.take(sum(map(_nbytes, parts)), path) if staged else None
        sink: Any = stage if stage is not None else fd
        if summed.has_deferred(parts):
            nbytes = summed.write(sink, parts, 0, path, zip_crc=False)[1]
        else:
            nbytes = summed.pwritev_all(
                sink, [_flat_bytes(p) if isinstance(p, np.ndarray) else p for p in parts], 0, path
            )
        if stage is not None:
            stage.commit(fd)
            nbytes = 0  # on the device already but for its tail: closed at once (the flush does the rest)
    except BaseException:
        os.close(fd)
        raise
    finally:
        if stage is not None:
            stage.release()
    if release is None:
        os.close(fd)
    else:
        release(fd, nbytes)
