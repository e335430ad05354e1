"""The save pipeline: snapshot in the caller's thread, then exchange, write and flush in the background.

``save_async`` plans (unless the plan is cached: the first save of a structure, or after it changed), copies
the local regions this rank writes or sends into reusable host buffers and returns; one background thread per
process then runs the writes (bounded bytes in flight; chunks this rank holds whole first, beside the fragment
exchange on a thread of its own, :mod:`.exchange`: only the chunks of flat ranges, FSDP1, straddle ranks), one
flush, and the coordinator's commit. Packs and ``zarr.json`` documents are encoded by :mod:`.packwrite`.
Saves run strictly one after another (buffers and the checkpoint group are reused).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from ..codecs import numpy_dtype
from ..errors import ArrayCheckpointError, SaveFailedError
from ..format import rankdoc
from ..format.perrank import fall_back, stack_digest
from ..planning.items import HostSource, SaveRequest, SaveShard
from ..planning.plan import RankPlan
from ..planning.regions import Box, intersect
from ..runtime.collectives import Communicator
from ..runtime.future import CheckpointFuture
from ..runtime.hostpool import HostBufferPool
from ..runtime.monitoring import PhaseRecorder
from ..runtime.tscontext import context
from ..runtime.workers import busy
from ..storage import lease, storage_for
from . import shardfile
from .common import array_spec, describe, wait_write
from .coordinate import Coordinator, declaration_digest, declare, structure_key
from .exchange import FragmentExchange, local_view
from .job import SaveJob, SaveOptions
from .packwrite import Packs, create_arrays

log = logging.getLogger("arraycheckpoint")


class SavePipeline:
    """Runs saves: the snapshot in the caller's thread, the rest in one background thread."""

    def __init__(self, pool: HostBufferPool) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acp-save")
        self._coordinator = Coordinator()
        self._pool = pool
        self._last: CheckpointFuture | None = None
        self._counter = itertools.count()
        self._last_mode = ""

    def wait_idle(self) -> None:
        """Wait (without raising) until the last save has finished with the checkpoint group."""
        if self._last is not None:
            self._last.exception()

    def save_async(
        self, url: str, request: SaveRequest, comm: Communicator, options: SaveOptions | None = None
    ) -> CheckpointFuture:
        """Snapshot ``request`` and write it in the background; returns once the snapshot is taken."""
        options = options or SaveOptions()
        storage, final = storage_for(url)
        storage.stall_timeout = options.liveness_timeout  # a request the store never answers: this bound
        future = CheckpointFuture(final)
        self.wait_idle()  # buffers and the checkpoint group are reused
        comm.set_liveness_timeout(options.liveness_timeout)  # before this save's first collective
        decl, decl_error, decl_digest = None, None, b""
        try:
            decl = declare(request.tensors, comm.rank, comm.world_size)
            decl_digest = declaration_digest(decl, comm, options)
        except Exception as e:  # noqa: BLE001 - every rank must still reach the agreement
            decl_error = e
        key = structure_key(decl_digest, comm, options)
        self._last = future
        recorder = PhaseRecorder()
        token = f"{comm.session_id}-{next(self._counter)}"
        job = SaveJob(
            storage=storage,
            final=final,
            staging=storage.staging_root(final, token),
            token=token,
            request=request,
            comm=comm,
            options=options,
            future=future,
            key=key,
            decl=decl,
            decl_digest=decl_digest,
            cached=None,
            local={},
            dtypes={t.name: np.dtype(t.dtype) for t in request.tensors},
            recorder=recorder,
            stack_digest=stack_digest(request.tensors),
            template_digest=rankdoc.template_digest(request.objects),
        )
        if decl_error is not None:
            job.error = describe(decl_error, comm.rank)
        try:
            self._coordinator.agree(job)  # the one collective before the snapshot (fixed size)
        except BaseException as e:
            future._set_committed(error=e)  # the next save's wait_idle must not wait for this one forever
            raise
        if job.unstack or job.untemplate:
            _unstack(job)
        self._last_mode = job.mode  # for tests and monitoring: which planning path this save took
        if decl_error is not None and comm.world_size == 1:
            future._set_committed(error=decl_error)
            return future
        try:
            if job.mode == "skip":
                raise SaveFailedError(
                    job.error or "another rank could not describe its state (see its error)"
                )
            # plan first (a cached plan is already there): the snapshot copies only what this rank writes or
            # sends; every rank plans (collectives in "gather" mode) before rank 0 may fail its target check
            self._coordinator.plan(job)
            if comm.rank == 0:
                storage.check_target(final, options.overwrite)
                storage.save_world = comm.world_size  # its lock says how many ranks write under it
                storage.acquire(final, token)
            self._snapshot(job)
        except Exception as e:  # noqa: BLE001 - reported through the commit collective on every rank
            job.error = job.error or describe(e, comm.rank)
            if comm.world_size == 1:
                _await_fences(job)  # copies still landing in the buffers
                self._pool.give(job.buffers)
                future._set_committed(error=e)
                return future
        if not job.fences:
            future._set_staged()
        self._executor.submit(self._run, job)
        return future

    def _snapshot(self, job: SaveJob) -> None:
        """Copy into host buffers the local regions this rank writes or sends, and nothing else.

        The plan is known (cached, or made just before in the caller's thread), so a region of a shard that
        another rank writes is not copied: a replica (DDP) copies the chunks this rank writes, not the whole
        tensor. Sources that offer a zero-copy view are registered whole without a copy. Records the bytes
        registered (``bytes``) and the bytes copied into host buffers (``copied``) in the snapshot phase.
        """
        assert job.cached is not None, "the snapshot needs the plan"
        need = job.cached.rank_plan.needed_boxes()
        nbytes = copied = 0
        with job.recorder.phase("snapshot") as rec:
            for t in job.request.tensors:
                wanted = need.get(t.name)
                if not wanted:
                    continue
                dtype = job.dtypes[t.name]
                for shard in t.shards:
                    if shard.box.volume == 0:
                        continue
                    if len(wanted) == 1 and wanted[0] == shard.box:  # this rank writes all of it
                        parts = wanted
                    else:
                        parts = [b for w in wanted if (b := intersect(shard.box, w)) is not None]
                    if not parts:
                        continue
                    view = _zero_copy_view(shard.source, job.options.blocking)
                    if view is not None and tuple(view.shape) == shard.box.lengths and view.dtype == dtype:
                        job.local.setdefault(t.name, []).append((shard.box, view))  # immutable: no copy
                        nbytes += view.nbytes
                        continue
                    regions = _copy_regions(shard, parts)
                    # a buffer of the whole shard that acp.prepare reserved: the regions are carved out of it
                    # (no allocation on the blocking path of a first save), else one buffer per region
                    whole = (
                        self._pool.take_idle(shard.box.lengths, dtype)
                        if len(regions) > 1 or (regions[0][0] != shard.box)
                        else None
                    )
                    if whole is not None:
                        job.buffers.append(whole)
                    cursor = 0
                    for box, source in regions:
                        if whole is not None:
                            buf = whole.reshape(-1)[cursor : cursor + box.volume].reshape(box.lengths)
                            cursor += box.volume
                        else:
                            buf = self._pool.take(box.lengths, dtype)
                            job.buffers.append(buf)
                        fence = source.copy_into(buf)
                        if fence is not None:
                            job.fences.append(fence)
                        job.local.setdefault(t.name, []).append((box, buf))
                        nbytes += buf.nbytes
                        copied += buf.nbytes
            rec["bytes"] = nbytes
            rec["copied"] = copied

    def _run(self, job: SaveJob) -> None:
        comm = job.comm
        if job.fences:
            job.error = _await_fences(job) or job.error
            job.future._set_staged()
        try:
            plan = job.cached if job.mode != "skip" else None  # planned before the snapshot
            claimed, grant = _target_claimed(job) if plan is not None else (False, None)
            # every rank enters the exchange, a failed one too (it sends zeros): otherwise the others block in
            # the exchange while it waits in the commit gather (e.g. rank 0's CheckpointExistsError); it runs
            # beside the writes of the chunks this rank holds whole
            exchange = FragmentExchange(job, plan.rank_plan) if plan is not None else None
            try:
                if job.error is None and plan is not None and claimed:
                    # before the first write: a flush reports only errors from after this (syncfs)
                    job.storage.open_flush(job.staging)
                    if comm.rank != 0:  # writes under rank 0's lease: stops before another save may take it
                        job.storage.follow_lease(
                            job.staging, job.final, job.token, grant, comm.rank, comm.world_size
                        )
                    self._write(job, plan.rank_plan, exchange.received)
                    with job.recorder.phase("flush"), busy(f"{job.staging} (its flush)"):
                        job.storage.flush(job.staging)  # a syncfs stalled at exit is named too
            finally:
                if exchange is not None:
                    exchange.join()  # the collective is over on this rank before the commit's start
        except Exception as e:  # noqa: BLE001
            job.error = job.error or describe(e, comm.rank)
            log.debug("save failed on rank %d", comm.rank, exc_info=True)
        finally:
            self._pool.give(job.buffers)
            job.buffers.clear()
            job.local.clear()
        meta, error = None, None
        try:
            meta = self._coordinator.commit(job)  # the coordinator's last flush is in there
        except ArrayCheckpointError as e:
            error = e
        except Exception as e:  # noqa: BLE001 - a collective failed: a peer died or the group broke
            error = SaveFailedError(
                f"save to {job.final} did not complete: rank {comm.rank} lost contact with the other ranks "
                f"during commit ({type(e).__name__}: {e}); unless the path loads, it was not committed and "
                "CheckpointManager removes its leftovers on the next start"
            )
        finally:
            job.storage.close_flush(job.staging)  # on every path: no descriptor outlives the save
        # this save's hold on the request's tensors (with the views the adapter made of them: 5-8 objects per
        # tensor) ends before the caller wakes: a blocking save's caller resumes the cyclic collector, whose
        # first pass would otherwise walk them (this thread still holding them) only to find them garbage.
        # The caller's request itself is left as it is
        job.request = dataclasses.replace(job.request, tensors=[])
        job.future._set_committed(meta, error)

    def _write(
        self, job: SaveJob, plan: RankPlan, received: Callable[[], dict[tuple[str, Box], np.ndarray]]
    ) -> None:
        """Write this rank's chunks: those it holds whole first, then those assembled from fragments other
        ranks send (``received`` waits for the exchange), with at most ``max_inflight_bytes`` in flight."""
        import tensorstore as ts

        with job.recorder.phase("write") as rec:
            job.storage.check_lease(job.final)  # and before each write batch (make_room)
            layouts = {layout.name: layout for layout in plan.layouts}
            writer = _writer(job)
            try:
                packs = Packs(job, plan, layouts, writer)
                packed = packs.packed
                created = create_arrays(job, writer, [layouts[name] for name in plan.create])
                # whole uncompressed chunks are encoded here and written as files; the rest go through a
                # tensorstore array opened with the metadata assumed (on storage already, or written by another
                # rank), so nothing is read or validated per array
                direct = [
                    w.name in packed
                    or shardfile.can_encode(layouts[w.name], w.chunk, _write_dtype(job, w.name))
                    for w in plan.writes
                ]
                opening = {
                    name: ts.open(
                        array_spec(job.storage, job.staging, layouts[name]),
                        open=True,
                        assume_metadata=True,
                        context=context(),
                    )
                    for name in dict.fromkeys(w.name for w, d in zip(plan.writes, direct) if not d)
                }
                stores = {name: fut.result() for name, fut in opening.items()}
                inflight: deque[tuple[Any, int, str]] = deque()
                pending = 0
                total = 0

                def start(fut: Any, nbytes: int, name: str) -> None:
                    nonlocal pending
                    inflight.append((fut, nbytes, name))
                    pending += nbytes

                def make_room(nbytes: int) -> None:
                    nonlocal pending
                    job.storage.check_lease(job.final)  # a save whose lock was taken over stops writing
                    if inflight and pending + nbytes > job.options.max_inflight_bytes:
                        writer.flush()
                    while inflight and pending + nbytes > job.options.max_inflight_bytes:
                        fut, n, name = inflight.popleft()
                        _wait(job, fut, name)
                        pending -= n

                for fut, nbytes, label in packs.start():  # the zarr.json documents in packs
                    make_room(nbytes)
                    start(fut, nbytes, label)
                me = job.comm.rank
                remote = [any(p.src != me for p in w.pieces) for w in plan.writes]
                order = sorted(
                    range(len(plan.writes)), key=remote.__getitem__
                )  # stable: plan order otherwise
                for i in order:
                    w, encode = plan.writes[i], direct[i]
                    data = self._chunk_data(job, w, received() if remote[i] else {})
                    if w.name in packed:  # into its pack now (a key-value store's: once the pack is whole)
                        for fut, nbytes, label in packs.add(w, data):
                            make_room(nbytes)
                            start(fut, nbytes, label)
                        continue
                    make_room(data.nbytes)
                    if encode:
                        layout = layouts[w.name]
                        key = f"{w.name}/{shardfile.chunk_key(layout, w.chunk)}"
                        fut = writer.write(
                            key, shardfile.encode(data, layout.inner_chunk_shape, writer.summing)
                        )
                    else:
                        fut = stores[w.name][w.chunk.slices()].write(data)
                    start(fut, data.nbytes, w.name)
                    total += data.nbytes
                packs.check_done()
                writer.flush()
                for fut, _n, name in inflight:
                    _wait(job, fut, name)
                for name, fut in created:
                    _wait(job, fut, name)
            finally:
                writer.close()
            rec["bytes"] = total + packs.written  # packed members counted by the packs (batched writes too)

    def _chunk_data(self, job: SaveJob, w: Any, received: dict[tuple[str, Box], np.ndarray]) -> np.ndarray:
        me = job.comm.rank
        if len(w.pieces) == 1 and w.pieces[0].box == w.chunk and w.pieces[0].src == me:
            return local_view(job, w.name, w.chunk)
        out = np.empty(w.chunk.lengths, dtype=_write_dtype(job, w.name))
        for p in w.pieces:
            src = local_view(job, w.name, p.box) if p.src == me else received[(w.name, p.box)]
            out[p.box.slices(w.chunk)] = src
        return out


def _wait(job: SaveJob, fut: Any, name: str) -> None:
    """Wait for the write of ``name``, marked as waiting for it: at interpreter exit a write that never
    completes (a tensorstore write to a stalled backend: no pool thread of ours to name) is given up on after
    a bound, naming it (:mod:`arraycheckpoint.runtime.workers`)."""
    with busy(f"{job.staging}/{name}"):
        wait_write(fut, name)


def _target_claimed(job: SaveJob) -> tuple[bool, list[int] | None]:
    """Whether every rank may write: storage that writes in place (the marker strategy: object stores,
    fsspec) needs rank 0 to have claimed the target and emptied its prefix (``acquire``) before any rank
    writes or uploads there, or the clearing deletes what a faster rank already wrote (the committed
    checkpoint then misses that rank's chunks), and a target another save holds must not be written at all.
    A cached or identical-declaration plan has no collective between rank 0's ``acquire`` and the writes,
    so one fixed-size agreement orders them (every rank calls it: the strategy is the same on all ranks).
    Staged storage (local rename) writes into this save's own staging directory and needs none.

    The agreement also carries rank 0's lease grant (when its lock document was stored, the lease's terms:
    :meth:`~arraycheckpoint.storage.Storage.lease_grant`) to the ranks writing under it, so none reads the
    lock before its first write; returned beside the verdict (None where there is no agreement)."""
    comm = job.comm
    if comm.world_size == 1 or job.storage.commit_strategy != "marker":
        return True, None
    grant = job.storage.lease_grant(job.final) if comm.rank == 0 else lease.NO_GRANT
    ok, *granted = comm.all_reduce_min([int(job.error is None), *grant])
    return bool(ok), granted


def _writer(job: SaveJob) -> shardfile.KvWriter | shardfile.FileWriter:
    """Where this save's files go: plain files on a local file system, the storage's key-value store else."""
    return shardfile.file_writer(job.storage, job.staging)


def _unstack(job: SaveJob) -> None:
    """The ranks' stacked per-rank rows (or templates) disagree: save the per-rank arrays (or documents)
    instead (the same decision on every rank)."""
    if job.unstack:
        job.request.tensors = fall_back(job.request.tensors)
    if job.untemplate:
        job.request.tensors, job.request.objects = rankdoc.fall_back(job.request.tensors, job.request.objects)
    job.dtypes = {t.name: np.dtype(t.dtype) for t in job.request.tensors}
    try:
        job.decl = declare(job.request.tensors, job.comm.rank, job.comm.world_size)
        job.decl_digest = declaration_digest(job.decl, job.comm, job.options)
    except Exception as e:  # noqa: BLE001 - keep the agreed collectives; the save fails at commit
        job.error = job.error or describe(e, job.comm.rank)


def _copy_regions(shard: SaveShard, parts: list[Box]) -> list[tuple[Box, HostSource]]:
    """What to copy of ``shard`` to hold the disjoint regions ``parts`` of it: ``(box, source)`` pairs.

    The whole shard when the parts cover it or its source cannot cut out a region (no ``region`` method, or it
    returns None); else one copy per part, with parts that continue each other along the first dimension
    merged (a rank's consecutive row chunks are one copy)."""
    region = getattr(shard.source, "region", None)
    if region is None or sum(p.volume for p in parts) >= shard.box.volume:
        return [(shard.box, shard.source)]
    merged: list[Box] = []
    for p in sorted(parts, key=lambda b: b.offsets):
        last = merged[-1] if merged else None
        if (
            last is not None
            and last.offsets[1:] == p.offsets[1:]
            and last.lengths[1:] == p.lengths[1:]
            and last.offsets[0] + last.lengths[0] == p.offsets[0]
        ):
            merged[-1] = Box(last.offsets, (last.lengths[0] + p.lengths[0], *last.lengths[1:]))
        else:
            merged.append(p)
    out: list[tuple[Box, HostSource]] = []
    for box in merged:
        sub = region(shard.box.lengths, box.slices(shard.box))
        if sub is None:
            return [(shard.box, shard.source)]
        out.append((box, sub))
    return out


def _zero_copy_view(source: Any, blocking: bool) -> np.ndarray | None:
    """A host view the engine may write from without a staging copy, or None.

    ``stable_view()``: memory that never changes (immutable jax arrays on CPU). ``borrowed_view()``: memory the
    caller will not touch while it waits for the commit, so only usable by a blocking ``save()``.
    """
    stable = getattr(source, "stable_view", None)
    view = stable() if stable is not None else None
    if view is None and blocking:
        borrowed = getattr(source, "borrowed_view", None)
        view = borrowed() if borrowed is not None else None
    return view


def _write_dtype(job: SaveJob, name: str) -> np.dtype:
    """The dtype of a tensor this rank writes: from the plan, since the writer of a straddling chunk need not
    hold any of the tensor itself (then it has no local entry)."""
    return job.dtypes.get(name) or numpy_dtype(job.cached.compact.tensors[name].layout.dtype)


def _await_fences(job: SaveJob) -> str | None:
    """Wait for the snapshot's asynchronous copies; the first failure, described, or None."""
    error = None
    for fence in job.fences:
        try:
            fence.wait()
        except Exception as e:  # noqa: BLE001 - reported through the commit like any snapshot error
            error = error or describe(e, job.comm.rank)
    job.fences.clear()
    return error
