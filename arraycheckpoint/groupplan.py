"""Planning that grows with distinct layouts, not with ranks x tensors.

Input: the distinct declarations of a save (:class:`Decl`: a mesh table and one rule per tensor, see
:mod:`arraycheckpoint.rules`) and the ranks that made each. Ranks with the same declaration form one group,
so a 10,000-rank FSDP2 or DDP job has one group and a TP x PP megatron job one group per (TP, PP) position.

Output: a :class:`CompactPlan`: per tensor its chunk grid, the writer of every chunk and the creator of its
``zarr.json``. Every rank derives its own work (:func:`rank_plan`) from the compact plan and the
declarations; nothing is listed per rank.

The decisions are exactly those of the reference planner :func:`arraycheckpoint.plan.build_global_plan` fed
the same regions (tests compare both): tensors whose regions are the same (same shape, item size and holder
structure) are analysed once, and the worst-fit balance runs over all chunks with numpy. Pure: no I/O.
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

from .chunking import apportion
from .errors import PlanError
from .owners import HostMap, OwnerPicker, chunk_candidates, fragment_source
from .packing import assign_packs, by_pack
from .plan import (
    ArrayLayout,
    ChunkWrite,
    Piece,
    PlanOptions,
    RankPlan,
    Transfer,
    _holder_set,
    _layout,
    _validate_cover,
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
    pack: str | None = None  # the pack holding the array (arraycheckpoint.packing), None: its own directory


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
    hostmap: HostMap | None = field(default=None, repr=False)
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
    """What tensors with identical region structure share: regions, chunks, candidates, pieces."""

    boxes: list[Box]
    holders: list[list[int]]  # sorted ranks per region
    layout_shape: tuple[tuple[int, ...], tuple[int, ...]]  # chunk, inner
    chunks: list[Box]
    candidates: list[tuple[np.ndarray, np.ndarray]]  # per chunk: owner candidates (owners.chunk_candidates)
    pieces: list[list[tuple[Box, int]]]  # per chunk: (piece box, region index)
    uses: list[list[tuple[int, int]]]  # per region: (chunk index, piece index) of the pieces it supplies
    nbytes: list[int]
    is_partial: list[bool]  # no single region holds the chunk entirely
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
    dtype: str,
    name: str,
    regions: dict[Box, list[int]],
    options: PlanOptions,
    files: int | None,
    share: int,
    hostmap: HostMap,
) -> _Class:
    unique = sorted(regions)
    _validate_cover(name, shape, unique)
    holders = [sorted(regions[b]) for b in unique]
    held = [np.asarray(h, dtype=np.int64) for h in holders]  # shared by every chunk a region holds fully
    probe = _layout(_DeclView(name, shape, dtype, itemsize), unique, options, files, share)
    starts = [b.offsets[0] for b in unique] if shape else []
    longest = max((b.lengths[0] for b in unique), default=0) if shape else 0
    chunks, candidates, pieces, nbytes, flags = [], [], [], [], []
    uses: list[list[tuple[int, int]]] = [[] for _ in unique]
    whole_cands: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # per region holding whole chunks
    part_cands: dict[tuple[tuple[int, int], ...], tuple[np.ndarray, np.ndarray]] = {}
    for ci, chunk in enumerate(chunk_boxes(shape, probe.chunk_shape)):
        if shape:
            lo, hi = chunk.offsets[0], chunk.offsets[0] + chunk.lengths[0]
            # regions are sorted by offset: only those starting in (lo - longest, hi) can overlap
            idx = range(bisect.bisect_right(starts, lo - longest), bisect.bisect_left(starts, hi))
        else:
            idx = range(len(unique))
        parts = [(i, intersect(unique[i], chunk)) for i in idx]
        parts = [(i, p) for i, p in parts if p is not None]
        whole = [i for i, p in parts if p == chunk]  # at most one: identical regions were merged
        if whole:
            chunk_pieces = [(chunk, whole[0])]
            if whole[0] not in whole_cands:
                whole_cands[whole[0]] = chunk_candidates(hostmap, held[whole[0]], ())
            cands = whole_cands[whole[0]]
        else:
            chunk_pieces = [(p, i) for i, p in parts]
            key = tuple((i, p.volume) for i, p in parts)  # chunks drawing alike on the same regions
            if key not in part_cands:
                part_cands[key] = chunk_candidates(hostmap, None, [(v * itemsize, held[i]) for i, v in key])
            cands = part_cands[key]
        for pi, (_p, region) in enumerate(chunk_pieces):
            uses[region].append((ci, pi))
        chunks.append(chunk)
        candidates.append(cands)
        pieces.append(chunk_pieces)
        nbytes.append(chunk.volume * itemsize)
        flags.append(not whole)
    return _Class(
        unique,
        holders,
        (probe.chunk_shape, probe.inner_chunk_shape),
        chunks,
        candidates,
        pieces,
        uses,
        nbytes,
        flags,
    )


@dataclass(frozen=True)
class _DeclView:
    name: str
    shape: tuple[int, ...]
    dtype: str
    itemsize: int


def build_compact_plan(
    groups: Sequence[tuple[Decl, Sequence[int]]], world: int, options: PlanOptions | None = None
) -> CompactPlan:
    """Plan a save from its distinct declarations; same decisions as the reference planner.

    Raises:
        PlanError: ranks disagree on a tensor's shape/dtype; regions out of bounds, overlapping partially, or
            not covering a tensor.
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

    hostmap = options.host_map(world)
    sizes = {n: math.prod(t.shape) * t.itemsize for n, t in first.items()}
    keys: dict[str, Any] = {}
    regions_by_key: dict[Any, tuple[dict[Box, list[int]], np.ndarray]] = {}
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
            regions = _regions_of(name, contribs[name])
            regions_by_key[key] = (regions, _holder_set(regions.values()))
    counts = apportion({n: (sizes[n], regions_by_key[k][1]) for n, k in keys.items()}, world, options)
    classes: dict[str, _Class] = {}
    cache: dict[Any, _Class] = {}
    for name in sorted(contribs):
        t, key = first[name], keys[name]
        c = cache.get(key)
        if c is None:
            files, share = (counts or {}).get(name, (None, 0))
            c = cache[key] = _analyse(
                t.shape, t.itemsize, t.dtype, name, regions_by_key[key][0], options, files, share, hostmap
            )
        classes[name] = c

    # worst fit over every chunk of every tensor: largest first, ties by (name, index) (arraycheckpoint.owners)
    names = sorted(classes)
    order = sorted(
        ((-nb, name, ci) for name in names for ci, nb in enumerate(classes[name].nbytes)),
    )
    picker = OwnerPicker(world, sum(sizes.values()), options.write_balance, options.straddle_writers)
    writers: dict[str, np.ndarray] = {n: np.empty(len(classes[n].chunks), dtype=np.int64) for n in names}
    for neg, name, ci in order:
        c = classes[name]
        cands, near = c.candidates[ci]
        picker.pick(-neg, cands, near, c.is_partial[ci])
    for (_neg, name, ci), w in zip(order, picker.owners().tolist()):
        writers[name][ci] = w

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
        tensors[name] = TensorDecision(layout, tuple(int(w) for w in ws), creator)
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
    exchange = any(_any_transfer(classes[n], writers[n]) for n in names)
    plan = CompactPlan(world, groups, tensors, h.hexdigest()[:16], exchange, hostmap)
    plan._classes = classes
    return plan


def rank_plan(plan: CompactPlan, rank: int) -> RankPlan:
    """The work of ``rank``: its chunk writes (with sources), the fragments it sends and receives."""
    writes: list[ChunkWrite] = []
    sends: list[Transfer] = []
    recvs: list[Transfer] = []
    mine: set[str] = set()
    hostmap = plan.hostmap or HostMap(plan.world)
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
                src = rank if _holds(hs, rank) else fragment_source(hs, rank, hostmap)
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
                if w != rank and not _holds(hs, w) and fragment_source(hs, w, hostmap) == rank:
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


def _any_transfer(c: _Class, ws: np.ndarray) -> bool:
    for ci in range(len(c.chunks)):  # a chunk held entirely travels too when balance moved it off its holders
        w = int(ws[ci])
        for _box, region in c.pieces[ci]:
            if not _holds(c.holders[region], w):
                return True
    return False
