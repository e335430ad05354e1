"""Pure save planning: from every rank's local regions to one writer per stored chunk.

No I/O and no communication happen here; the engine gathers the local plans, calls
:func:`build_global_plan` on the coordinator and hands each rank its :class:`RankPlan`. Everything is
deterministic, so the same inputs give the same plan on any machine.

Steps, per tensor:

1. check that every rank agrees on global shape and dtype;
2. deduplicate identical regions (replicas) and validate the rest: in bounds, no partial overlap, full coverage;
3. pick a regular chunk grid that nests in the saved regions (:mod:`arraycheckpoint.planning.chunking`): no chunk
   straddles two regions, none is above ``max_chunk_bytes``; one chunk is one stored file (the small ones
   go into their writer's packs);
4. assign one writer per chunk among the ranks holding it, replicas by worst fit on bytes (largest chunk
   first, :mod:`arraycheckpoint.planning.owners`): no tensor byte travels;
5. only a grid of flat runs over flat ranges (FSDP1) straddles regions: the writer of such a chunk receives
   the other sides of the rank boundaries in it (one batched exchange), at most ``range_move_share`` of the
   save's bytes.

There is one planner: :func:`build_global_plan` states each rank's regions as box rules and runs the compact
planner (:func:`arraycheckpoint.planning.groupplan.build_compact_plan`), then lists every rank's work.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from ..errors import PlanError
from .chunking import split_chunk
from .regions import Box, intersect

__all__ = ["split_chunk"]  # re-exported (its home is arraycheckpoint.planning.chunking)


@dataclass(frozen=True)
class TensorDecl:
    """What one rank holds of one tensor (structure only, no data)."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # zarr v3 data_type name
    itemsize: int
    boxes: tuple[Box, ...]


@dataclass(frozen=True)
class PlanOptions:
    """Knobs of the chunk grid. Sizes are bytes of one stored chunk file / one inner (read) chunk.

    Chunk grids nest in the saved regions, so a save moves no tensor bytes between ranks; no chunk file holds
    more than ``max_chunk_bytes``. ``min_chunk_bytes`` is the target file size: chunk files below it go into
    their writer's packs (about that size each), which bound the number of files by the checkpoint's bytes
    (about bytes / 16 MiB plus a pack or two per rank) instead of tensors x ranks.
    """

    min_chunk_bytes: int = 16 << 20
    max_chunk_bytes: int = 64 << 20
    inner_chunk_bytes: int = 1 << 20
    compression: str | None = None
    # where ranks are (torchrun's LOCAL_WORLD_SIZE, or a host id per rank): recorded only. Chunks are written
    # by ranks that hold them, so no placement decision depends on hosts any more
    ranks_per_host: int = 0
    host_of: tuple[int, ...] = ()
    # replicated chunks are cut small enough that worst fit over their holders keeps every rank's written
    # bytes within this factor of the mean (arraycheckpoint.planning.owners.replica_caps)
    write_balance: float = 1.05
    # arrays one rank writes whole, uncompressed and of at most this many stored bytes go into that rank's
    # packs (arraycheckpoint.planning.packing: ZIP files every zarr reader opens), about ``min_chunk_bytes`` each,
    # instead of a directory and two files apiece; 0 keeps every array in its own directory
    pack_array_bytes: int = 2 << 20
    # flat ranges (FSDP1's flat parameters): chunks are flat runs small enough that the rank-boundary parts
    # that travel are at most this share of the save's bytes (arraycheckpoint.planning.chunking.choose_runs)
    range_move_share: float = 0.01


@dataclass(frozen=True)
class Piece:
    """A part of a chunk and the rank that supplies its bytes."""

    box: Box
    src: int


@dataclass(frozen=True)
class ChunkWrite:
    """One stored chunk file, written by exactly one rank from the listed pieces."""

    name: str
    chunk: Box
    pieces: tuple[Piece, ...]


@dataclass(frozen=True)
class ArrayLayout:
    """Everything needed to create or open a stored array."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    chunk_shape: tuple[int, ...]
    inner_chunk_shape: tuple[int, ...]
    compression: str | None


@dataclass(frozen=True)
class Transfer:
    """A fragment that rank ``src`` sends to rank ``dst`` for one of ``dst``'s chunks."""

    name: str
    box: Box
    src: int
    dst: int


@dataclass(frozen=True)
class RankPlan:
    """The part of the global plan one rank executes."""

    rank: int
    layouts: tuple[ArrayLayout, ...]  # every array this rank writes chunks or metadata of
    create: tuple[str, ...]  # arrays whose zarr.json this rank writes
    writes: tuple[ChunkWrite, ...]
    sends: tuple[Transfer, ...]
    recvs: tuple[Transfer, ...]
    exchange: bool = False  # whether any rank sends fragments (every rank enters the all-to-all then)
    plan_id: str = ""  # digest of the whole global plan; ranks compare it at commit
    # (pack key, member arrays) of the packs this rank writes; members are not in ``create`` (their
    # zarr.json goes into the pack)
    packs: tuple[tuple[str, tuple[str, ...]], ...] = ()

    def needed_boxes(self) -> dict[str, list[Box]]:
        """Regions of local data this rank reads during the save (its own pieces and what it sends)."""
        need: dict[str, list[Box]] = defaultdict(list)
        for w in self.writes:
            need[w.name].extend(p.box for p in w.pieces if p.src == self.rank)
        for t in self.sends:
            need[t.name].append(t.box)
        return need


@dataclass(frozen=True)
class TensorPlan:
    """The global decision for one tensor."""

    layout: ArrayLayout
    regions: tuple[tuple[Box, int], ...]  # unique saved regions and the rank credited with them
    writers: tuple[int, ...]  # per chunk, row-major
    creator: int
    pack: str | None = (
        None  # the pack holding the array (arraycheckpoint.planning.packing), None: its own directory
    )


@dataclass(frozen=True)
class GlobalPlan:
    """The coordinator's plan: per tensor decisions and per rank work lists."""

    tensors: dict[str, TensorPlan]
    ranks: tuple[RankPlan, ...]


def build_global_plan(
    local: Sequence[Sequence[TensorDecl]], options: PlanOptions | None = None
) -> GlobalPlan:
    """Combine every rank's local declarations into a validated global plan (every rank's work listed).

    Each rank's regions become box rules of one declaration per rank, planned by
    :func:`arraycheckpoint.planning.groupplan.build_compact_plan` (the one planner); this lists every rank's
    :class:`RankPlan`, for tests and tools at small worlds.

    Args:
        local: ``local[r]`` lists the tensors rank ``r`` holds (ranks with nothing pass an empty list).
        options: chunk-grid knobs.

    Raises:
        PlanError: ranks disagree on a tensor's shape/dtype; a region is out of bounds; regions overlap
            partially; or the regions do not cover a tensor entirely.
    """
    from .groupplan import Decl, TensorRule, build_compact_plan, rank_plan  # groupplan imports this module

    groups = [
        (
            Decl((), tuple(TensorRule(d.name, d.shape, d.dtype, d.itemsize, ("boxes", d.boxes)) for d in e)),
            (r,),
        )
        for r, e in enumerate(local)
    ]
    compact = build_compact_plan(groups, len(local), options)
    tensors = {
        name: TensorPlan(d.layout, compact.regions(name), tuple(d.writers.tolist()), d.creator, d.pack)
        for name, d in sorted(compact.tensors.items())
    }
    return GlobalPlan(tensors, tuple(rank_plan(compact, r) for r in range(len(local))))


def _validate_cover(name: str, shape: tuple[int, ...], boxes: Sequence[Box]) -> None:
    """Distinct regions must not overlap and must cover the tensor exactly."""
    ordered = sorted(boxes, key=lambda b: b.offsets)
    for i, a in enumerate(ordered):
        for j in range(i + 1, len(ordered)):  # by index: a slice per region would make this quadratic
            b = ordered[j]
            if a.ndim and b.offsets[0] >= a.offsets[0] + a.lengths[0]:
                break
            if intersect(a, b) is not None:
                raise PlanError(
                    f"tensor {name!r}: saved regions {a} and {b} overlap without being identical replicas"
                )
    covered = sum(b.volume for b in boxes)
    if covered != math.prod(shape):
        raise PlanError(
            f"tensor {name!r}: the ranks' regions cover {covered} of {math.prod(shape)} elements; "
            "some part of the tensor is held by no rank"
        )


def check_loadable(
    name: str, shape: tuple[int, ...], dtype: str, chunk: tuple[int, ...], inner: tuple[int, ...]
) -> None:
    """Refuse, before anything is written, a layout the load would refuse (a chunk above the decoded-chunk
    limit, more chunks than any storage holds: :func:`arraycheckpoint.checks.limits.check_tensor_layout`)."""
    from ..checks.limits import check_tensor_layout
    from ..errors import MetadataError

    try:
        check_tensor_layout(name, shape, dtype, chunk, inner)
    except MetadataError as e:
        raise PlanError(
            f"{e}: a checkpoint with this layout could not be loaded; change the PlanOptions"
        ) from None


def assign_shared_reads(
    requests: Sequence[Sequence[tuple[str, Box]]], itemsize: dict[str, int]
) -> dict[tuple[str, Box], int]:
    """For load-time read sharing: one reader per region that several ranks request.

    ``requests[r]`` lists the (tensor, region) pairs rank r needs. Regions wanted by one rank only are left
    out (that rank reads them itself). Readers are chosen among the requesting ranks by worst fit on bytes.
    """
    wanters: dict[tuple[str, Box], list[int]] = defaultdict(list)
    for rank, wanted in enumerate(requests):
        for key in dict.fromkeys(wanted):
            wanters[key].append(rank)
    shared = sorted(
        (k for k, ranks in wanters.items() if len(ranks) > 1),
        key=lambda k: (-k[1].volume * itemsize.get(k[0], 1), k[0], k[1]),
    )
    load = [0] * len(requests)
    readers = {}
    for key in shared:
        rank = min(wanters[key], key=lambda r: (load[r], r))
        readers[key] = rank
        load[rank] += key[1].volume * itemsize.get(key[0], 1)
    return readers


# JSON form of a RankPlan (plans travel between ranks as JSON, never pickle) ---------------------------
def _box_json(b: Box) -> list[list[int]]:
    return [list(b.offsets), list(b.lengths)]


def _box(j: list[list[int]]) -> Box:
    return Box(tuple(j[0]), tuple(j[1]))


def rank_plan_to_json(p: RankPlan) -> dict:
    """A JSON-able dict of ``p``."""
    return {
        "rank": p.rank,
        "layouts": [
            [a.name, list(a.shape), a.dtype, list(a.chunk_shape), list(a.inner_chunk_shape), a.compression]
            for a in p.layouts
        ],
        "create": list(p.create),
        "writes": [
            [w.name, _box_json(w.chunk), [[_box_json(x.box), x.src] for x in w.pieces]] for w in p.writes
        ],
        "sends": [[t.name, _box_json(t.box), t.src, t.dst] for t in p.sends],
        "recvs": [[t.name, _box_json(t.box), t.src, t.dst] for t in p.recvs],
        "exchange": p.exchange,
        "plan_id": p.plan_id,
        "packs": [[k, list(names)] for k, names in p.packs],
    }


def rank_plan_from_json(j: dict) -> RankPlan:
    """Inverse of :func:`rank_plan_to_json`."""
    return RankPlan(
        rank=j["rank"],
        layouts=tuple(
            ArrayLayout(n, tuple(s), d, tuple(c), tuple(i), z) for n, s, d, c, i, z in j["layouts"]
        ),
        create=tuple(j["create"]),
        writes=tuple(
            ChunkWrite(n, _box(c), tuple(Piece(_box(b), s) for b, s in pieces))
            for n, c, pieces in j["writes"]
        ),
        sends=tuple(Transfer(n, _box(b), s, d) for n, b, s, d in j["sends"]),
        recvs=tuple(Transfer(n, _box(b), s, d) for n, b, s, d in j["recvs"]),
        exchange=bool(j["exchange"]),
        plan_id=str(j["plan_id"]),
        packs=tuple((str(k), tuple(names)) for k, names in j.get("packs", ())),
    )
