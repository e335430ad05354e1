"""The engine: the one place where checkpoint bytes move (snapshot, exchange, write, read, commit).

Save, per rank:

1. *snapshot* (blocking, in the caller's thread): copy the local regions the plan needs into reusable host
   buffers; then ``future.staged`` completes and training may go on;
2. in one background thread per process, in order: *plan* (gather local declarations on the coordinator,
   build and validate the global plan, scatter each rank its part; skipped when the structure's plan is
   cached), *exchange* (fragments of chunks that straddle ranks, one batched all-to-all), *write* (tensorstore
   writes with a bound on bytes in flight), *flush* (one batched flush), *commit* (the coordinator gathers
   every rank's status, writes ``.metadata.json`` and the commit marker, and broadcasts the outcome, so
   errors surface on every rank).

Load: read and validate the metadata, then read exactly the requested regions concurrently and hand each
to its sink. The engine knows no framework: adapters translate (see :mod:`arraycheckpoint.items`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import threading
import traceback
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import __version__
from ._tscontext import context
from .codecs import CODEC_PRESET, array_metadata, numpy_dtype, zarr_dtype_name
from .collectives import Communicator
from .errors import (
    ArrayCheckpointError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    MetadataError,
    SaveFailedError,
    StorageError,
)
from .future import CheckpointFuture
from .hostpool import HostBufferPool
from .items import LoadTensor, SaveRequest, SaveTensor
from .metadata import (
    LOAD_METRICS_FILE,
    METADATA_FILE,
    METRICS_FILE,
    CheckpointMetadata,
    ObjectMeta,
    ShardMeta,
    TensorMeta,
    check_name,
)
from .monitoring import PhaseRecorder
from .plan import (
    GlobalPlan,
    PlanOptions,
    RankPlan,
    TensorDecl,
    build_global_plan,
    rank_plan_from_json,
    rank_plan_to_json,
)
from .regions import Box, intersect
from .storage import Storage, storage_for

log = logging.getLogger("arraycheckpoint")

DEFAULT_INFLIGHT_BYTES = 1 << 30
MAX_CACHED_PLANS = 16


@dataclass(frozen=True)
class SaveOptions:
    """Options of one save (identical on every rank)."""

    overwrite: bool = False
    plan: PlanOptions = field(default_factory=PlanOptions)
    max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES
    # the caller waits for the commit (``save()``): sources may lend their memory instead of being copied
    blocking: bool = False


@dataclass
class _CachedPlan:
    rank_plan: RankPlan
    global_plan: GlobalPlan | None  # coordinator only


@dataclass
class _Job:
    storage: Storage
    final: str
    staging: str
    token: str
    request: SaveRequest
    comm: Communicator
    options: SaveOptions
    future: CheckpointFuture
    key: str
    decls: list[TensorDecl]
    cached: _CachedPlan | None
    local: dict[str, list[tuple[Box, np.ndarray]]]
    dtypes: dict[str, np.dtype]
    recorder: PhaseRecorder
    error: str | None = None
    buffers: list[np.ndarray] = field(default_factory=list)


class Engine:
    """Runs saves and loads. One per process (see :func:`engine`); saves run strictly one after another."""

    def __init__(self) -> None:
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="acp-save")
        self._plans: dict[str, _CachedPlan] = {}
        self._pool = HostBufferPool()
        self._last: CheckpointFuture | None = None
        self._counter = itertools.count()

    # ------------------------------------------------------------------------------------------ save
    def save_async(
        self, url: str, request: SaveRequest, comm: Communicator, options: SaveOptions | None = None
    ) -> CheckpointFuture:
        """Snapshot ``request`` and write it in the background; returns once the snapshot is taken."""
        options = options or SaveOptions()
        storage, final = storage_for(url)
        decls = _declare(request.tensors)  # bad input raises here, identically on every rank
        key = _structure_key(decls, comm, options)
        future = CheckpointFuture(final)
        self.wait_idle()  # buffers and the checkpoint group are reused
        self._last = future
        recorder = PhaseRecorder()
        token = f"{comm.session_id}-{next(self._counter)}"
        job = _Job(
            storage=storage,
            final=final,
            staging=storage.staging_root(final, token),
            token=token,
            request=request,
            comm=comm,
            options=options,
            future=future,
            key=key,
            decls=decls,
            cached=self._plans.get(key),
            local={},
            dtypes={t.name: np.dtype(t.dtype) for t in request.tensors},
            recorder=recorder,
        )
        try:
            if comm.rank == 0:
                storage.check_target(final, options.overwrite)
                storage.acquire(final, token)
            self._snapshot(job)
        except Exception as e:  # noqa: BLE001 - reported through the commit collective on every rank
            job.error = _describe(e, comm.rank)
            if comm.world_size == 1:
                self._pool.give(job.buffers)
                future._set_committed(error=e)
                return future
        future._set_staged()
        self._executor.submit(self._run, job)
        return future

    def _snapshot(self, job: _Job) -> None:
        need = job.cached.rank_plan.needed_boxes() if job.cached else None
        nbytes = 0
        with job.recorder.phase("snapshot") as rec:
            for t in job.request.tensors:
                wanted = need.get(t.name, []) if need is not None else None
                dtype = job.dtypes[t.name]
                for shard in t.shards:
                    if shard.box.volume == 0:
                        continue
                    if wanted is not None and not any(intersect(shard.box, w) is not None for w in wanted):
                        continue
                    view = _zero_copy_view(shard.source, job.options.blocking)
                    if view is not None and tuple(view.shape) == shard.box.lengths and view.dtype == dtype:
                        job.local.setdefault(t.name, []).append((shard.box, view))  # immutable: no copy
                        nbytes += view.nbytes
                        continue
                    buf = self._pool.take(shard.box.lengths, dtype)
                    job.buffers.append(buf)
                    shard.source.copy_into(buf)
                    job.local.setdefault(t.name, []).append((shard.box, buf))
                    nbytes += buf.nbytes
            rec["bytes"] = nbytes

    def _run(self, job: _Job) -> None:
        comm = job.comm
        try:
            plan = self._plan(job)
            # every rank enters the exchange, a failed one too (it sends zeros): otherwise the others block in
            # the all-to-all while it waits in the commit gather (e.g. rank 0's CheckpointExistsError)
            received = self._exchange(job, plan.rank_plan)
            if job.error is None:
                self._write(job, plan.rank_plan, received)
                with job.recorder.phase("flush"):
                    job.storage.flush(job.staging)
        except Exception as e:  # noqa: BLE001
            job.error = job.error or _describe(e, comm.rank)
            log.debug("save failed on rank %d", comm.rank, exc_info=True)
        finally:
            self._pool.give(job.buffers)
            job.buffers.clear()
            job.local.clear()
        try:
            meta = self._commit(job)
        except ArrayCheckpointError as e:
            job.future._set_committed(error=e)
        except Exception as e:  # noqa: BLE001 - a collective failed: a peer died or the group broke
            job.future._set_committed(
                error=SaveFailedError(
                    f"save to {job.final} did not complete: rank {comm.rank} lost contact with the other ranks "
                    f"during commit ({type(e).__name__}: {e}); unless the path loads, it was not committed and "
                    "CheckpointManager removes its leftovers on the next start"
                )
            )
        else:
            job.future._set_committed(meta)

    def _plan(self, job: _Job) -> _CachedPlan:
        """Coordinator builds the global plan from every rank's declarations, or the cache supplies it."""
        if job.cached is not None:
            return job.cached
        comm = job.comm
        with job.recorder.phase("plan"):
            payload = {"kind": "plan", "decls": [_decl_json(d) for d in job.decls]}
            gathered = comm.gather_json(payload, dst=0)
            global_plan = None
            if comm.rank == 0:
                assert gathered is not None
                if any(g.get("kind") != "plan" for g in gathered):
                    raise SaveFailedError("ranks disagree on the checkpoint collective sequence")
                try:
                    global_plan = build_global_plan(
                        [[_decl_from_json(d) for d in g["decls"]] for g in gathered], job.options.plan
                    )
                    parts: list[Any] = [rank_plan_to_json(p) for p in global_plan.ranks]
                except ArrayCheckpointError as e:
                    parts = [{"error": str(e)}] * comm.world_size
            else:
                parts = None
            mine = comm.scatter_json(parts, src=0)
            if "error" in mine:
                raise SaveFailedError(f"planning failed: {mine['error']}")
            rank_plan = rank_plan_from_json(mine)
        cached = _CachedPlan(rank_plan, global_plan)
        job.cached = cached
        if job.error is None:
            self._plans[job.key] = cached
            while len(self._plans) > MAX_CACHED_PLANS:  # structures that keep changing (dataloader buffers)
                self._plans.pop(next(iter(self._plans)))
        return cached

    def _exchange(self, job: _Job, plan: RankPlan) -> dict[tuple[str, Box], np.ndarray]:
        """Ship fragments of straddling chunks to their writers: one batched all-to-all per save."""
        comm = job.comm
        if comm.world_size == 1 or not plan.exchange:
            return {}
        with job.recorder.phase("exchange") as rec:
            # one send buffer per peer, each fragment copied into it once (no concatenate of copies)
            sizes = [0] * comm.world_size
            for t in plan.sends:
                sizes[t.dst] += t.box.volume * job.dtypes[t.name].itemsize
            flat = [np.zeros(n, np.uint8) for n in sizes]  # zeros: what a failed rank sends
            cursor = [0] * comm.world_size
            for t in plan.sends:
                dtype = job.dtypes[t.name]
                n = t.box.volume * dtype.itemsize
                if job.error is None:  # a failed rank still enters the collective, with zeros
                    try:
                        dest = (
                            flat[t.dst][cursor[t.dst] : cursor[t.dst] + n].view(dtype).reshape(t.box.lengths)
                        )
                        dest[...] = _local_view(job, t.name, t.box)
                    except Exception as e:  # noqa: BLE001 - reported at commit; the collective must still run
                        job.error = _describe(e, comm.rank)
                cursor[t.dst] += n
            recv_dtypes = {layout.name: numpy_dtype(layout.dtype) for layout in plan.layouts}
            recv_sizes = [0] * comm.world_size
            for t in plan.recvs:
                recv_sizes[t.src] += t.box.volume * recv_dtypes[t.name].itemsize
            got = comm.all_to_all_bytes(flat, recv_sizes)
            out: dict[tuple[str, Box], np.ndarray] = {}
            cursor = [0] * comm.world_size
            for t in plan.recvs:
                dtype = recv_dtypes[t.name]
                n = t.box.volume * dtype.itemsize
                raw = got[t.src][cursor[t.src] : cursor[t.src] + n]
                cursor[t.src] += n
                out[(t.name, t.box)] = raw.view(dtype).reshape(t.box.lengths)
            rec["bytes"] = sum(recv_sizes)
        return out

    def _write(self, job: _Job, plan: RankPlan, received: dict[tuple[str, Box], np.ndarray]) -> None:
        import tensorstore as ts

        with job.recorder.phase("write") as rec:
            stores = {}
            opening = {
                layout.name: ts.open(
                    _array_spec(job.storage, job.staging, layout),
                    create=layout.name in plan.create,
                    assume_metadata=layout.name not in plan.create,
                    context=context(),
                )
                for layout in plan.layouts
            }
            for name, fut in opening.items():
                stores[name] = fut.result()
            inflight: deque[tuple[Any, int, str]] = deque()
            pending = 0
            total = 0
            for w in plan.writes:
                data = self._chunk_data(job, w, received)
                nbytes = data.nbytes
                while inflight and pending + nbytes > job.options.max_inflight_bytes:
                    fut, n, name = inflight.popleft()
                    _wait(fut, name)
                    pending -= n
                arr = stores[w.name]
                inflight.append((arr[w.chunk.slices()].write(data), nbytes, w.name))
                pending += nbytes
                total += nbytes
            for fut, _n, name in inflight:
                _wait(fut, name)
            rec["bytes"] = total

    def _chunk_data(self, job: _Job, w: Any, received: dict[tuple[str, Box], np.ndarray]) -> np.ndarray:
        me = job.comm.rank
        if len(w.pieces) == 1 and w.pieces[0].box == w.chunk and w.pieces[0].src == me:
            return _local_view(job, w.name, w.chunk)
        out = np.empty(w.chunk.lengths, dtype=job.dtypes[w.name])
        for p in w.pieces:
            src = _local_view(job, w.name, p.box) if p.src == me else received[(w.name, p.box)]
            out[p.box.slices(w.chunk)] = src
        return out

    def _commit(self, job: _Job) -> CheckpointMetadata | None:
        """Gather statuses; the coordinator writes metadata and commits; the outcome reaches every rank."""
        comm = job.comm
        rank_objects = {o.name: o.value for o in job.request.objects if o.scope == "rank"}
        status = {
            "kind": "commit",
            "plan_id": job.cached.rank_plan.plan_id if job.cached else None,
            "error": job.error,
            "objects": rank_objects,
            "metrics": job.recorder.to_json(),
        }
        statuses = comm.gather_json(status, dst=0)
        outcome: dict[str, Any] = {"error": None}
        meta = None
        if comm.rank == 0:
            assert statuses is not None
            errors = [s.get("error") for s in statuses if s.get("kind") != "commit" or s.get("error")]
            plan_ids = {s.get("plan_id") for s in statuses}
            if not errors and len(plan_ids) != 1:
                errors = [
                    f"ranks executed different save plans {sorted(map(str, plan_ids))}: the state "
                    "structure changed on some ranks but not others between saves"
                ]
            if errors:
                outcome["error"] = "; ".join(str(e) for e in errors)
            else:
                try:
                    with job.recorder.phase("commit"):
                        meta = self._write_metadata(job, statuses)
                        job.storage.commit(job.staging, job.final, job.options.overwrite)
                except Exception as e:  # noqa: BLE001
                    outcome["error"] = _describe(e, 0)
            if outcome["error"]:
                job.storage.abort(job.staging, job.final)
            else:
                # the metadata was written inside the commit phase, so the complete record (commit included)
                # goes to a sidecar after it; best effort: the checkpoint is committed either way
                save = {str(r): s.get("metrics", {}) for r, s in enumerate(statuses)}
                save["0"] = job.recorder.to_json()
                _write_sidecar(job.storage, job.final, METRICS_FILE, {"save": save})
            job.storage.release(job.final, job.token)
        outcome = comm.broadcast_json(outcome, src=0)
        if outcome["error"]:
            raise SaveFailedError(f"save to {job.final} failed and was not committed: {outcome['error']}")
        return meta

    def _write_metadata(self, job: _Job, statuses: list[dict[str, Any]]) -> CheckpointMetadata:
        import tensorstore as ts

        plan = job.cached.global_plan if job.cached else None
        assert plan is not None, "coordinator lost its global plan"
        tensors = {}
        for name, tp in plan.tensors.items():
            layout = tp.layout
            tensors[name] = TensorMeta(
                name=name,
                shape=layout.shape,
                dtype=layout.dtype,
                chunk_shape=layout.chunk_shape,
                inner_chunk_shape=layout.inner_chunk_shape,
                compression=layout.compression,
                shards=tuple(ShardMeta(b.offsets, b.lengths, r) for b, r in tp.regions),
                writers=tp.writers,
            )
        objects: dict[str, ObjectMeta] = {}
        for o in job.request.objects:
            if o.scope == "global":
                objects[o.name] = ObjectMeta(o.name, "global", value=o.value)
        for rank, s in enumerate(statuses):
            for name, value in s.get("objects", {}).items():
                prev = objects.get(name)
                per_rank = dict(prev.per_rank) if prev else {}
                per_rank[rank] = value
                objects[name] = ObjectMeta(name, "rank", per_rank=per_rank)
        req = job.request
        metrics = {"save": {str(r): s.get("metrics", {}) for r, s in enumerate(statuses)}}
        meta = CheckpointMetadata(
            framework=req.framework,
            world_size=job.comm.world_size,
            tensors=tensors,
            objects=objects,
            step=req.step,
            topology=req.topology,
            roles=req.roles,
            metrics=metrics,
            library_version=__version__,
            codec_preset=CODEC_PRESET,
        )
        kv = ts.KvStore.open(job.storage.kvstore_spec(job.staging), context=context()).result()
        groups = {""}
        for name in list(tensors) + list(objects):
            parts = name.split("/")
            groups.update("/".join(parts[:i]) for i in range(1, len(parts)))
        attrs = {
            "format_version": meta.format_version,
            "framework": meta.framework,
            "step": meta.step,
            "world_size": meta.world_size,
            "topology": dict(meta.topology),
            "roles": list(meta.roles),
        }
        writes = [kv.write(METADATA_FILE, meta.to_json().encode())]
        for g in sorted(groups):
            doc = {"zarr_format": 3, "node_type": "group", "attributes": attrs if g == "" else {}}
            writes.append(kv.write(f"{g}/zarr.json" if g else "zarr.json", json.dumps(doc).encode()))
        for w in writes:
            w.result()
        job.storage.flush(job.staging)
        return meta

    def wait_idle(self) -> None:
        """Wait (without raising) until the last save has finished with the checkpoint group."""
        if self._last is not None:
            self._last.exception()

    # ------------------------------------------------------------------------------------------ load
    def read_metadata(
        self, url: str, *, allow_pickle: bool = False
    ) -> tuple[Storage, str, CheckpointMetadata]:
        """Open a committed checkpoint's metadata; raises if it is absent or uncommitted.

        A path holding a foreign checkpoint (Hugging Face safetensors, DCP) returns its load source in place
        of the storage (:mod:`arraycheckpoint.sources`); :meth:`_read` then delegates to it.
        """
        storage, root = storage_for(url)
        if not storage.is_committed(root):
            from .sources import open_source  # hook: foreign formats

            source = open_source(storage, root, allow_pickle=allow_pickle)
            if source is not None:
                return source, root, source.metadata  # type: ignore[return-value]
            what = (
                "has no commit marker (a save did not finish)"
                if storage.exists(root, METADATA_FILE)
                else "does not exist"
            )
            raise CheckpointNotFoundError(f"no committed checkpoint at {root}: it {what}")
        raw = storage.read(root, METADATA_FILE)
        if raw is None:
            raise MetadataError(f"checkpoint {root} is committed but has no {METADATA_FILE}")
        return storage, root, CheckpointMetadata.from_json(raw)

    def load(
        self,
        storage: Storage,
        root: str,
        meta: CheckpointMetadata,
        targets: list[LoadTensor],
        max_inflight_bytes: int = DEFAULT_INFLIGHT_BYTES,
        comm: Communicator | None = None,
        dedup_reads: bool = False,
    ) -> PhaseRecorder:
        """Read every target region concurrently and hand it to its sink (in the calling thread).

        With ``dedup_reads`` (and more than one rank in ``comm``), a region several ranks want is read by one
        of them and shared through the communicator in one batched all-to-all (collective: every rank calls).
        """
        recorder = PhaseRecorder()
        if dedup_reads and comm is not None and comm.world_size > 1:
            self.wait_idle()  # the checkpoint group must be idle before load collectives
            with recorder.phase("read-shared") as rec:
                targets, rec["bytes"] = self._shared_reads(
                    storage, root, meta, targets, comm, max_inflight_bytes, recorder
                )
        self._read(storage, root, meta, targets, max_inflight_bytes, recorder)
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
        from .items import LoadShard
        from .plan import assign_shared_reads

        mine = sorted({(t.name, s.box) for t in targets for s in t.shards})
        wanted = comm.all_gather_json([[n, list(b.offsets), list(b.lengths)] for n, b in mine])
        requests = [[(n, Box(tuple(o), tuple(ln))) for n, o, ln in w] for w in wanted]
        itemsize = {
            n: numpy_dtype(meta.tensors[n].dtype).itemsize
            for w in requests
            for n, _ in w
            if n in meta.tensors
        }
        readers = assign_shared_reads(requests, itemsize)  # (name, box) -> reader, only for shared regions
        me = comm.rank
        asked = [set(w) for w in requests]
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

        from .sources import LoadSource

        if isinstance(storage, LoadSource):  # hook: a foreign format reads its own byte ranges
            storage.read(targets, max_inflight_bytes, recorder)
            return
        with recorder.phase("read") as rec:
            opening = {}
            for t in targets:
                check_name(t.name)
                if t.name not in opening and t.shards:
                    spec = {
                        "driver": "zarr3",
                        "kvstore": storage.kvstore_spec(f"{root.rstrip('/')}/{t.name}"),
                        "fill_missing_data_reads": False,  # a missing chunk file is damage, not zeros
                    }
                    known = meta.codec_preset == CODEC_PRESET  # else: read the array's own zarr.json
                    if known:
                        tm = meta.tensors[t.name]
                        spec["metadata"] = array_metadata(
                            tm.shape,
                            numpy_dtype(tm.dtype),
                            tm.chunk_shape,
                            tm.inner_chunk_shape,
                            tm.compression,
                        )
                    opening[t.name] = ts.open(spec, open=True, assume_metadata=known, context=context())
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
                result = _read_result(fut, name, box, root)
                if sink is not None:
                    sink(result)
                return n

            for t in targets:
                stored = numpy_dtype(meta.tensors[t.name].dtype) if t.shards else None
                for shard in t.shards:
                    n = shard.box.volume * stored.itemsize
                    while inflight and pending + n > max_inflight_bytes:
                        pending -= drain_one()
                    region = stores[t.name][shard.box.slices()]
                    if shard.target is not None and shard.target.dtype == stored:
                        # straight into the destination: no intermediate array, no second copy
                        dest = ts.array(shard.target, copy=False, write=True)
                        inflight.append((dest.write(region), None, t.name, shard.box, n))
                    else:
                        inflight.append((region.read(), shard.sink, t.name, shard.box, n))
                    pending += n
                    total += n
            while inflight:
                drain_one()
            rec["bytes"] = total


# ---------------------------------------------------------------------------------------------- helpers
def record_load_metrics(url: str, recorder: PhaseRecorder, comm: Communicator) -> None:
    """Gather every rank's load phases; the coordinator stores them as ``.metrics-load.json`` (collective)."""
    records = comm.gather_json(recorder.to_json(), dst=0)
    if records is not None:
        storage, root = storage_for(url)
        doc = {"load": {str(r): rec for r, rec in enumerate(records)}}
        _write_sidecar(storage, root, LOAD_METRICS_FILE, doc)


def _write_sidecar(storage: Storage, root: str, key: str, doc: dict[str, Any]) -> None:
    try:
        storage.write(root, key, json.dumps(doc).encode())
    except Exception:  # noqa: BLE001 - metrics never fail a save or a load (read-only storage, ...)
        log.warning("could not write %s/%s", root, key, exc_info=True)


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


def _local_view(job: _Job, name: str, box: Box) -> np.ndarray:
    for held, buf in job.local.get(name, ()):
        if held.contains(box):
            return buf[box.slices(held)]
    raise SaveFailedError(f"rank {job.comm.rank}: tensor {name!r} region {box} was not in the snapshot")


def _declare(tensors: list[SaveTensor]) -> list[TensorDecl]:
    decls = []
    seen = set()
    for t in tensors:
        check_name(t.name)
        if t.name in seen:
            raise ArrayCheckpointError(f"tensor {t.name!r} appears twice in one save request")
        seen.add(t.name)
        dtype = np.dtype(t.dtype)
        decls.append(
            TensorDecl(
                t.name,
                tuple(int(s) for s in t.shape),
                zarr_dtype_name(dtype),
                dtype.itemsize,
                tuple(s.box for s in t.shards),
            )
        )
    return decls


def _decl_json(d: TensorDecl) -> list[Any]:
    return [d.name, list(d.shape), d.dtype, d.itemsize, [[list(b.offsets), list(b.lengths)] for b in d.boxes]]


def _decl_from_json(j: list[Any]) -> TensorDecl:
    return TensorDecl(j[0], tuple(j[1]), j[2], j[3], tuple(Box(tuple(o), tuple(n)) for o, n in j[4]))


def _structure_key(decls: list[TensorDecl], comm: Communicator, options: SaveOptions) -> str:
    h = hashlib.sha1()
    h.update(json.dumps([_decl_json(d) for d in decls]).encode())
    h.update(repr((comm.rank, comm.world_size, options.plan)).encode())
    return h.hexdigest()


def _array_spec(storage: Storage, root: str, layout: Any) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": storage.kvstore_spec(f"{root.rstrip('/')}/{layout.name}"),
        "metadata": array_metadata(
            layout.shape,
            numpy_dtype(layout.dtype),
            layout.chunk_shape,
            layout.inner_chunk_shape,
            layout.compression,
            name=layout.name,  # dimension_names (xarray needs them)
        ),
        # every chunk gets its file, also an all-zero one: a missing file on load then means damage
        "store_data_equal_to_fill_value": True,
    }


def _wait(fut: Any, name: str) -> None:
    try:
        fut.result()
    except Exception as e:  # noqa: BLE001
        raise StorageError(f"tensor {name!r}: write failed: {e}") from e


# tensorstore reports checksum failures as DATA_LOSS "Digest mismatch"; truncation as decode errors.
_CORRUPTION_WORDS = (
    "data_loss",
    "digest",
    "checksum",
    "crc",
    "decod",
    "corrupt",
    "invalid",
    "truncat",
    "is missing",
)


def _read_result(fut: Any, name: str, box: Box, root: str) -> np.ndarray:
    try:
        return fut.result()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        kind = CorruptCheckpointError if any(w in msg.lower() for w in _CORRUPTION_WORDS) else StorageError
        raise kind(f"tensor {name!r}: reading region {box} from {root} failed: {msg}") from e


def _describe(e: BaseException, rank: int) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"rank {rank}: {type(e).__name__}: {e}{where}"


_engine: Engine | None = None
_engine_lock = threading.Lock()


def engine() -> Engine:
    """The process-wide engine."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = Engine()
        return _engine
