"""Pure save planning: from every rank's local regions to one writer per stored chunk.

No I/O and no communication happen here; the engine gathers the local plans, calls
:func:`build_global_plan` on the coordinator and hands each rank its :class:`RankPlan`. Everything is
deterministic, so the same inputs give the same plan on any machine.

Steps, per tensor:

1. check that every rank agrees on global shape and dtype;
2. deduplicate identical regions (replicas) and validate the rest: in bounds, no partial overlap, full coverage;
3. pick a regular chunk grid aligned to the saved region boundaries (coarsened when that grid would make
   tiny files, split when files would be huge); one chunk is one stored file;
4. assign one writer per chunk by worst fit on bytes (largest chunk first, to the least-loaded rank among
   those that hold it entirely, else among those holding part of it);
5. where the writer lacks part of its chunk (irregular shards straddling chunk boundaries), plan a transfer
   of the missing fragment from a holder: the engine ships all of them in one batched exchange.
"""

from __future__ import annotations

import hashlib
import math
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import PlanError
from .regions import Box, chunk_boxes, intersect


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
    # who writes a chunk that no single rank holds entirely (its pieces travel to the writer anyway):
    # "balanced": its least-loaded holder, unless that rank is loaded more than the chunk's bytes above the
    # least-loaded rank of the world, which then writes it (locality while it is free, balance at scale);
    # "holders": only ranks holding part of it; "any": the least-loaded rank of the world
    straddle_writers: str = "balanced"


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
    layouts: dict[str, ArrayLayout] = {}
    chunk_list: list[tuple[int, str, int, Box, list[Piece], tuple[list[int], bool]]] = []
    regions_of: dict[str, tuple[tuple[Box, int], ...]] = {}
    for name in sorted(decls):
        d = decls[name]
        regions = holders[name]
        unique = sorted(regions)
        _validate_cover(name, d.shape, unique)
        layout = _layout(d, unique, options)
        layouts[name] = layout
        regions_of[name] = tuple((b, min(regions[b])) for b in unique)
        for index, chunk in enumerate(chunk_boxes(d.shape, layout.chunk_shape)):
            parts = [(b, intersect(b, chunk)) for b in _candidates(unique, chunk)]
            parts = [(b, p) for b, p in parts if p is not None]
            full = sorted({r for b, p in parts if p == chunk for r in regions[b]})
            pieces = [Piece(p, -1) for b, p in parts if p != chunk] if not full else [Piece(chunk, -1)]
            held_by = full or sorted({r for b, _ in parts for r in regions[b]})
            # candidates, and whether the whole world may take the chunk when its holders are busy
            candidates = (held_by, not full and options.straddle_writers != "holders")
            chunk_list.append((chunk.volume * d.itemsize, name, index, chunk, pieces, candidates))

    load = [0] * world
    owner: dict[tuple[str, int], int] = {}
    for nbytes, name, index, _c, _p, (held_by, open_) in sorted(
        chunk_list, key=lambda c: (-c[0], c[1], c[2])
    ):
        rank = min(held_by, key=lambda r: (load[r], r))
        if open_:
            least = min(range(world), key=lambda r: (load[r], r))
            if options.straddle_writers == "any" or load[rank] - load[least] > nbytes:
                rank = least
        owner[(name, index)] = rank
        load[rank] += nbytes

    ordered = {name: [(b, sorted(holders[name][b])) for b in sorted(holders[name])] for name in decls}
    writes: dict[int, list[ChunkWrite]] = defaultdict(list)
    transfers: list[Transfer] = []
    writers: dict[str, list[int]] = defaultdict(list)
    for _n, name, index, chunk, pieces, _cands in chunk_list:
        dst = owner[(name, index)]
        writers[name].append(dst)
        resolved = []
        for piece in pieces:
            src = _source(ordered[name], piece.box, dst)
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

    tensors = {
        name: TensorPlan(layouts[name], regions_of[name], tuple(writers.get(name, [])), creators[name])
        for name in sorted(decls)
    }
    digest = hashlib.sha1(
        repr([(n, t.layout, t.regions, t.writers, t.creator) for n, t in sorted(tensors.items())]).encode()
    ).hexdigest()[:16]
    ranks = []
    for r in range(world):
        mine = {w.name for w in writes[r]} | {n for n, c in creators.items() if c == r}
        ranks.append(
            RankPlan(
                rank=r,
                layouts=tuple(layouts[n] for n in sorted(mine)),
                create=tuple(sorted(n for n, c in creators.items() if c == r)),
                writes=tuple(writes[r]),
                sends=tuple(t for t in transfers if t.src == r),
                recvs=tuple(t for t in transfers if t.dst == r),
                exchange=bool(transfers),
                plan_id=digest,
            )
        )
    return GlobalPlan(tensors, tuple(ranks))


def _candidates(boxes: Sequence[Box], chunk: Box) -> list[Box]:
    """Boxes that may intersect ``chunk`` (a cheap prefilter on dim 0; boxes are sorted by offsets)."""
    if chunk.ndim == 0:
        return list(boxes)
    lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.lengths[0]
    return [b for b in boxes if b.offsets[0] < hi and b.offsets[0] + b.lengths[0] > lo]


def _source(regions: list[tuple[Box, list[int]]], piece: Box, prefer: int) -> int:
    """The rank that supplies ``piece``: the writer itself when it holds it, else the region's designated
    source (:func:`designated_source`: replicas take turns, region by region). ``regions``: the tensor's
    distinct regions sorted by offset, each with its sorted holders."""
    for index, (box, ranks) in enumerate(regions):
        if box.contains(piece):
            return prefer if prefer in ranks else designated_source(ranks, index)
    raise PlanError(f"no rank holds region {piece}")  # unreachable after validation


def designated_source(sorted_holders: Sequence[int], region_index: int) -> int:
    """The holder that sends a region's fragments to writers that do not hold it: holder ``region_index mod
    len(holders)`` of the tensor's ``region_index``-th distinct region (regions sorted by offset).

    Replicated regions (DP replicas of an FSDP or Megatron shard, JAX devices of several processes) are then
    sent by every replica in turn instead of all by the first one: at 10,000 simulated JAX processes the
    lowest replica otherwise sent 9.8 GB of one save's fragments.
    """
    return sorted_holders[region_index % len(sorted_holders)]


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


def _layout(d: TensorDecl, boxes: Sequence[Box], options: PlanOptions) -> ArrayLayout:
    chunk = choose_chunk_shape(d.shape, d.itemsize, boxes, options)
    inner = split_chunk(chunk, d.itemsize, options.inner_chunk_bytes)
    return ArrayLayout(d.name, d.shape, d.dtype, chunk, inner, options.compression)


def choose_chunk_shape(
    shape: tuple[int, ...], itemsize: int, boxes: Sequence[Box], options: PlanOptions
) -> tuple[int, ...]:
    """A regular chunk grid aligned with the boundaries of ``boxes`` where that keeps files reasonably sized.

    The finest aligned grid is the gcd of all interior region boundaries per dimension. It is coarsened
    (innermost dims first, up to the full extent) while a chunk is below ``min_chunk_bytes``, then split by
    divisors (outermost dims first, so alignment is kept) while above ``max_chunk_bytes``.
    """
    if not shape:
        return ()
    grid = []
    for d, extent in enumerate(shape):
        g = 0
        for b in boxes:
            for edge in (b.offsets[d], b.offsets[d] + b.lengths[d]):
                if 0 < edge < extent:
                    g = math.gcd(g, edge)
        grid.append(g or max(extent, 1))
    nbytes = lambda c: math.prod(c) * itemsize  # noqa: E731
    for d in reversed(range(len(grid))):
        if nbytes(grid) >= options.min_chunk_bytes:
            break
        factor = math.ceil(options.min_chunk_bytes / nbytes(grid))
        grid[d] = min(max(shape[d], 1), grid[d] * factor)
    return split_chunk(tuple(grid), itemsize, options.max_chunk_bytes)


def split_chunk(chunk: tuple[int, ...], itemsize: int, limit: int) -> tuple[int, ...]:
    """Shrink ``chunk`` by integer divisors (outermost dim first) until it holds at most ``limit`` bytes.

    Dividing keeps every old grid line on the new grid, and the result always divides ``chunk``.
    """
    out = list(chunk)
    for d in range(len(out)):
        size = math.prod(out) * itemsize
        if size <= limit:
            break
        need = math.ceil(size / limit)
        out[d] = out[d] // next((k for k in range(need, out[d] + 1) if out[d] % k == 0), out[d])
    return tuple(max(c, 1) for c in out)


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
    )
