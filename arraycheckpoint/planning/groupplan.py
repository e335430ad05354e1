"""Planning that grows with distinct layouts, not with ranks x tensors.

Input: the distinct declarations of a save (:class:`Decl`: a mesh table and one rule per tensor, see
:mod:`arraycheckpoint.planning.rules`) and the ranks that made each. Ranks with the same declaration form one group,
so a 10,000-rank FSDP2 or DDP job has one group and a TP x PP megatron job one group per (TP, PP) position.

Output: a :class:`CompactPlan`: per tensor its chunk grid, the writer of every chunk and the creator of its
``zarr.json``. Every rank derives its own work (:func:`rank_plan`) from the compact plan and the
declarations; nothing is listed per rank.

This is the one planner: :func:`arraycheckpoint.planning.plan.build_global_plan` states every rank's regions as box
rules and runs it too (tests compare plans from rules with plans from the expanded regions). Tensors whose
regions are the same (same shape, item size and holder structure) are analysed once. Chunk grids nest in the
saved regions (:mod:`arraycheckpoint.planning.chunking`); a chunk held by one rank is written there, replicated chunks
go to their holders by worst fit (:mod:`arraycheckpoint.planning.owners`), so only the row grids of flat ranges
(FSDP1) move bytes. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import dataclasses
import hashlib
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks.names import check_name_tree
from ..errors import PlanError
from .chunking import split_chunk, tensor_chunk_shape
from .owners import WorstFit, fragment_source, replica_caps
from .packing import assign_packs, by_pack
from .plan import (
    ArrayLayout,
    ChunkWrite,
    Piece,
    PlanOptions,
    RankPlan,
    Transfer,
    _validate_cover,
    check_loadable,
)
from .regions import Box, chunk_boxes, intersect
from .rules import Mesh, check_rule, mesh_regions, range_regions


@dataclass(frozen=True)
class TensorRule:
    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int
    rule: tuple[Any, ...]


@dataclass(frozen=True)
class Decl:
    """One rank's declaration: its meshes and one rule per tensor (JSON: :meth:`to_json`)."""

    meshes: tuple[Mesh, ...]
    tensors: tuple[TensorRule, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "meshes": [m.to_json() for m in self.meshes],
            "tensors": [
                [t.name, list(t.shape), t.dtype, t.itemsize, rule_json(t.rule)] for t in self.tensors
            ],
        }

    @staticmethod
    def from_json(j: Mapping[str, Any]) -> Decl:
        try:
            meshes = tuple(Mesh.from_json(m) for m in j["meshes"])
            tensors = []
            for name, shape, dtype, itemsize, rule in j["tensors"]:
                shape = tuple(int(s) for s in shape)
                check_rule(shape, rule, len(meshes))
                tensors.append(TensorRule(str(name), shape, str(dtype), int(itemsize), _rule_tuple(rule)))
        except (KeyError, TypeError, ValueError) as e:
            raise PlanError(f"malformed declaration ({type(e).__name__}: {e})") from None
        return Decl(meshes, tuple(tensors))


def rule_json(rule: tuple[Any, ...]) -> list[Any]:
    if rule[0] == "boxes":
        return ["boxes", [[list(b.offsets), list(b.lengths)] for b in rule[1]]]
    if rule[0] == "mesh":
        return ["mesh", rule[1], list(rule[2])]
    if rule[0] == "range":
        return ["range", rule[1], rule[2], rule[3]]
    return ["replica"]


def _rule_tuple(rule: Sequence[Any]) -> tuple[Any, ...]:
    if rule[0] == "boxes":
        return ("boxes", tuple(Box(tuple(int(x) for x in o), tuple(int(x) for x in n)) for o, n in rule[1]))
    if rule[0] == "mesh":
        return ("mesh", int(rule[1]), tuple(int(d) for d in rule[2]))
    if rule[0] == "range":
        return ("range", int(rule[1]), int(rule[2]), int(rule[3]))
    return ("replica",)


@dataclass(frozen=True)
class TensorDecision:
    """What the plan decided for one tensor."""

    layout: ArrayLayout
    writers: tuple[int, ...]  # per chunk, row-major over the chunk grid
    creator: int
    pack: str | None = (
        None  # the pack holding the array (arraycheckpoint.planning.packing), None: its own directory
    )


@dataclass
class CompactPlan:
    """The global plan in a form whose size grows with tensors and chunks, not with ranks.

    ``groups[g]`` is (declaration, sorted ranks); ``tensors`` the decisions; ``plan_id`` a digest that every
    rank compares at commit.
    """

    world: int
    groups: tuple[tuple[Decl, tuple[int, ...]], ...]
    tensors: dict[str, TensorDecision]
    plan_id: str
    exchange: bool = False  # whether any fragment travels (then every rank enters the exchange)
    _classes: dict[str, _Class] = field(default_factory=dict, repr=False)
    _index: dict[str, list[tuple[Decl, TensorRule]]] = field(default_factory=dict, repr=False)

    def contributions(self, name: str) -> list[tuple[Decl, TensorRule]]:
        """The (declaration, rule) pairs that describe where ``name``'s regions are, in group order."""
        if not self._index:
            for d, _r in self.groups:
                for t in d.tensors:
                    self._index.setdefault(t.name, []).append((d, t))
        return self._index.get(name, [])

    def regions(self, name: str) -> tuple[tuple[Box, int], ...]:
        """Unique saved regions of ``name`` and the rank credited with each (the lowest holder)."""
        c = self._classes[name]
        return tuple((b, min(h)) for b, h in zip(c.boxes, c.holders))


@dataclass
class _Class:
    """What tensors with identical region structure share: regions, chunks, writers' candidates, pieces."""

    boxes: list[Box]
    holders: list[list[int]]  # sorted ranks per region
    layout_shape: tuple[tuple[int, ...], tuple[int, ...]]  # chunk, inner
    chunks: list[Box]
    candidates: list[np.ndarray]  # per chunk: the ranks that may write it (the holders of most of it)
    pieces: list[list[tuple[Box, int]]]  # per chunk: (piece box, region index)
    uses: list[list[tuple[int, int]]]  # per region: (chunk index, piece index) of the pieces it supplies
    nbytes: np.ndarray  # per chunk
    forced: np.ndarray  # per chunk: its writer when it has one candidate, else -1 (worst fit decides)
    straddles: bool  # some chunk lies in several regions (a row grid over flat ranges): fragments travel
    _held: dict[int, list[int]] | None = None  # rank -> regions it holds (built on first use)

    def held_by(self, rank: int) -> list[int]:
        """Indices of the regions ``rank`` holds."""
        if self._held is None:
            self._held = defaultdict(list)
            for i, hs in enumerate(self.holders):
                for r in hs:
                    self._held[r].append(i)
        return self._held.get(rank, [])


def _regions_of(name: str, contribs: list[tuple[Decl, tuple[int, ...], TensorRule]]) -> dict[Box, list[int]]:
    regions: dict[Box, list[int]] = defaultdict(list)
    for decl, ranks, t in contribs:
        rule = t.rule
        if rule[0] == "replica":
            if math.prod(t.shape):
                regions[Box.full(t.shape)].extend(ranks)
        elif rule[0] == "boxes":
            for b in rule[1]:
                if not b.within(t.shape):
                    raise PlanError(f"tensor {name!r}: rank {ranks[0]} region {b} is outside shape {t.shape}")
                if b.volume:
                    regions[b].extend(ranks)
        else:
            mesh = decl.meshes[rule[1]]
            members = frozenset(ranks)
            if not members.issuperset(mesh.ranks) and members.isdisjoint(mesh.ranks):
                raise PlanError(f"tensor {name!r}: ranks {ranks[:4]}... are not in the mesh they name")
            if rule[0] == "range":
                held_by = range_regions(t.shape, mesh, rule[2], rule[3], members)
            else:
                held_by = mesh_regions(t.shape, mesh, rule[2], members)
            for b, held in held_by.items():
                regions[b].extend(held)
    return regions


def _analyse(
    shape: tuple[int, ...],
    itemsize: int,
    name: str,
    regions: dict[Box, list[int]],
    options: PlanOptions,
    cap: int | None,
    dtype: str,
) -> _Class:
    unique = sorted(regions)
    _validate_cover(name, shape, unique)
    holders = [sorted(regions[b]) for b in unique]
    held = [np.asarray(h, dtype=np.int64) for h in holders]  # shared by every chunk a region holds
    chunk_shape, nested = tensor_chunk_shape(shape, itemsize, unique, options, cap)
    inner = split_chunk(chunk_shape, itemsize, options.inner_chunk_bytes)
    check_loadable(name, shape, dtype, chunk_shape, inner)  # before the chunks are enumerated
    starts = [b.offsets[0] for b in unique] if shape else []
    longest = max((b.lengths[0] for b in unique), default=0) if shape else 0
    chunks, candidates, pieces = [], [], []
    uses: list[list[tuple[int, int]]] = [[] for _ in unique]
    straddles = False
    for ci, chunk in enumerate(chunk_boxes(shape, chunk_shape)):
        if shape:
            lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.lengths[0]
            # regions are sorted by offset: only those starting in (lo - longest, hi) can overlap
            idx = range(bisect.bisect_right(starts, lo - longest), bisect.bisect_left(starts, hi))
        else:
            idx = range(len(unique))
        if nested:  # the chunk lies inside exactly one region: the first one containing its origin
            region = next(i for i in idx if unique[i].contains(chunk))
            chunk_pieces = [(chunk, region)]
        else:
            parts = [(i, intersect(unique[i], chunk)) for i in idx]
            chunk_pieces = [(p, i) for i, p in parts if p is not None]
            region = _most_held(chunk_pieces, holders)
            straddles = straddles or len(chunk_pieces) > 1
        for pi, (_p, r) in enumerate(chunk_pieces):
            uses[r].append((ci, pi))
        chunks.append(chunk)
        candidates.append(held[region])
        pieces.append(chunk_pieces)
    nbytes = np.asarray([c.volume * itemsize for c in chunks], dtype=np.int64)
    forced = np.asarray([int(c[0]) if len(c) == 1 else -1 for c in candidates], dtype=np.int64)
    return _Class(
        unique, holders, (chunk_shape, inner), chunks, candidates, pieces, uses, nbytes, forced, straddles
    )


def _most_held(pieces: list[tuple[Box, int]], holders: list[list[int]]) -> int:
    """A region whose holders hold the most of a straddling chunk (its pieces summed per holder set; ties:
    the set listed first, then the lowest region index)."""
    held: dict[tuple[int, ...], tuple[int, int]] = {}
    for box, region in pieces:
        key = tuple(holders[region])
        n, first = held.get(key, (0, region))
        held[key] = (n + box.volume, min(first, region))
    return min(held.values(), key=lambda x: (-x[0], x[1]))[1]


def build_compact_plan(
    groups: Sequence[tuple[Decl, Sequence[int]]], world: int, options: PlanOptions | None = None
) -> CompactPlan:
    """Plan a save from its distinct declarations; same decisions as the reference planner.

    Raises:
        PlanError: ranks disagree on a tensor's shape/dtype; regions out of bounds, overlapping partially, or
            not covering a tensor.
        UnsafeNameError: one rank's array would lie inside another rank's array (``x`` and ``x/y``).
    """
    options = options or PlanOptions()
    groups = tuple((d, tuple(sorted(r))) for d, r in groups)
    contribs: dict[str, list[tuple[Decl, tuple[int, ...], TensorRule]]] = defaultdict(list)
    first: dict[str, TensorRule] = {}
    for decl, ranks in groups:
        for t in decl.tensors:
            f = first.setdefault(t.name, t)
            if (f.shape, f.dtype) != (t.shape, t.dtype):
                raise PlanError(
                    f"tensor {t.name!r}: rank {ranks[0]} has shape {t.shape} dtype {t.dtype} but another rank "
                    f"has shape {f.shape} dtype {f.dtype}; every rank must describe the same global tensor"
                )
            contribs[t.name].append((decl, ranks, t))
    # names that differ between ranks (per-rank tensors) can nest across ranks: refused before any write
    check_name_tree(first)

    keys: dict[str, Any] = {}
    regions_by_key: dict[Any, dict[Box, list[int]]] = {}
    for name in sorted(contribs):
        t = first[name]
        # tensors with the same contributions (up to the name) share one analysis
        key = keys[name] = (
            t.shape,
            t.itemsize,
            t.dtype,
            tuple((id(d), r, x.rule) for d, r, x in contribs[name]),
        )
        if key not in regions_by_key:
            regions_by_key[key] = _regions_of(name, contribs[name])
    uses = defaultdict(int)  # tensors per class: a replicated region counts once per tensor
    for key in keys.values():
        uses[key] += 1
    caps = replica_caps(
        (
            (b.volume * k[1] * uses[k], sorted(hs))
            for k, regions in regions_by_key.items()
            for b, hs in regions.items()
            if len(hs) > 1
        ),
        options.inner_chunk_bytes,
        options.write_balance,
        options.max_chunk_bytes,
    )
    classes: dict[str, _Class] = {}
    cache: dict[Any, _Class] = {}
    for name in sorted(contribs):
        t, key = first[name], keys[name]
        c = cache.get(key)
        if c is None:
            regions = regions_by_key[key]
            cap = min((caps[tuple(sorted(hs))] for hs in regions.values() if len(hs) > 1), default=None)
            c = cache[key] = _analyse(t.shape, t.itemsize, name, regions, options, cap, t.dtype)
        classes[name] = c

    # forced chunks (one holder) first, then the replicated ones by worst fit: largest first, ties by
    # (name, index) (arraycheckpoint.planning.owners)
    names = sorted(classes)
    load = np.zeros(world, dtype=np.int64)
    class_load: dict[int, np.ndarray] = {}
    writers: dict[str, np.ndarray] = {}
    order = []
    for name in names:
        c = classes[name]
        if id(c) not in class_load:
            own = c.forced >= 0
            class_load[id(c)] = np.bincount(c.forced[own], weights=c.nbytes[own], minlength=world).astype(
                np.int64
            )
        load += class_load[id(c)]
        writers[name] = c.forced.copy()
        order.extend((-int(c.nbytes[ci]), name, ci) for ci in np.nonzero(c.forced < 0)[0].tolist())
    order.sort()
    fit = WorstFit(load)
    for neg, name, ci in order:
        writers[name][ci] = fit.pick(-neg, classes[name].candidates[ci])

    files = [0] * world
    tensors: dict[str, TensorDecision] = {}
    for name in names:
        t, c = first[name], classes[name]
        ws = writers[name]
        creator = int(ws[0]) if len(ws) else min(range(world), key=lambda r: (files[r], r))
        files[creator] += 1
        layout = ArrayLayout(
            name, t.shape, t.dtype, c.layout_shape[0], c.layout_shape[1], options.compression
        )
        tensors[name] = TensorDecision(layout, tuple(ws.tolist()), creator)
    packs = assign_packs(
        {n: (d.layout, d.writers, d.creator) for n, d in tensors.items()},
        {n: first[n].itemsize for n in names},
        options.pack_array_bytes,
        options.min_chunk_bytes,
    )
    for name, key in packs.items():
        tensors[name] = dataclasses.replace(tensors[name], pack=key)
    h = hashlib.sha1()
    class_digest: dict[int, bytes] = {}  # the regions of a class, hashed once for all its tensors
    for name in names:
        d, c = tensors[name], classes[name]
        if id(c) not in class_digest:
            ch = hashlib.sha1()
            for b, hs in zip(c.boxes, c.holders):
                ch.update(repr((b.offsets, b.lengths, hs)).encode())
            class_digest[id(c)] = ch.digest()
        h.update(repr((name, d.layout, d.creator, d.pack)).encode())
        h.update(writers[name].tobytes())
        h.update(class_digest[id(c)])
    exchange = any(classes[n].straddles for n in names)
    plan = CompactPlan(world, groups, tensors, h.hexdigest()[:16], exchange)
    plan._classes = classes
    return plan


def rank_plan(plan: CompactPlan, rank: int) -> RankPlan:
    """The work of ``rank``: its chunk writes (with sources), the fragments it sends and receives."""
    writes: list[ChunkWrite] = []
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    mine: set[str] = set()
    for name in sorted(plan.tensors):
        d = plan.tensors[name]
        c = plan._classes[name]
        ws = np.asarray(d.writers, dtype=np.int64)
        if d.creator == rank:
            mine.add(name)
        for ci in np.nonzero(ws == rank)[0].tolist():
            resolved = []
            for box, region in c.pieces[ci]:
                hs = c.holders[region]
                src = rank if _holds(hs, rank) else fragment_source(hs, rank)
                resolved.append(Piece(box, src))
                if src != rank:
                    recvs.append(Transfer(name, box, src, rank))
            writes.append(ChunkWrite(name, c.chunks[ci], tuple(resolved)))
            mine.add(name)
        outgoing = []
        for region in c.held_by(rank):
            hs = c.holders[region]
            for ci, pi in c.uses[region]:
                w = int(ws[ci])
                if w != rank and not _holds(hs, w) and fragment_source(hs, w) == rank:
                    outgoing.append((ci, pi, w))
        for ci, pi, w in sorted(outgoing):  # chunk order, as the reference planner lists them
            sends.append(Transfer(name, c.pieces[ci][pi][0], rank, w))
    layouts = tuple(plan.tensors[n].layout for n in sorted(mine))
    packs = {n: plan.tensors[n].pack for n in mine if plan.tensors[n].pack is not None}
    return RankPlan(
        rank=rank,
        layouts=layouts,
        create=tuple(sorted(n for n in mine if plan.tensors[n].creator == rank and n not in packs)),
        packs=tuple(by_pack(packs).items()),  # type: ignore[arg-type]
        writes=tuple(writes),
        sends=tuple(sends),
        recvs=tuple(recvs),
        exchange=plan.exchange,
        plan_id=plan.plan_id,
    )


def _holds(sorted_ranks: list[int], rank: int) -> bool:
    i = bisect.bisect_left(sorted_ranks, rank)
    return i < len(sorted_ranks) and sorted_ranks[i] == rank
