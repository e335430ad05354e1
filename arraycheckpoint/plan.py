"""Pure save planning: from every rank's local regions to one writer per stored chunk.

No I/O and no communication happen here; the engine gathers the local plans, calls
:func:`build_global_plan` on the coordinator and hands each rank its :class:`RankPlan`. Everything is
deterministic, so the same inputs give the same plan on any machine.

Steps, per tensor:

1. check that every rank agrees on global shape and dtype;
2. deduplicate identical regions (replicas) and validate the rest: in bounds, no partial overlap, full coverage;
3. pick a regular chunk grid (:mod:`arraycheckpoint.chunking`): aligned to the saved region boundaries for a
   save too small for its world, else sized for the whole save so that every rank writes about as many
   bytes; one chunk is one stored file;
4. assign one writer per chunk by worst fit on bytes (largest chunk first), preferring a holder on the host
   that holds most of the chunk, within a write-balance bound (:mod:`arraycheckpoint.owners`: the cost model);
5. where the writer lacks part of its chunk (irregular shards straddling chunk boundaries), plan a transfer
   of the missing fragment from a holder, on the writer's host where one is: the engine ships all of them in
   one batched exchange.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from .chunking import apportion, choose_chunk_shape, split_chunk, tensor_chunk_shape
from .errors import PlanError
from .owners import HostMap, OwnerPicker, chunk_candidates, fragment_source
from .packing import assign_packs, by_pack
from .regions import Box, chunk_boxes, intersect

__all__ = ["choose_chunk_shape", "split_chunk"]  # re-exported (their home is arraycheckpoint.chunking)


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

    ``min_chunk_bytes`` is the target file size: it bounds the number of files by the checkpoint's bytes
    (about bytes / 16 MiB) instead of tensors x ranks. Shards smaller than it are assembled by one writer from
    its neighbours' fragments (one batched exchange in the background); shards above it are written where
    they are. Lower it to trade more files for less data movement.
    """

    min_chunk_bytes: int = 16 << 20
    max_chunk_bytes: int = 64 << 20
    inner_chunk_bytes: int = 1 << 20
    compression: str | None = None
    # who writes a chunk (arraycheckpoint.owners): "balanced": its least-loaded holder on the hosts holding
    # most of it, unless that would load it above ``write_balance`` x the mean, then a rank of those hosts
    # with room, else the least-loaded rank of the world (locality while it is free, balance at scale);
    # "holders": only holders on those hosts; "any": a chunk no rank holds entirely goes to the least-loaded
    # rank of the world
    straddle_writers: str = "balanced"
    # the host of every rank, for the owner choice and the fragment sources (arraycheckpoint.owners):
    # contiguous blocks of ``ranks_per_host`` ranks (torchrun's LOCAL_WORLD_SIZE; 0: unknown, which a save
    # fills from the environment when every rank agrees), or ``host_of[rank]`` for irregular placements;
    # with neither, every rank is its own host
    ranks_per_host: int = 0
    host_of: tuple[int, ...] = ()
    # a rank's written bytes may exceed the mean by this factor before chunks go to a less-loaded rank
    write_balance: float = 1.05
    # arrays one rank writes whole, uncompressed and of at most this many stored bytes go into that rank's
    # packs (arraycheckpoint.packing: ZIP files every zarr reader opens), about ``min_chunk_bytes`` each,
    # instead of a directory and two files apiece; 0 keeps every array in its own directory
    pack_array_bytes: int = 2 << 20

    def host_map(self, world: int) -> HostMap:
        """The :class:`~arraycheckpoint.owners.HostMap` these options describe for ``world`` ranks."""
        return HostMap(world, self.ranks_per_host, self.host_of)


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
    pack: str | None = None  # the pack holding the array (arraycheckpoint.packing), None: its own directory


@dataclass(frozen=True)
class GlobalPlan:
    """The coordinator's plan: per tensor decisions and per rank work lists."""

    tensors: dict[str, TensorPlan]
    ranks: tuple[RankPlan, ...]


def build_global_plan(
    local: Sequence[Sequence[TensorDecl]], options: PlanOptions | None = None
) -> GlobalPlan:
    """Combine every rank's local declarations into a validated global plan.

    Args:
        local: ``local[r]`` lists the tensors rank ``r`` holds (ranks with nothing pass an empty list).
        options: chunk-grid knobs.

    Raises:
        PlanError: ranks disagree on a tensor's shape/dtype; a region is out of bounds; regions overlap
            partially; or the regions do not cover a tensor entirely.
    """
    options = options or PlanOptions()
    world = len(local)
    decls: dict[str, TensorDecl] = {}
    holders: dict[str, dict[Box, list[int]]] = defaultdict(lambda: defaultdict(list))
    for rank, entries in enumerate(local):
        for d in entries:
            first = decls.setdefault(d.name, d)
            if (first.shape, first.dtype) != (d.shape, d.dtype):
                raise PlanError(
                    f"tensor {d.name!r}: rank {rank} has shape {d.shape} dtype {d.dtype} but another rank has "
                    f"shape {first.shape} dtype {first.dtype}; every rank must describe the same global tensor"
                )
            for box in d.boxes:
                if not box.within(d.shape):
                    raise PlanError(f"tensor {d.name!r}: rank {rank} region {box} is outside shape {d.shape}")
                if box.volume:
                    holders[d.name][box].append(rank)

    # Chunks of every tensor, to be balanced together.
    hostmap = options.host_map(world)
    sizes = {n: math.prod(d.shape) * d.itemsize for n, d in decls.items()}
    counts = apportion({n: (sizes[n], _holder_set(holders[n].values())) for n in decls}, world, options)
    layouts: dict[str, ArrayLayout] = {}
    chunk_list: list[tuple[int, str, int, Box, list[Piece], tuple[np.ndarray, np.ndarray, bool]]] = []
    regions_of: dict[str, tuple[tuple[Box, int], ...]] = {}
    for name in sorted(decls):
        d = decls[name]
        regions = holders[name]
        unique = sorted(regions)
        _validate_cover(name, d.shape, unique)
        layout = _layout(d, unique, options, *(counts or {}).get(name, (None, 0)))
        layouts[name] = layout
        regions_of[name] = tuple((b, min(regions[b])) for b in unique)
        for index, chunk in enumerate(chunk_boxes(d.shape, layout.chunk_shape)):
            parts = [(b, intersect(b, chunk)) for b in _candidates(unique, chunk)]
            parts = [(b, p) for b, p in parts if p is not None]
            full = sorted({r for b, p in parts if p == chunk for r in regions[b]})
            pieces = [Piece(p, -1) for b, p in parts if p != chunk] if not full else [Piece(chunk, -1)]
            held = [(p.volume * d.itemsize, np.asarray(sorted(regions[b]))) for b, p in parts]
            cands, near = chunk_candidates(hostmap, np.asarray(full) if full else None, held)
            chunk_list.append(
                (chunk.volume * d.itemsize, name, index, chunk, pieces, (cands, near, not full))
            )

    picker = OwnerPicker(world, sum(sizes.values()), options.write_balance, options.straddle_writers)
    ordered_chunks = sorted(chunk_list, key=lambda c: (-c[0], c[1], c[2]))
    for nbytes, _name, _index, _c, _p, (cands, near, partial) in ordered_chunks:
        picker.pick(nbytes, cands, near, partial)
    owner = {(c[1], c[2]): w for c, w in zip(ordered_chunks, picker.owners().tolist())}

    ordered = {name: [(b, sorted(holders[name][b])) for b in sorted(holders[name])] for name in decls}
    writes: dict[int, list[ChunkWrite]] = defaultdict(list)
    transfers: list[Transfer] = []
    writers: dict[str, list[int]] = defaultdict(list)
    for _n, name, index, chunk, pieces, _cands in chunk_list:
        dst = owner[(name, index)]
        writers[name].append(dst)
        resolved = []
        for piece in pieces:
            src = _source(ordered[name], piece.box, dst, hostmap)
            resolved.append(Piece(piece.box, src))
            if src != dst:
                transfers.append(Transfer(name, piece.box, src, dst))
        writes[dst].append(ChunkWrite(name, chunk, tuple(resolved)))

    creators: dict[str, int] = {}
    files = [0] * world
    for name in sorted(decls):
        ws = writers.get(name)
        creator = ws[0] if ws else min(range(world), key=lambda r: (files[r], r))
        files[creator] += 1
        creators[name] = creator

    packs = assign_packs(
        {n: (layouts[n], tuple(writers.get(n, [])), creators[n]) for n in decls},
        {n: d.itemsize for n, d in decls.items()},
        options.pack_array_bytes,
        options.min_chunk_bytes,
    )
    tensors = {
        name: TensorPlan(
            layouts[name], regions_of[name], tuple(writers.get(name, [])), creators[name], packs.get(name)
        )
        for name in sorted(decls)
    }
    digest = hashlib.sha1(
        repr(
            [(n, t.layout, t.regions, t.writers, t.creator, t.pack) for n, t in sorted(tensors.items())]
        ).encode()
    ).hexdigest()[:16]
    ranks = []
    for r in range(world):
        mine = {w.name for w in writes[r]} | {n for n, c in creators.items() if c == r}
        ranks.append(
            RankPlan(
                rank=r,
                layouts=tuple(layouts[n] for n in sorted(mine)),
                create=tuple(sorted(n for n, c in creators.items() if c == r and n not in packs)),
                writes=tuple(writes[r]),
                sends=tuple(t for t in transfers if t.src == r),
                recvs=tuple(t for t in transfers if t.dst == r),
                exchange=bool(transfers),
                plan_id=digest,
                packs=tuple(by_pack(packs, mine).items()),
            )
        )
    return GlobalPlan(tensors, tuple(ranks))


def _holder_set(holders: Iterable[Sequence[int]]) -> np.ndarray:
    """Every rank holding part of a tensor, sorted (``holders``: the ranks of each of its regions)."""
    parts = [np.asarray(h, dtype=np.int64) for h in holders]
    return np.unique(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)


def _candidates(boxes: Sequence[Box], chunk: Box) -> list[Box]:
    """Boxes that may intersect ``chunk`` (a cheap prefilter on dim 0; boxes are sorted by offsets)."""
    if chunk.ndim == 0:
        return list(boxes)
    lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.lengths[0]
    return [b for b in boxes if b.offsets[0] < hi and b.offsets[0] + b.lengths[0] > lo]


def _source(regions: list[tuple[Box, list[int]]], piece: Box, writer: int, hostmap: HostMap) -> int:
    """The rank that supplies ``piece``: the writer itself when it holds it, else
    :func:`~arraycheckpoint.owners.fragment_source` of the region holding it. ``regions``: the tensor's
    distinct regions sorted by offset, each with its sorted holders."""
    for box, ranks in regions:
        if box.contains(piece):
            return writer if writer in ranks else fragment_source(ranks, writer, hostmap)
    raise PlanError(f"no rank holds region {piece}")  # unreachable after validation


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


def _layout(
    d: TensorDecl, boxes: Sequence[Box], options: PlanOptions, files: int | None = None, share: int = 0
) -> ArrayLayout:
    """The stored layout of ``d`` (:func:`~arraycheckpoint.chunking.tensor_chunk_shape`)."""
    chunk = tensor_chunk_shape(d.shape, d.itemsize, boxes, options, files, share)
    inner = split_chunk(chunk, d.itemsize, options.inner_chunk_bytes)
    _check_loadable(d, chunk, inner)
    return ArrayLayout(d.name, d.shape, d.dtype, chunk, inner, options.compression)


def _check_loadable(d: TensorDecl, chunk: tuple[int, ...], inner: tuple[int, ...]) -> None:
    """Refuse, before anything is written, a layout the load would refuse (a chunk above the decoded-chunk
    limit, more chunks than any storage holds: :func:`arraycheckpoint.safety.check_tensor_layout`)."""
    from .errors import MetadataError
    from .safety import check_tensor_layout

    try:
        check_tensor_layout(d.name, d.shape, d.dtype, chunk, inner)
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
