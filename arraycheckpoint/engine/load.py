"""The load pipeline: open a committed checkpoint's metadata, then read exactly the requested regions.

Reads run concurrently through tensorstore, straight into destination memory where the target allows it,
with a bound on bytes in flight. Optional load-time read sharing reads a region several ranks want once.
This module does not know any framework (adapters translate) and never writes a checkpoint.
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from ..audit import arrays as audit_arrays
from ..audit import scan
from ..checks import limits
from ..codecs import numpy_dtype
from ..errors import CheckpointNotFoundError, MetadataError, StorageError
from ..format.metadata import CheckpointMetadata, check_name
from ..planning.items import LoadShard, LoadTensor
from ..planning.regions import Box
from ..runtime.collectives import Communicator
from ..runtime.monitoring import PhaseRecorder
from ..runtime.tscontext import context
from ..storage import Storage, storage_for
from ..storage.base import reading
from ..storage.local import LocalStorage
from . import chunkread, packread
from .common import DEFAULT_INFLIGHT_BYTES, array_kvstore_spec, read_result, write_sidecar


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """No cyclic garbage collection inside (re-enabled after, if it was enabled); a decorator too.

    A load allocates a few objects per tensor that all stay alive until it ends (the parsed metadata, the
    read plan, the regions), so the collector's passes over them, which the allocations trigger, find
    nothing to free: measured 20-25% of the CPU time of a load of 20,000 small tensors. What a load drops
    is freed by reference counting; a cycle it leaves waits for the next collection."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class LoadPipeline:
    """Reads checkpoints. ``wait_idle`` lets collectives wait until the save pipeline frees the group."""

    def __init__(self, wait_idle: Callable[[], None]) -> None:
        self._wait_idle = wait_idle

    @gc_paused()
    def read_metadata(
        self, url: str, *, allow_pickle: bool = False, timeout: float | None = None
    ) -> tuple[Storage, str, CheckpointMetadata]:
        """Open a committed checkpoint's metadata; raises if it is absent or uncommitted.

        A path holding a foreign checkpoint (Hugging Face safetensors, DCP) returns its load source in place
        of the storage (:mod:`arraycheckpoint.sources`); :meth:`_read` then delegates to it. ``timeout``: the
        load's liveness bound, also the longest one storage request may go unanswered (a store that stops
        answering fails the load within it; default the liveness default).
        """
        storage, root = storage_for(url)
        storage.stall_timeout = timeout
        files = storage.committed_layout(root)  # format 3's .acp/, or an older checkpoint's root
        if files is None:
            from ..sources import open_source  # hook: foreign formats

            source = open_source(storage, root, allow_pickle=allow_pickle)
            if source is not None:
                return source, root, source.metadata  # type: ignore[return-value]
            what = (
                "has no commit marker (a save did not finish)"
                if storage.exists(root, storage.control_files(root).metadata)
                else "does not exist"
            )
            raise CheckpointNotFoundError(f"no committed checkpoint at {root}: it {what}")
        try:
            raw = storage.read(root, files.metadata)
            if raw is None:
                raise MetadataError(f"checkpoint {root} is committed but has no {files.metadata}")
            meta = CheckpointMetadata.from_json(raw, what=f"{root}/{files.metadata}")
            limits.check_layouts(meta)  # untrusted input: before anything is sized from it
        except Exception as e:
            gone = _gone(storage, root, e, "opened")
            if gone is None:
                raise
            raise gone from e
        return storage, root, meta

    @gc_paused()
    def load(
        self,
        storage: Storage,
        root: str,
        meta: CheckpointMetadata,
        targets: list[LoadTensor],
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        comm: Communicator | None = None,
        dedup_reads: bool = False,
        all_or_nothing: bool = False,
    ) -> PhaseRecorder:
        """Read every target region concurrently and hand it to its sink (in the calling thread).

        With ``dedup_reads`` (and more than one rank in ``comm``), a region several ranks want is read by one
        of them and shared through the communicator in one batched all-to-all (collective: every rank calls).
        With ``all_or_nothing``, every region is read into new arrays first and copied into the targets only
        once all reads succeeded (peak memory: the loaded bytes once more). The checkpoint is registered as
        being read (retention of a manager in this process skips it); one removed from under the read
        raises :class:`CheckpointNotFoundError`.
        """
        recorder = PhaseRecorder()
        deferred: list[tuple[LoadShard, np.ndarray]] = []
        if all_or_nothing:
            targets = [
                LoadTensor(
                    t.name, [LoadShard(s.box, lambda a, s=s: deferred.append((s, a))) for s in t.shards]
                )
                for t in targets
            ]
        with reading(storage, root):
            try:
                if dedup_reads and comm is not None and comm.world_size > 1:
                    self._wait_idle()  # the checkpoint group must be idle before load collectives
                    with recorder.phase("read-shared") as rec:
                        targets, rec["bytes"] = self._shared_reads(
                            storage, root, meta, targets, comm, max_inflight_bytes, recorder
                        )
                self._read(storage, root, meta, targets, max_inflight_bytes, recorder)
            except Exception as e:
                gone = _gone(storage, root, e, "read")
                if gone is None:
                    raise
                raise gone from e
        for shard, array in deferred:  # every read succeeded: now the targets change
            if shard.target is not None and shard.target.dtype == array.dtype:
                np.copyto(shard.target, array)
            else:
                shard.sink(array)
        return recorder

    def _shared_reads(
        self,
        storage: Storage,
        root: str,
        meta: CheckpointMetadata,
        targets: list[LoadTensor],
        comm: Communicator,
        max_inflight_bytes: int,
        recorder: PhaseRecorder,
    ) -> tuple[list[LoadTensor], int]:
        """Read regions wanted by several ranks once, ship them; return the targets left to read locally."""
        from ..planning.plan import assign_shared_reads

        mine = sorted({(t.name, s.box) for t in targets for s in t.shards})
        # replicas want the same regions: each distinct list travels once, and is parsed once
        wanted = comm.all_gather_distinct_json([[n, list(b.offsets), list(b.lengths)] for n, b in mine])
        parsed: dict[int, list[tuple[str, Box]]] = {}  # each distinct list (one object) parsed once
        for w in wanted:
            if id(w) not in parsed:
                parsed[id(w)] = [(n, Box(tuple(o), tuple(ln))) for n, o, ln in w]
        requests = [parsed[id(w)] for w in wanted]
        itemsize = {
            n: numpy_dtype(meta.tensors[n].dtype).itemsize
            for w in requests
            for n, _ in w
            if n in meta.tensors
        }
        readers = assign_shared_reads(requests, itemsize)  # (name, box) -> reader, only for shared regions
        me = comm.rank
        sets: dict[int, set[tuple[str, Box]]] = {}
        for w in requests:
            if id(w) not in sets:
                sets[id(w)] = set(w)
        asked = [sets[id(w)] for w in requests]
        got: dict[tuple[str, Box], np.ndarray] = {}
        reads = [
            LoadTensor(n, [LoadShard(b, lambda a, k=(n, b): got.__setitem__(k, a))])
            for (n, b), r in sorted(readers.items())
            if r == me
        ]
        self._read(storage, root, meta, reads, max_inflight_bytes, recorder)
        send = [[] for _ in range(comm.world_size)]
        recv_sizes = [0] * comm.world_size
        for key, reader in sorted(readers.items()):
            n, b = key
            nbytes = b.volume * itemsize[n]
            for r in range(comm.world_size):
                if r != reader and key in asked[r]:
                    if reader == me:
                        send[r].append(np.ascontiguousarray(got[key]).view(np.uint8).ravel())
                    if r == me:
                        recv_sizes[reader] += nbytes
        flat = [np.concatenate(x) if x else np.empty(0, np.uint8) for x in send]
        received = comm.all_to_all_bytes(flat, recv_sizes)
        cursor = [0] * comm.world_size
        for key, reader in sorted(readers.items()):
            if reader != me and key in asked[me]:
                n, b = key
                dtype = numpy_dtype(meta.tensors[n].dtype)
                size = b.volume * dtype.itemsize
                got[key] = (
                    received[reader][cursor[reader] : cursor[reader] + size].view(dtype).reshape(b.lengths)
                )
                cursor[reader] += size
        rest = []
        for t in targets:
            local = []
            for shard in t.shards:
                key = (t.name, shard.box)
                if key in got:
                    shard.sink(got[key])
                else:
                    local.append(shard)
            rest.append(LoadTensor(t.name, local))
        return rest, sum(a.nbytes for a in got.values())

    def _read(
        self,
        storage: Storage,
        root: str,
        meta: CheckpointMetadata,
        targets: list[LoadTensor],
        max_inflight_bytes: int,
        recorder: PhaseRecorder,
    ) -> None:
        import tensorstore as ts

        from ..sources import LoadSource

        if isinstance(storage, LoadSource):  # hook: a foreign format reads its own byte ranges
            storage.read(targets, max_inflight_bytes, recorder)
            return
        with recorder.phase("read") as rec:
            opening = {}
            wanted: dict[str, list[Box]] = {}  # the regions read of each array (its zstd chunks are checked)
            for t in targets:
                wanted.setdefault(t.name, []).extend(s.box for s in t.shards)
            for t in targets:
                if t.name not in meta.tensors:  # the metadata's own names were checked once, when parsed
                    check_name(t.name)
            # checked zarr.json (or the preset's metadata), crc32c required; no zstd bomb (links and FIFOs:
            # refused by check_chunk_files above)
            # the stored files of what this rank reads, and only those (see check_chunk_files)
            directories: dict[str, list[Any]] = {}  # the packs' ZIP directories, parsed once by the checks
            # format-6 members: their local headers are checked by packread on the bytes it reads with them
            deferred: dict[str, dict[str, int]] = {}
            scan.check_chunk_files(
                storage, root, meta, [t.name for t in targets if t.shards], directories, wanted, deferred
            )
            # format-6 packed arrays: decoded by packread (whose zarr.json it checks), never by tensorstore
            by_rank = {t.name for t in targets if t.shards and meta.tensors[t.name].pack_rank is not None}
            docs = audit_arrays.check_arrays(
                storage,
                root,
                meta,
                {t.name: wanted[t.name] for t in targets if t.shards and t.name not in by_rank},
            )
            # packed chunks are decoded here (chunkread.read_shard: one preadv or ranged read per member,
            # crc32c, inner chunks straight into the destinations), format 5's on a local file system with
            # hardware crc32c only; the rest (and any format-5 member not in the layout a save writes) through
            # tensorstore
            packed = (
                packread.PackedReader(root, meta, storage, directories, deferred)
                if by_rank or (isinstance(storage, LocalStorage) and packread.fast_path_available())
                else None
            )

            def spec_of(name: str) -> dict[str, Any]:
                return {
                    "driver": "zarr3",
                    "kvstore": array_kvstore_spec(storage, root, meta.tensors[name]),
                    "fill_missing_data_reads": False,  # a missing chunk file is damage, not zeros
                    "metadata": docs[name],
                }

            # unpacked uncompressed arrays on a local file system: read here, once, into the destination
            direct = (
                chunkread.ChunkReader(root, meta, threads=_read_threads())
                if isinstance(storage, LocalStorage) and chunkread.available()
                else None
            )
            for name in docs:
                if direct is not None and direct.handles(name):
                    continue  # opened only if a file is not in the layout a save writes
                if packed is None or meta.tensors[name].pack is None:
                    opening[name] = ts.open(spec_of(name), open=True, assume_metadata=True, context=context())
            stores = {}
            for name, fut in opening.items():
                try:
                    stores[name] = fut.result()
                except Exception as e:  # noqa: BLE001
                    raise StorageError(f"tensor {name!r}: opening its array in {root} failed: {e}") from e
            inflight: deque[tuple[Any, Any, str, Box, int]] = deque()
            pending = total = 0

            def drain_one() -> int:
                fut, sink, name, box, n = inflight.popleft()
                result = read_result(fut, name, box, root)
                if sink is not None:
                    sink(result)
                return n

            # packed tensors are read together, in pack order (:meth:`packread.PackedReader.deliver_many`),
            # after the other reads started: a batch holds at most the in-flight bound of buffers it allocates
            batch: list[LoadTensor] = []
            batch_bytes = 0

            def read_batch() -> None:
                nonlocal pending, total, batch_bytes
                while inflight and pending + batch_bytes > max_inflight_bytes:
                    pending -= drain_one()
                assert packed is not None
                delivered, left = packed.deliver_many(batch)
                total += delivered
                for t in left:  # format 5: a member not in the layout a save writes
                    stores[t.name] = ts.open(
                        spec_of(t.name), open=True, assume_metadata=True, context=context()
                    ).result()
                    stored = numpy_dtype(meta.tensors[t.name].dtype)
                    pending, total = self._read_tensor(
                        t, stored, stores[t.name], inflight, pending, total, max_inflight_bytes, drain_one
                    )
                batch.clear()
                batch_bytes = 0

            try:
                for t in targets:
                    if not t.shards:
                        continue
                    stored = numpy_dtype(meta.tensors[t.name].dtype)
                    if direct is not None and direct.handles(t.name):

                        def store_of(name: str = t.name) -> Any:
                            if name not in stores:
                                stores[name] = ts.open(
                                    spec_of(name), open=True, assume_metadata=True, context=context()
                                ).result()
                            return stores[name]

                        pending, total = _read_direct(
                            direct,
                            t,
                            stored,
                            store_of,
                            inflight,
                            pending,
                            total,
                            max_inflight_bytes,
                            drain_one,
                        )
                        continue
                    if t.name not in stores:  # packed: decoded here, with the other packed tensors
                        n = _allocated(t, stored)
                        if batch and batch_bytes + n > max_inflight_bytes:
                            read_batch()
                        batch.append(t)
                        batch_bytes += n
                        continue
                    pending, total = self._read_tensor(
                        t, stored, stores[t.name], inflight, pending, total, max_inflight_bytes, drain_one
                    )
                if batch:
                    read_batch()
                while inflight:
                    drain_one()
            finally:
                if packed is not None:
                    packed.close()
                if direct is not None:
                    direct.close()
            rec["bytes"] = total
            readers = [r for r in (direct, packed) if r is not None]
            if readers:  # chunk bytes read into their destination, and through a staging buffer
                rec["direct"] = sum(r.direct_bytes for r in readers)
                rec["scratch"] = sum(r.scratch_bytes for r in readers)

    @staticmethod
    def _read_tensor(
        t: LoadTensor,
        stored: Any,
        store: Any,
        inflight: deque[tuple[Any, Any, str, Box, int]],
        pending: int,
        total: int,
        max_inflight_bytes: int,
        drain_one: Any,
    ) -> tuple[int, int]:
        """Start the reads of ``t``'s shards from its tensorstore array; returns the new (pending, total)."""
        import tensorstore as ts

        for shard in t.shards:
            if shard.target is not None and shard.target.dtype == stored:
                # straight into the destination: no intermediate array, no second copy; a region larger
                # than the cap is read in slabs, so the bytes in flight stay within it
                for box, target in _slabs(shard.box, shard.target, max_inflight_bytes):
                    n = box.volume * stored.itemsize
                    while inflight and pending + n > max_inflight_bytes:
                        pending -= drain_one()
                    dest = ts.array(target, copy=False, write=True)
                    inflight.append((dest.write(store[box.slices()]), None, t.name, box, n))
                    pending += n
                    total += n
                continue
            n = shard.box.volume * stored.itemsize
            while inflight and pending + n > max_inflight_bytes:
                pending -= drain_one()
            region = store[shard.box.slices()]
            if shard.staging is not None:  # e.g. a pinned buffer on its way to a device
                buf = shard.staging(shard.box.lengths, stored)
                dest = ts.array(buf, copy=False, write=True)
                sink = lambda _r, s=shard.sink, b=buf: s(b)  # noqa: E731
                inflight.append((dest.write(region), sink, t.name, shard.box, n))
            else:
                inflight.append((region.read(), shard.sink, t.name, shard.box, n))
            pending += n
            total += n
        return pending, total


def _read_direct(
    reader: chunkread.ChunkReader,
    t: LoadTensor,
    stored: np.dtype,
    store_of: Callable[[], Any],
    inflight: deque[tuple[Any, Any, str, Box, int]],
    pending: int,
    total: int,
    max_inflight_bytes: int,
    drain_one: Any,
) -> tuple[int, int]:
    """Start reading ``t``'s shards with ``reader``: into the destination (``target``), the sink's staging
    buffer, or one new array handed to the sink; returns the new (pending, total)."""
    for shard in t.shards:
        sink = None
        if shard.target is not None and shard.target.dtype == stored:
            out = shard.target
        elif shard.staging is not None:  # e.g. a pinned buffer on its way to a device
            out = shard.staging(shard.box.lengths, stored)
            sink = lambda _r, s=shard.sink, b=out: s(b)  # noqa: E731
        else:
            out = np.empty(shard.box.lengths, stored)
            sink = shard.sink
        n = shard.box.volume * stored.itemsize
        while inflight and pending + n > max_inflight_bytes:
            pending -= drain_one()
        read = _DirectRead(reader.submit(t.name, shard.box, out), shard.box, out, store_of)
        inflight.append((read, sink, t.name, shard.box, n))
        pending += n
        total += n
    return pending, total


class _DirectRead:
    """The chunk reads of one region; ``result()`` waits for them (reading through tensorstore what the
    reader left, a file not in the layout a save writes) and returns the filled array."""

    def __init__(self, futures: list[Any], box: Box, out: np.ndarray, store_of: Callable[[], Any]) -> None:
        self._futures, self._box, self._out, self._store_of = futures, box, out, store_of

    def result(self) -> np.ndarray:
        import tensorstore as ts

        done = [f.result() for f in self._futures]
        if not all(done):
            ts.array(self._out, copy=False, write=True).write(self._store_of()[self._box.slices()]).result()
        return self._out


def _allocated(t: LoadTensor, stored: np.dtype) -> int:
    """Bytes of the buffers a read of ``t`` allocates: its regions without a target of the stored dtype."""
    n = 0
    for s in t.shards:
        if s.target is None or s.target.dtype != stored:
            n += s.box.volume * stored.itemsize
    return n


def _read_threads() -> int:
    """Threads reading chunk files (a cold read needs requests in flight; a warm one, cores)."""
    return max(2, min(8, os.cpu_count() or 2))


def _gone(storage: Storage, root: str, error: Exception, doing: str) -> CheckpointNotFoundError | None:
    """What to raise for ``error`` met while a checkpoint was being ``doing`` ("opened", "read"): a
    :class:`CheckpointNotFoundError` when the checkpoint is no longer committed (removed from under the
    reader: whatever broke, a missing file, a missing chunk, a vanished directory, is its consequence), else
    None (``error`` itself stands). Removal takes the commit marker first (a rename of the whole directory locally), so a
    checkpoint that is being removed is never seen as committed after its files started to go."""
    try:
        if storage.is_committed(root):
            return None
    except Exception:  # noqa: BLE001 - the original error is the better report
        return None
    return CheckpointNotFoundError(
        f"the checkpoint at {root} was removed while it was being {doing} (retention by another job or "
        f"manager?); nothing of it can be trusted: load another step ({type(error).__name__}: {error})"
    )


def _slabs(box: Box, target: np.ndarray, limit: int) -> list[tuple[Box, np.ndarray]]:
    """``box`` and its destination ``target`` cut along the first dimension into slabs of at most ``limit``
    bytes (at least one row each)."""
    if not box.lengths or target.nbytes <= limit:
        return [(box, target)]
    row = target.nbytes // box.lengths[0]
    step = max(1, limit // max(row, 1))
    out = []
    for start in range(0, box.lengths[0], step):
        rows = min(step, box.lengths[0] - start)
        sub = Box((box.offsets[0] + start, *box.offsets[1:]), (rows, *box.lengths[1:]))
        out.append((sub, target[start : start + rows]))
    return out


def record_load_metrics(url: str, recorder: PhaseRecorder, comm: Communicator) -> None:
    """Gather every rank's load phases; the coordinator stores them as ``.acp/metrics-load.json`` (collective)."""
    records = comm.gather_json(recorder.to_json(), dst=0)
    if records is not None:
        storage, root = storage_for(url)
        doc = {"load": {str(r): rec for r, rec in enumerate(records)}}
        # beside the checkpoint's own metadata: an older checkpoint keeps its layout
        write_sidecar(storage, root, storage.control_files(root).load_metrics, doc)
