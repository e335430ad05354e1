"""How a save is coordinated: who plans, what travels between ranks, and how the commit is agreed.

Per save, in the background thread of every rank, in this order:

1. *plan*: unless the structure's plan is cached, every rank sends its declarations (what it holds of each
   tensor) to the coordinator (rank 0), which builds and validates the global plan
   (:func:`arraycheckpoint.plan.build_global_plan`) and sends each rank its part;
2. (the save pipeline exchanges fragments and writes its chunks)
3. *commit*: the coordinator gathers every rank's status, writes ``.metadata.json`` and the group
   ``zarr.json`` files, commits through the storage's strategy and broadcasts the outcome, so an error on
   any rank surfaces on every rank.

No bytes of tensor data pass through here.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Any

import numpy as np

from .. import __version__
from .._tscontext import context
from ..codecs import CODEC_PRESET, zarr_dtype_name
from ..collectives import Communicator
from ..errors import ArrayCheckpointError, SaveFailedError
from ..items import SaveTensor
from ..metadata import (
    METADATA_FILE,
    METRICS_FILE,
    CheckpointMetadata,
    ObjectMeta,
    ShardMeta,
    TensorMeta,
    check_name,
)
from ..plan import TensorDecl, build_global_plan, rank_plan_from_json, rank_plan_to_json
from ..regions import Box
from .common import describe, write_sidecar
from .job import CachedPlan, SaveJob, SaveOptions

log = logging.getLogger("arraycheckpoint")

MAX_CACHED_PLANS = 16


class Coordinator:
    """Plans and commits saves; keeps the plan cache (one per process, used from the save thread only)."""

    def __init__(self) -> None:
        self._plans: dict[str, CachedPlan] = {}

    def cached(self, key: str) -> CachedPlan | None:
        return self._plans.get(key)

    def plan(self, job: SaveJob) -> CachedPlan:
        """Coordinator builds the global plan from every rank's declarations, or the cache supplies it."""
        if job.cached is not None:
            return job.cached
        comm = job.comm
        with job.recorder.phase("plan"):
            payload = {"kind": "plan", "decls": [decl_json(d) for d in job.decls]}
            gathered = comm.gather_json(payload, dst=0)
            global_plan = None
            if comm.rank == 0:
                assert gathered is not None
                if any(g.get("kind") != "plan" for g in gathered):
                    raise SaveFailedError("ranks disagree on the checkpoint collective sequence")
                try:
                    global_plan = build_global_plan(
                        [[decl_from_json(d) for d in g["decls"]] for g in gathered], job.options.plan
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
        cached = CachedPlan(rank_plan, global_plan)
        job.cached = cached
        if job.error is None:
            self._plans[job.key] = cached
            while len(self._plans) > MAX_CACHED_PLANS:  # structures that keep changing (dataloader buffers)
                self._plans.pop(next(iter(self._plans)))
        return cached

    def commit(self, job: SaveJob) -> CheckpointMetadata | None:
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
                    outcome["error"] = describe(e, 0)
            if outcome["error"]:
                _cleanup("abort", lambda: job.storage.abort(job.staging, job.final), job.final)
            else:
                # the metadata was written inside the commit phase, so the complete record (commit included)
                # goes to a sidecar after it; best effort: the checkpoint is committed either way
                save = {str(r): s.get("metrics", {}) for r, s in enumerate(statuses)}
                save["0"] = job.recorder.to_json()
                write_sidecar(job.storage, job.final, METRICS_FILE, {"save": save})
            # a failed release must not skip the broadcast: every rank waits for the outcome
            _cleanup("release", lambda: job.storage.release(job.final, job.token), job.final)
        outcome = comm.broadcast_json(outcome, src=0)
        if outcome["error"]:
            raise SaveFailedError(f"save to {job.final} failed and was not committed: {outcome['error']}")
        return meta

    def _write_metadata(self, job: SaveJob, statuses: list[dict[str, Any]]) -> CheckpointMetadata:
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


def _cleanup(what: str, fn: Any, final: str) -> None:
    """abort()/release() after the outcome is known: their failure is logged, never raised (the outcome, with
    the save's own error, still reaches every rank; a stale lock is removed by CheckpointManager cleanup)."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        log.warning(
            "storage %s of %s failed after the save's outcome was decided", what, final, exc_info=True
        )


def declare(tensors: list[SaveTensor]) -> list[TensorDecl]:
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


def decl_json(d: TensorDecl) -> list[Any]:
    return [d.name, list(d.shape), d.dtype, d.itemsize, [[list(b.offsets), list(b.lengths)] for b in d.boxes]]


def decl_from_json(j: list[Any]) -> TensorDecl:
    return TensorDecl(j[0], tuple(j[1]), j[2], j[3], tuple(Box(tuple(o), tuple(n)) for o, n in j[4]))


def structure_key(decls: list[TensorDecl], comm: Communicator, options: SaveOptions) -> str:
    h = hashlib.sha1()
    h.update(json.dumps([decl_json(d) for d in decls]).encode())
    h.update(repr((comm.rank, comm.world_size, options.plan)).encode())
    return h.hexdigest()
