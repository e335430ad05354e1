"""The DCP ``StorageWriter`` of :mod:`arraycheckpoint.dcp`: DCP's planner decides which rank writes which item;
:meth:`Writer.prepare_global_plan` fits every tensor's items to a regular chunk grid (one item, one chunk), and
the ranks write through the engine's shard-file encoder; the coordinator writes the metadata and commits."""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import math
import os
import uuid
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..codecs import CODEC_PRESET, array_metadata, numpy_dtype, zarr_dtype_name
from ..errors import ArrayCheckpointError, CheckpointExistsError, PlanError
from ..format.hierarchy import hierarchy_documents
from ..format.metadata import CheckpointMetadata, ObjectMeta, ShardMeta, TensorMeta
from ..format.version import __version__
from ..planning.plan import PlanOptions, split_chunk
from ..planning.regions import Box, chunk_boxes
from ..planning.rules import encode_ranks
from ..sources.dcpkeys import DCP_OBJECT, DISCOVERY_FILE, MAX_BYTE_IO, entry_names, json_value, native_objects
from ..storage import storage_for
from .dcpchunks import ChunkWriter
from .dcpclaim import Claim, follow
from .dcpdiscovery import discovery_document, write_discovery_file, write_late

try:  # the plug-in needs torch; importing arraycheckpoint does not
    from torch.distributed.checkpoint import StorageReader, StorageWriter
except ImportError:  # pragma: no cover - torch absent
    StorageReader = StorageWriter = object  # type: ignore[assignment,misc]


FAILED = "~acp-failed"  # a rank's write failure, carried to the coordinator as its WriteResult


def _failure(result: Any) -> bool:
    """Whether a rank's ``WriteResult`` reports its failure (see :meth:`Writer.write_data`)."""
    return isinstance(result.storage_data, dict) and FAILED in result.storage_data


def fit_chunk_grid(name: str, shape: Sequence[int], boxes: Sequence[Box]) -> tuple[int, ...]:
    """A regular chunk grid in which every box is exactly one chunk, or :class:`PlanError`.

    Along each dimension the chunk is the longest box length; every box must start on a chunk boundary and
    be one chunk long, or end at the array's edge. The boxes must tile the array without overlap.
    """
    shape = tuple(int(s) for s in shape)
    chunk = tuple(max([b.lengths[d] for b in boxes] + [1]) for d in range(len(shape)))
    for b in boxes:
        fits = all(
            o % c == 0 and (n == c or o + n == s) for o, n, c, s in zip(b.offsets, b.lengths, chunk, shape)
        )
        if not fits:
            layout = ", ".join(f"{list(x.offsets)}+{list(x.lengths)}" for x in boxes[:8])
            raise PlanError(
                f"tensor {name!r} of shape {list(shape)}: DCP's items ({layout}{', ...' if len(boxes) > 8 else ''}) "
                f"fit no regular chunk grid with one writer per file (chunk {list(chunk)} does not hold "
                f"{list(b.offsets)}+{list(b.lengths)}); save it with arraycheckpoint.save, which exchanges "
                "fragments of uneven shards, or shard it evenly"
            )
    if len({b.offsets for b in boxes}) != len(boxes) or sum(b.volume for b in boxes) != math.prod(shape):
        raise PlanError(
            f"tensor {name!r} of shape {list(shape)}: DCP's items overlap or leave parts uncovered "
            f"({len(boxes)} items, {sum(b.volume for b in boxes)} of {math.prod(shape)} elements)"
        )
    return chunk


def _box_rules(items: list[tuple[Box, int]], group_of: dict[int, int]) -> tuple[tuple[int, list[Any]], ...]:
    by_rank: dict[int, list[Box]] = {}
    for b, r in items:
        by_rank.setdefault(r, []).append(b)
    return tuple(
        (
            group_of[r],
            ["boxes", [[list(b.offsets), list(b.lengths)] for b in sorted(boxes, key=lambda x: x.offsets)]],
        )
        for r, boxes in sorted(by_rank.items())
    )


def _np_dtype(torch_dtype: Any) -> np.dtype[Any]:
    from ..adapters.torch.tensors import numpy_dtype as torch_to_numpy

    return torch_to_numpy(torch_dtype)


class Writer(StorageWriter):
    """DCP ``StorageWriter`` that stores arraycheckpoint's format at ``path`` (see the module docstring).

    Call order (DCP's): every rank ``reset`` / ``set_up_storage_writer`` / ``prepare_local_plan``; the
    coordinator ``prepare_global_plan`` (chunk grids, one writer per file, the staging location); every rank
    ``write_data`` (its items: whole chunks encoded from the tensor's memory by the engine's shard-file
    writer, edge chunks through tensorstore); the coordinator ``finish`` (array and group
    metadata, ``.acp/metadata.json``, atomic commit). The plug-in never communicates: DCP carries the plans.

    Args:
        path: checkpoint path or URL (as for :func:`arraycheckpoint.save`).
        overwrite: replace a committed checkpoint at ``path`` (True, as DCP's ``FileSystemWriter``: a loop
            saving to one ``checkpoint_id`` works); False refuses with "Checkpoint already exists".
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, overwrite: bool = True) -> None:
        super().__init__()
        self.path = os.fspath(path) if path is not None else None
        self.overwrite = overwrite
        self.is_coordinator = False
        self.rank = 0
        self._global: dict[str, Any] = {}
        self._claim: Claim | None = None
        self._committed = False

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self._release()  # a claim an earlier save took and never finished (it failed between plan and finish)
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._global = {}

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        # DCP calls reset only with a checkpoint_id: a Writer given its path once, whose last save failed after
        # its plan (DCP then calls no finish), gives that save's claim back here
        self._release()
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0))

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        self._release()  # whatever an earlier save of this Writer left (any call order)
        storage, final = storage_for(self._require_path())
        try:
            storage.check_target(final, self.overwrite)
        except CheckpointExistsError as e:
            if self.overwrite or not storage.is_committed(final):  # the user's files there: said as it is
                raise
            raise CheckpointExistsError(f"Checkpoint already exists and overwrite is False: {e}") from None
        token = uuid.uuid4().hex[:12]
        staging = storage.staging_root(final, token)
        # claimed as acp.save claims it, before any rank writes: the lock (a lease on object stores), and,
        # written in place, the old checkpoint's marker and objects removed first (it never reads as committed
        # over this save's files); released by finish, or by this Writer's next save or its collection when
        # the save failed before its finish (dcpclaim)
        storage.save_world = len(plans)
        storage.acquire(final, token)
        self._claim = Claim(self, storage, final, token, staging)
        try:
            return self._plan(plans, self._claim)
        except BaseException:
            self._release()
            raise

    def _plan(self, plans: list[Any], claim: Claim) -> list[Any]:
        from torch.distributed.checkpoint.planner import WriteItemType

        paths: dict[str, Any] = {}
        for p in plans:
            paths.update(p.planner_data or {})
        names = entry_names({i.index.fqn for p in plans for i in p.items}, paths)
        tensors: dict[str, dict[str, Any]] = {}
        for rank, p in enumerate(plans):
            for item in p.items:
                fqn = item.index.fqn
                if item.type == WriteItemType.BYTE_IO:
                    continue
                td = item.tensor_data
                t = tensors.setdefault(
                    fqn,
                    {
                        "shape": tuple(td.size),
                        "dtype": zarr_dtype_name(_np_dtype(td.properties.dtype)),
                        "items": [],
                    },
                )
                t["items"].append((Box(tuple(td.chunk.offsets), tuple(td.chunk.sizes)), rank))
        if len(set(names.values())) != len(names):
            seen: dict[str, str] = {}
            for key, entry in sorted(names.items()):
                if entry in seen:
                    raise PlanError(
                        f"DCP keys {seen[entry]!r} and {key!r} would both be stored as {entry!r}; rename one of "
                        "the state dict keys"
                    )
                seen[entry] = key
        options = PlanOptions()
        for fqn, t in tensors.items():
            per_item = fit_chunk_grid(names[fqn], t["shape"], [b for b, _ in t["items"]])
            itemsize = numpy_dtype(t["dtype"]).itemsize
            # an item larger than a file may be gets several files (divisors keep the item edges on the grid)
            t["chunk"] = split_chunk(per_item, itemsize, options.max_chunk_bytes) if per_item else ()
            t["inner"] = split_chunk(t["chunk"], itemsize, options.inner_chunk_bytes) if per_item else ()
        self._global = {
            "names": names,
            "tensors": tensors,
            "paths": paths,
        }
        out = []
        held = claim.lease_data(len(plans))  # the ranks write under the coordinator's lease (in place)
        for p in plans:
            mine = {i.index.fqn for i in p.items}
            arrays = {
                fqn: [names[fqn], list(t["shape"]), t["dtype"], list(t["chunk"]), list(t["inner"])]
                for fqn, t in tensors.items()
                if fqn in mine
            }
            data = {"staging": claim.staging, "arrays": arrays, "lease": held}
            out.append(dataclasses.replace(p, storage_data=data))
        return out

    def write_data(self, plan: Any, planner: Any) -> Any:
        """Write this rank's items into the staging location.

        A failure does not raise here: DCP would then skip :meth:`finish` and nobody would remove the other
        ranks' files. It is returned as this rank's result instead, and the coordinator's :meth:`finish`
        (which runs once every rank's writes are done) removes the staging location and raises, naming it.
        """
        from torch.distributed.checkpoint.metadata import MetadataIndex
        from torch.distributed.checkpoint.storage import WriteResult
        from torch.futures import Future

        writes: list[tuple[str, Any]] = []
        try:
            results = self._write(plan, planner, writes)
        except Exception as e:  # noqa: BLE001 - every failure reaches finish on the coordinator
            for _fqn, w in writes:  # let issued writes land before the coordinator removes the staging
                try:
                    w.result()
                except Exception:  # noqa: BLE001, S110 - the first error is the one reported
                    pass
            error = f"rank {self.rank}: {type(e).__name__}: {e}"
            results = [WriteResult(MetadataIndex(FAILED), 0, {FAILED: error})]
        fut: Future[list[Any]] = Future()
        fut.set_result(results)
        return fut

    def _write(self, plan: Any, planner: Any, writes: list[tuple[str, Any]]) -> list[Any]:
        staging = plan.storage_data["staging"]
        claim = self._claim if self.is_coordinator else None
        # the coordinator writes on the storage holding the lease (its own expiry stops it); the other ranks
        # follow it, as acp.save's ranks do: a rank frozen past the lease never writes into another save's
        storage, final = (
            (claim.storage, claim.final) if claim is not None else storage_for(self._require_path())
        )
        storage.open_flush(staging)  # before the first write: the flush then sees every write-back error
        try:
            if claim is None:
                final = follow(storage, staging, plan.storage_data.get("lease"), self.rank) or final
            return self._write_items(plan, planner, writes, storage, staging, final)
        finally:
            storage.close_flush(staging)

    def _write_items(
        self, plan: Any, planner: Any, writes: list[tuple[str, Any]], storage: Any, staging: str, final: str
    ) -> list[Any]:
        from torch.distributed.checkpoint.planner import WriteItemType
        from torch.distributed.checkpoint.storage import WriteResult

        from ..engine.shardfile import file_writer

        writer = file_writer(storage, staging)
        chunks = ChunkWriter(storage, staging, plan.storage_data["arrays"], writer, writes)
        results = []
        try:
            for item in plan.items:
                storage.check_lease(final)  # before each write: a save whose lease may be taken over stops
                data = planner.resolve_data(item)
                if item.type == WriteItemType.BYTE_IO:
                    raw = data.getvalue() if isinstance(data, io.BytesIO) else bytes(data)
                    if len(raw) > MAX_BYTE_IO:
                        raise ArrayCheckpointError(
                            f"DCP value {item.index.fqn!r} pickles to {len(raw)} bytes (limit {MAX_BYTE_IO}); "
                            "store large data as tensors"
                        )
                    value = json_value(getattr(planner, "state_dict", {}).get(item.index.fqn))
                    stored = {"b64": base64.b64encode(raw).decode(), "json": value}
                    results.append(WriteResult(item.index, len(raw), stored))
                    continue
                chunk = item.tensor_data.chunk
                box = Box(tuple(chunk.offsets), tuple(chunk.sizes))
                results.append(WriteResult(item.index, chunks.write(item.index.fqn, box, data), None))
            writer.flush()
            for fqn, w in writes:
                try:
                    w.result()
                except Exception as e:  # noqa: BLE001
                    raise ArrayCheckpointError(f"rank {self.rank}: tensor {fqn!r}: write failed: {e}") from e
        finally:
            writer.close()  # every write landed (or failed) before the tensors' memory is given back
        storage.flush(staging)
        return results

    def finish(self, metadata: Any, results: list[list[Any]]) -> None:
        """Coordinator: write the metadata and commit; if any rank failed, remove the staging and raise."""
        claim = self._claim
        if claim is None:
            raise ArrayCheckpointError(f"acp.dcp.Writer.finish without a plan of this Writer ({self.path})")
        storage, final, staging = claim.storage, claim.final, claim.staging
        try:
            failed = [r.storage_data[FAILED] for rank in results for r in rank if _failure(r)]
            if failed:
                storage.abort(staging, final)
                raise ArrayCheckpointError(
                    f"DCP save to {final} failed, nothing was committed and the staged files were removed: "
                    + "; ".join(failed)
                )
            self._committed = False
            try:
                self._commit(results, storage, final, staging)
            except BaseException:
                # once committed nothing is removed (written in place, staging is final: abort deletes it all)
                if not self._committed:
                    storage.abort(staging, final)
                raise
        finally:
            self._release()

    def _release(self) -> None:
        """Give back the claim of the target this save took in :meth:`prepare_global_plan` (once; a failure is
        logged, never raised: the save's own outcome, committed or its error, is what the caller hears)."""
        claim, self._claim = getattr(self, "_claim", None), None
        if claim is not None:
            claim.release()

    def _commit(self, results: list[list[Any]], storage: Any, final: str, staging: str) -> None:
        from ..engine.shardfile import write_documents

        g = self._global
        names = g["names"]
        # format 2 regions: one layout group per writing rank, each tensor's items there as a "boxes" rule
        holders = sorted({r for t in g["tensors"].values() for _b, r in t["items"]})
        group_of = {r: i for i, r in enumerate(holders)}
        tensors = {}
        for fqn, t in g["tensors"].items():
            entry = names[fqn]
            writers = tuple(
                next(r for b, r in t["items"] if b.contains(c)) for c in chunk_boxes(t["shape"], t["chunk"])
            )
            tensors[entry] = TensorMeta(
                entry,
                t["shape"],
                t["dtype"],
                tuple(t["chunk"]),
                tuple(t["inner"]),
                None,
                tuple(
                    ShardMeta(b.offsets, b.lengths, r)
                    for b, r in sorted(t["items"], key=lambda x: x[0].offsets)
                ),
                writers,
                regions=_box_rules(t["items"], group_of),
            )
        stored = [
            (r.index.fqn, r.storage_data)
            for rank in results
            for r in rank
            if isinstance(r.storage_data, dict)
        ]
        byte_io = {k: sd["b64"] for k, sd in stored if isinstance(sd.get("b64"), str)}
        values = {k: sd["json"] for k, sd in stored if sd.get("json") is not None}
        paths = {k: [p if isinstance(p, int) else str(p) for p in v] for k, v in g["paths"].items()}
        dcp_doc = {"version": 1, "keys": names, "paths": paths, "bytes": byte_io}
        objects = native_objects(names, g["paths"], values)
        objects[DCP_OBJECT] = ObjectMeta(DCP_OBJECT, "global", value=dcp_doc)
        world = len(results)
        meta = CheckpointMetadata(
            framework="torch",
            world_size=world,
            tensors=tensors,
            objects=objects,
            topology={"world_size": world, "framework": "torch", "writer": "torch.distributed.checkpoint"},
            library_version=__version__,
            codec_preset=CODEC_PRESET,
            layout_groups=tuple({"meshes": [], "ranks": encode_ranks([r])} for r in holders),
        )
        docs = hierarchy_documents(meta)
        for entry, tm in tensors.items():
            docs[f"{entry}/zarr.json"] = json.dumps(
                array_metadata(
                    tm.shape, numpy_dtype(tm.dtype), tm.chunk_shape, tm.inner_chunk_shape, name=entry
                )
            ).encode()
        docs[DISCOVERY_FILE] = discovery_document()
        # written in place (marker stores): DCP's discovery file follows the commit marker, so a save killed
        # before it leaves no step-N/.metadata that a step scan (torchtitan's _find_load_step) takes for a step
        late = {DISCOVERY_FILE: docs.pop(DISCOVERY_FILE)} if storage.commit_strategy == "marker" else {}
        storage.open_flush(staging)
        try:
            # a save whose lease was (or may soon be) taken over writes no metadata
            storage.verify_lease(final)
            write_documents(storage, staging, dict(sorted(docs.items())))
            if not getattr(storage, "flushes_at_commit", False):  # else the commit's flush covers them
                storage.flush(staging)
            storage.commit(staging, final, self.overwrite)
            self._committed = True  # from here on a failure removes nothing (finish)
            write_late(storage, final, late)
        finally:
            if self._committed:  # the outcome is decided: a failure to let go is logged, never raised
                from ..engine.coordinate import _cleanup

                _cleanup("close_flush", lambda: storage.close_flush(staging), final)
            else:
                storage.close_flush(staging)

    @staticmethod
    def write_discovery_file(path: str | os.PathLike[str]) -> None:
        """Write the DCP discovery file (``.metadata``) of the committed checkpoint at ``path`` again (see
        :func:`~arraycheckpoint.interop.dcpdiscovery.write_discovery_file`)."""
        write_discovery_file(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)

    def _require_path(self) -> str:
        if self.path is None:
            raise ArrayCheckpointError("acp.dcp.Writer needs a path (Writer(path) or checkpoint_id=...)")
        return self.path
