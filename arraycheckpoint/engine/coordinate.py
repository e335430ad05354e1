"""How a save is coordinated: who plans, what travels between ranks, and how the commit is agreed.

Per save, in the background thread of every rank, in this order:

0. *agree* (before the snapshot, in the caller's thread): one fixed-size all-reduce decides, identically on
   every rank, whether the cached plan is reused, whether every rank declared the same thing, and whether
   any rank failed to declare (:meth:`Coordinator.agree`);
1. *plan*: a rank declares each tensor by its layout rule (:mod:`arraycheckpoint.planning.rules`). When every rank's
   declaration is the same (FSDP2, DDP), each rank plans by itself with no collective. Otherwise the
   coordinator (rank 0) gathers 16-byte digests, then one declaration per distinct digest, and broadcasts
   the distinct declarations once; every rank then plans (:mod:`arraycheckpoint.planning.groupplan`: deterministic,
   the same plan everywhere) and derives its own work. No rank receives O(world size x payload) bytes;
2. (the save pipeline writes the chunks this rank holds; only flat ranges (FSDP1) exchange fragments first)
3. *commit*: the coordinator gathers every rank's status, writes the metadata, the control node and the
   group ``zarr.json`` files (:mod:`arraycheckpoint.format.hierarchy`), commits through the storage's strategy and
   broadcasts the outcome, so an error on any rank surfaces on every rank.

No bytes of tensor data pass through here. The plan id every rank executed is compared at commit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import zlib
from collections import defaultdict
from typing import Any

import numpy as np

from ..checks.bounds import MAX_METADATA_BYTES, load_json_bounded
from ..codecs import CODEC_PRESET, zarr_dtype_name
from ..errors import ArrayCheckpointError, MetadataError, SaveFailedError, StalledRankError
from ..format.hierarchy import hierarchy_documents
from ..format.metadata import (
    METRICS_FILE,
    CheckpointMetadata,
    LazyShards,
    ObjectMeta,
    TensorMeta,
    Writers,
    check_name,
    check_name_tree,
)
from ..format.version import __version__
from ..planning.grids import world_mesh, world_split
from ..planning.groupplan import CompactPlan, Decl, TensorRule, build_compact_plan, rule_json
from ..planning.groupplan import rank_plan as rank_plan_of
from ..planning.items import SaveRequest, SaveTensor
from ..planning.rules import Mesh, digest, encode_ranks, rule_boxes
from ..runtime.collectives import Communicator
from ..runtime.workers import busy
from . import saveargs, shardfile
from .common import describe, local_ranks_per_host, plan_options, write_sidecar
from .job import CachedPlan, SaveJob, SaveOptions

log = logging.getLogger("arraycheckpoint")

MAX_CACHED_PLANS = 16
METRICS_SAMPLE = 64  # ranks whose phase records reach the coordinator (all of them in worlds up to 64)


class Coordinator:
    """Plans and commits saves; keeps the plan cache (one per process, used from the save thread only)."""

    def __init__(self) -> None:
        self._plans: dict[str, CachedPlan] = {}

    def agree(self, job: SaveJob) -> None:
        """The one collective before the snapshot: do all ranks reuse the same cached plan, do all ranks hold
        identical declarations (then each plans alone), did any rank fail to declare?

        A fixed-size all-reduce: ``[ok, d, -d, c, -c, s, -s, t, -t, h, -h]`` where ``d`` is the declaration
        digest, ``c`` the cached plan's id (-1 without one), ``s`` the digest of the stacked per-rank slots
        (when it differs, ``job.unstack``: every rank saves per-rank arrays instead and the declarations are
        gathered; a cached plan agreed on with ``s`` differing was planned for those per-rank arrays, since a
        rank's cache key covers its stacked shapes), ``t`` the digest of the per-rank templates (when it
        differs, ``job.untemplate``: every rank saves per-rank documents and no leaf rows, see
        :mod:`arraycheckpoint.format.rankdoc`; the plan is then gathered, never cached nor taken from the cache, since
        a cache key does not cover the templates) and ``h`` this rank's ranks-per-host
        (:func:`local_ranks_per_host`, 0 when unknown): the plan uses it as the host map only when every rank
        reports the same value, else no host map on every rank (logged; chunks are written by ranks holding
        them, so the host map changes no decision of the plan today); four more values carry digests of the
        save arguments and of the global objects (:mod:`.saveargs`: differing arguments skip the save on every
        rank, naming them; differing global values warn). Every rank reaches the same decision,
        so the collectives that follow are the same on every rank: a structure change on one rank replans
        everywhere, never hangs.
        """
        cached = self._plans.get(job.key) if job.decl is not None else None
        d = _as_int(job.decl_digest) if job.decl is not None else 0
        c = cached.plan_hash if cached is not None else -1
        s = _as_int(job.stack_digest)
        t = _as_int(job.template_digest)
        h = local_ranks_per_host(job.comm.rank, job.comm.world_size)
        agreed = job.comm.all_reduce_min(
            [int(job.decl is not None), d, -d, c, -c, s, -s, t, -t, h, -h, *saveargs.agreement_values(job)]
        )
        ok, dmin, dmax_neg, cmin, cmax_neg, smin, smax_neg, tmin, tmax_neg, hmin, hmax_neg = agreed[:11]
        job.ranks_per_host = hmin if hmin == -hmax_neg else 0
        if hmin != -hmax_neg and job.comm.rank == 0:
            log.warning(
                "ranks disagree on LOCAL_WORLD_SIZE (from %d to %d, 0: unset or not contiguous): planning "
                "without a host map",
                hmin,
                -hmax_neg,
            )
        # stacked per-rank arrays (arraycheckpoint.format.perrank) need every rank's rows alike; else all fall back
        job.unstack = bool(ok) and smin != -smax_neg
        # per-rank documents as one template (arraycheckpoint.format.rankdoc) need every rank's template alike
        job.untemplate = bool(ok) and tmin != -tmax_neg
        if not ok:
            job.mode = "skip"  # a rank could not declare: it reports why at commit, nobody plans or writes
        elif cmin >= 0 and cmin == -cmax_neg and not job.untemplate:
            job.mode, job.cached = "cached", cached
        elif dmin == -dmax_neg and not job.unstack and not job.untemplate:
            job.mode = "local"
        else:
            job.mode = "gather"
        saveargs.check_agreement(job, agreed[11:])  # differing save arguments: "skip", named on every rank

    def plan(self, job: SaveJob) -> CachedPlan | None:
        """This rank's part of the plan (None when the save is skipped); see :meth:`agree` for the path."""
        if job.mode == "skip":
            return None
        if job.mode == "cached":
            assert job.cached is not None
            return job.cached
        comm, world = job.comm, job.comm.world_size
        with job.recorder.phase("plan") as rec:
            if job.mode == "local":
                # every rank declared the same thing: each derives the whole plan, no collective at all
                groups = [(job.decl, tuple(range(world)))]
            else:
                groups, rec["bytes"] = _gather_declarations(job)
            compact = build_compact_plan(groups, world, plan_options(job.options.plan, job.ranks_per_host))
            rank_plan = rank_plan_of(compact, comm.rank)
        cached = CachedPlan(rank_plan, compact, _as_int(bytes.fromhex(compact.plan_id)))
        job.cached = cached
        if job.error is None and not job.untemplate:  # the key does not cover the agreement on templates
            self._plans[job.key] = cached
            while len(self._plans) > MAX_CACHED_PLANS:  # structures that keep changing (dataloader buffers)
                self._plans.pop(next(iter(self._plans)))
        return cached

    def commit(self, job: SaveJob) -> CheckpointMetadata | None:
        """Gather statuses; the coordinator writes metadata and commits; the outcome reaches every rank.

        Two collectives when the save succeeds: one gather of each rank's verdict, executed plan id and
        status (:meth:`Communicator.gather_with_values`), and one broadcast of the outcome: its length alone
        (0) when the checkpoint was committed, the error text otherwise."""
        comm = job.comm
        # did every rank succeed, and did all execute the same plan? (fixed size, beside each status)
        pid = job.cached.plan_hash if job.cached else -1
        payload = status_payload(
            job.request, job.error, job.recorder.to_json(), comm.rank, comm.world_size, job.storage.stalled()
        )
        try:
            gathered = comm.gather_with_values([int(job.error is None), pid], payload, dst=0)
        except StalledRankError as e:  # rank 0 commits only with every rank's status in hand
            raise StalledRankError(f"{e}; {_not_committed(job) if comm.rank == 0 else _unknown(job)}") from e
        error = ""
        meta = None
        if comm.rank == 0:
            assert gathered is not None
            rows, raw = gathered
            statuses, errors = _read_statuses(raw)
            if not errors and not rows[:, 0].all():
                errors = ["a rank failed without saying why"]
            if not errors and rows[:, 1].min() != rows[:, 1].max():
                errors = [
                    "ranks executed different save plans: the state structure changed on some ranks but not "
                    "others between saves"
                ]
            if errors:
                error = "; ".join(dict.fromkeys(str(e) for e in errors))  # one line per distinct error
            else:
                try:
                    # named at interpreter exit if the file system stalls here (runtime.workers)
                    with job.recorder.phase("commit"):
                        with busy(f"{job.staging}/.acp (the metadata)"):
                            job.storage.verify_lease(job.final)  # a save taken over writes no metadata
                            meta = self._write_metadata(job, statuses)
                        with busy(f"{job.final} (its commit)", committing=True):
                            job.storage.commit(job.staging, job.final, job.options.overwrite)
                except Exception as e:  # noqa: BLE001
                    error = describe(e, 0)
            if error:
                _cleanup("abort", lambda: job.storage.abort(job.staging, job.final), job.final)
            else:
                # the metadata was written inside the commit phase, so the complete record (commit included)
                # goes to a sidecar after it; best effort: the checkpoint is committed either way
                save = {str(r): s["metrics"] for r, s in enumerate(statuses) if "metrics" in s}
                save["0"] = job.recorder.to_json()
                write_sidecar(job.storage, job.final, METRICS_FILE, {"save": save})
            stalled = [(r, s["stalled"]) for r, s in enumerate(statuses) if r and s.get("stalled")]
            if (
                stalled
            ):  # it may land after this save ended: the lock stays, so no later save is corrupted by it
                log.warning(
                    "the lock of %s is kept: a request of rank %d (%s) timed out and may still land there; the "
                    "next save there is refused until a manager's start-up cleanup (or a hand) removes the lock",
                    job.final, *stalled[0],
                )  # fmt: skip
            else:  # a failed release must not skip the broadcast: every rank waits for the outcome
                _cleanup("release", lambda: job.storage.release(job.final, job.token), job.final)
        try:
            outcome = comm.broadcast_bytes(error.encode() if comm.rank == 0 else None, src=0)
        except StalledRankError as e:
            if comm.rank != 0:
                raise StalledRankError(f"{e}; {_unknown(job)}") from e
            if error:
                raise StalledRankError(f"{e}; {_not_committed(job)}: {error}") from e
            raise StalledRankError(
                f"save to {job.final} was committed (every rank had written its part and reported success), "
                f"but its outcome did not reach every rank: {e}"
            ) from e
        if outcome:
            raise SaveFailedError(
                f"save to {job.final} failed and was not committed: {outcome.decode(errors='replace')}"
            )
        return meta

    def _write_metadata(self, job: SaveJob, statuses: list[dict[str, Any]]) -> CheckpointMetadata:
        plan = job.cached.compact if job.cached else None
        assert plan is not None, "coordinator lost its plan"
        meta = build_metadata(plan, job.request, statuses)
        shardfile.write_documents(job.storage, job.staging, hierarchy_documents(meta))
        if not getattr(job.storage, "flushes_at_commit", False):  # else its commit's flush covers them
            job.storage.flush(job.staging)
        return meta


def _not_committed(job: SaveJob) -> str:
    return f"save to {job.final} was not committed"


def _unknown(job: SaveJob) -> str:
    """A rank other than the coordinator that lost the commit's collectives cannot know the outcome."""
    return (
        f"this rank did not learn whether rank 0 committed the save to {job.final} (it commits once every "
        "rank reported success): it was committed only if it loads"
    )


def _cleanup(what: str, fn: Any, final: str) -> None:
    """abort()/release() after the outcome is known: their failure is logged, never raised (the outcome, with
    the save's own error, still reaches every rank; a stale lock is removed by CheckpointManager cleanup)."""
    try:
        fn()
    except Exception:  # noqa: BLE001
        log.warning(
            "storage %s of %s failed after the save's outcome was decided", what, final, exc_info=True
        )


def _read_statuses(raw: list[bytes]) -> tuple[list[dict[str, Any]], list[str]]:
    """Every rank's status (:func:`status_payload`) as rank 0 received it, and the errors they report. A
    status that is not what a rank sends (not JSON, not an object, an error that is not text, objects or
    metrics that are not objects) is an error naming the rank, never an exception out of the commit: rank 0
    must still abort and broadcast the outcome, or the other ranks wait for it until their timeout."""
    statuses: list[dict[str, Any]] = []
    errors: list[str] = []
    for rank, b in enumerate(raw):
        try:  # bounded like the metadata it becomes part of (a deep one raised RecursionError)
            s = load_json_bounded(b, max_bytes=MAX_METADATA_BYTES, what=f"rank {rank}'s status") if b else {}
        except MetadataError:
            s = None
        if not (
            isinstance(s, dict)
            and (s.get("error") is None or isinstance(s["error"], str))
            and isinstance(s.get("objects", {}), dict)
            and isinstance(s.get("metrics", {}), dict)
            and (s.get("stalled") is None or isinstance(s["stalled"], str))
        ):
            errors.append(f"rank {rank} sent a malformed commit status ({len(b)} bytes: {bytes(b[:80])!r})")
            s = {}
        elif s.get("error"):
            errors.append(s["error"])
        statuses.append(s)
    return statuses, errors


def status_payload(
    request: SaveRequest,
    error: str | None,
    metrics: dict[str, Any],
    rank: int,
    world: int,
    stalled: str | None = None,
) -> bytes:
    """This rank's commit status for the coordinator: text only from ranks with something to say (an error,
    per-rank objects, a metrics sample, or a request that timed out and may still land: ``stalled``), else
    nothing. Per-rank objects in template form are agreed and stored from the coordinator's own request
    (:mod:`arraycheckpoint.format.rankdoc`): they never travel."""
    rank_objects = {o.name: o.value for o in request.objects if o.scope == "rank" and o.rows is None}
    sampled = rank % max(1, world // METRICS_SAMPLE) == 0
    status: dict[str, Any] = {"error": error, "objects": rank_objects, "metrics": metrics}
    if stalled:
        status["stalled"] = stalled[:1000]
    return _dumps(status) if error or rank_objects or sampled or stalled else b""


def build_metadata(
    plan: CompactPlan, request: SaveRequest, statuses: list[dict[str, Any]]
) -> CheckpointMetadata:
    """The checkpoint's metadata: the plan's decisions and rules, objects (per-rank templates from the
    coordinator's ``request``, other per-rank values from ``statuses``), per-rank metrics."""
    group_index = {id(d): i for i, (d, _r) in enumerate(plan.groups)}
    stacked = {t.name for t in request.tensors if t.fallback is not None}  # rows of stacked per-rank arrays
    stacked.update(n for o in request.objects if o.rows is not None for n in o.rows.values())
    tensors = {}
    rules: dict[tuple[int, Any], tuple[int, list[Any]]] = {}  # (group, rule) -> its JSON form, made once
    shared: dict[tuple[Any, ...], Any] = {}  # a writer array shared by tensors (a class): one Writers
    for name, td in plan.tensors.items():
        layout = td.layout
        found = []
        for d, t in plan.contributions(name):
            r = rules.get((id(d), t.rule))
            if r is None:
                r = rules[(id(d), t.rule)] = (group_index[id(d)], rule_json(t.rule))
            found.append(r)
        regions = tuple(found)
        tensors[name] = TensorMeta(
            name=name,
            shape=layout.shape,
            dtype=layout.dtype,
            chunk_shape=layout.chunk_shape,
            inner_chunk_shape=layout.inner_chunk_shape,
            compression=layout.compression,
            shards=LazyShards(name, layout.shape, regions, plan.groups),
            # derived writers are not stored (format 7): one shared array per class, never a list per chunk
            writers=_writers_of(td, shared),
            regions=regions,
            rank_rows=name in stacked,
            pack=td.pack,
        )
    objects: dict[str, ObjectMeta] = {}
    for o in request.objects:
        if o.scope == "global":
            objects[o.name] = ObjectMeta(o.name, "global", value=o.value)
        elif o.rows is not None:  # agreed by every rank (arraycheckpoint.format.rankdoc): stored once
            objects[o.name] = ObjectMeta(o.name, "rank", template=o.value, rows=dict(o.rows))
    objects.update(_per_rank_objects(objects, statuses))
    metrics = {"save": {str(r): s["metrics"] for r, s in enumerate(statuses) if "metrics" in s}}
    return CheckpointMetadata(
        framework=request.framework,
        world_size=plan.world,
        tensors=tensors,
        objects=objects,
        step=request.step,
        topology=request.topology,
        roles=request.roles,
        metrics=metrics,
        library_version=__version__,
        codec_preset=CODEC_PRESET,
        layout_groups=tuple(
            {"meshes": [m.to_json() for m in d.meshes], "ranks": encode_ranks(r)} for d, r in plan.groups
        ),
    )


def _per_rank_objects(
    objects: dict[str, ObjectMeta], statuses: list[dict[str, Any]]
) -> dict[str, ObjectMeta]:
    """Per-rank objects not in template form, from the ranks' statuses: one ``rank -> value`` mapping per
    name, filled in one pass (O(world) time and memory; a copy of the mapping per rank was O(world^2) at
    10,000 ranks whose per-rank objects defeat the template). An entry of the same name already in
    ``objects`` keeps its per-rank values, as before."""
    per_rank: dict[str, dict[int, Any]] = {}
    for rank, s in enumerate(statuses):
        for name, value in s.get("objects", {}).items():
            got = per_rank.get(name)
            if got is None:
                prev = objects.get(name)
                got = per_rank[name] = dict(prev.per_rank) if prev else {}
            got[rank] = value
    return {name: ObjectMeta(name, "rank", per_rank=values) for name, values in per_rank.items()}


def _writers_of(td: Any, shared: dict[tuple[Any, ...], Any]) -> Any:
    """The metadata's writers of a tensor decision: derived (format 7: one shared array per class, never a
    list per chunk) or listed; one object per writer array the plan shares between tensors (immutable)."""
    key = (id(td.writers), td.derived, td.shift)
    got = shared.get(key)
    if got is None:
        got = shared[key] = (
            Writers(td.writers, derived=True, shift=td.shift) if td.derived else tuple(td.writers.tolist())
        )
    return got


def declare(tensors: list[SaveTensor], rank: int, world: int | None = None) -> Decl:
    """This rank's declaration: one rule per tensor (a checked mesh or range rule, replica, or boxes).

    With ``world``, a tensor given as one box that is this rank's ``torch.chunk`` part of a ``world``-way
    split along one axis (a sharded dict built by hand, no process grid) is declared as a mesh rule on the
    world's 1-D grid (:func:`~arraycheckpoint.planning.grids.world_split`): every such rank then declares the
    same. Bad input (unsafe or duplicate names) raises here; the caller reports it through the agreement.
    """
    meshes: list[Mesh] = []
    out = []
    seen = set()
    dtypes: dict[Any, tuple[str, int]] = {}  # per distinct dtype: its zarr name and item size, checked once
    check_name_tree(t.name for t in tensors)  # model/a and model/a/b: an array inside an array never loads
    for t in tensors:
        check_name(t.name)
        if t.name in seen:
            raise ArrayCheckpointError(f"tensor {t.name!r} appears twice in one save request")
        seen.add(t.name)
        known = dtypes.get(t.dtype)
        if known is None:
            dtype = np.dtype(t.dtype)
            known = dtypes[t.dtype] = (zarr_dtype_name(dtype), dtype.itemsize)
        shape = tuple(int(s) for s in t.shape)
        boxes = tuple(s.box for s in t.shards if s.box.volume)
        rule: tuple[Any, ...]
        if t.rule is not None and t.rule[0] in ("mesh", "range"):
            mesh = t.rule[1]
            if mesh not in meshes:
                meshes.append(mesh)
            rule = (t.rule[0], meshes.index(mesh), *_rule_args(t.rule))
            if rank not in mesh.positions or set(rule_boxes(shape, rule, meshes, rank)) != set(boxes):
                rule = ("boxes", boxes)  # the rule does not describe what this rank holds: say it plainly
        elif len(boxes) == 1 and boxes[0].lengths == shape and not any(boxes[0].offsets):
            rule = ("replica",)  # the whole (non-empty) tensor
        elif world is not None and (axis := world_split(shape, boxes, rank, world)) is not None:
            mesh = world_mesh(world)  # the box is exactly this rank's part (checked): no check of the rule
            if mesh not in meshes:
                meshes.append(mesh)
            rule = ("mesh", meshes.index(mesh), (axis,))
        else:
            rule = ("boxes", boxes)
        out.append(TensorRule(t.name, shape, known[0], known[1], rule))
    used = sorted({r[1] for r in (x.rule for x in out) if r[0] in ("mesh", "range")})
    if len(used) != len(meshes):  # drop meshes no rule kept
        remap = {old: new for new, old in enumerate(used)}
        out = [
            TensorRule(x.name, x.shape, x.dtype, x.itemsize, (x.rule[0], remap[x.rule[1]], *x.rule[2:]))
            if x.rule[0] in ("mesh", "range")
            else x
            for x in out
        ]
        meshes = [meshes[i] for i in used]
    return Decl(tuple(meshes), tuple(out))


def _rule_args(rule: tuple[Any, ...]) -> tuple[Any, ...]:
    """What follows the mesh in an adapter's rule: placements (mesh) or offset and total (range)."""
    if rule[0] == "mesh":
        return (tuple(int(d) for d in rule[2]),)
    return (int(rule[2]), int(rule[3]))


def structure_key(decl_digest: bytes, comm: Communicator, options: SaveOptions) -> str:
    """The plan-cache key of this rank's structure (its declaration, world and planning options)."""
    h = hashlib.sha1(decl_digest)
    # the launcher's host layout is fixed for the process; it is part of the key all the same
    h.update(repr((comm.rank, comm.world_size, options.plan, os.environ.get("LOCAL_WORLD_SIZE"))).encode())
    return h.hexdigest()


def declaration_digest(decl: Decl, comm: Communicator, options: SaveOptions) -> bytes:
    """16 bytes standing for the declaration (equal on ranks that declared the same thing)."""
    return digest([decl.to_json(), comm.world_size, repr(options.plan)])


def _as_int(b: bytes) -> int:
    return int.from_bytes(b[:8], "little") >> 2  # non-negative, fits int64 with room for negation


def _gather_declarations(job: SaveJob) -> tuple[list[tuple[Decl, tuple[int, ...]]], int]:
    """Distinct declarations to every rank: digests to the coordinator (16 bytes per rank), full
    declarations from one representative per digest, then one compressed broadcast of the distinct
    declarations and each rank's group. Returns the groups and the bytes this rank received."""
    comm = job.comm
    me = comm.rank
    got = 0
    digests = comm.gather_bytes(job.decl_digest, dst=0)
    reps_raw = None
    if me == 0:
        assert digests is not None
        got += sum(len(x) for x in digests)
        reps, group_of = group_digests(digests)
        reps_raw = np.asarray(reps, dtype=np.int32).tobytes()
    reps_raw = comm.broadcast_bytes(reps_raw, 0)
    got += len(reps_raw) if me else 0
    reps = np.frombuffer(reps_raw, dtype=np.int32).tolist()
    payload = zlib.compress(_dumps(job.decl.to_json())) if me in set(reps) else b""
    decls = comm.gather_bytes(payload, dst=0)
    blob = None
    if me == 0:
        assert decls is not None
        got += sum(len(x) for x in decls)
        blob = pack_groups([decls[r] for r in reps], group_of)
    blob = comm.broadcast_bytes(blob, 0)
    got += len(blob) if me else 0
    return unpack_groups(blob), got


def group_digests(digests: list[bytes]) -> tuple[list[int], np.ndarray]:
    """Coordinator: one representative rank per distinct digest, and every rank's group index."""
    first: dict[bytes, int] = {}
    reps: list[int] = []
    group_of = np.zeros(len(digests), dtype=np.int32)
    for r, dg in enumerate(digests):
        g = group_of[r] = first.setdefault(dg, len(first))
        if g == len(reps):
            reps.append(r)
    return reps, group_of


def pack_groups(rep_payloads: list[bytes], group_of: np.ndarray) -> bytes:
    """Coordinator: the compressed broadcast of the distinct declarations and each rank's group."""
    try:
        parsed = [json.loads(zlib.decompress(p)) for p in rep_payloads]
        return zlib.compress(_dumps({"decls": parsed, "group_of": group_of.tolist()}))
    except Exception as e:  # noqa: BLE001 - a malformed declaration fails the save on every rank
        return zlib.compress(_dumps({"error": f"a declaration could not be read: {e}"}))


def unpack_groups(blob: bytes) -> list[tuple[Decl, tuple[int, ...]]]:
    """Every rank: the groups of the broadcast (planning then runs identically everywhere)."""
    doc = json.loads(zlib.decompress(blob))
    if "error" in doc:
        raise SaveFailedError(f"planning failed: {doc['error']}")
    members: dict[int, list[int]] = defaultdict(list)
    for r, g in enumerate(doc["group_of"]):
        members[g].append(r)
    return [(Decl.from_json(d), tuple(members[g])) for g, d in enumerate(doc["decls"])]


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()
