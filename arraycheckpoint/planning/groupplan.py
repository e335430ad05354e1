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
go to their holders by worst fit (:mod:`arraycheckpoint.planning.owners`), so only the flat-run grids of flat ranges
(FSDP1) move bytes. Pure: no I/O.
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks.bounds import MAX_DERIVED_RANK_VISITS, MAX_DERIVED_WRITERS, MAX_DERIVED_WRITERS_TOTAL
from ..checks.names import check_name_tree
from ..errors import PlanError
from .chunking import RunOption, choose_runs, run_options, split_chunk, tensor_chunk_shape
from .flatgrid import GENERIC, chunk_box, flat_interval, holder_cuts, region_choice
from .owners import CYCLIC_MIN_CHUNKS, Cycle, WorstFit, cycle_shifts, fragment_source, replica_caps
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
from .regions import Box
from .rules import MAX_MESH_RANKS, Mesh, check_rule, mesh_regions, range_regions, rule_visits


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
                check_rule(shape, rule, meshes)
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
    writers: np.ndarray  # per chunk, row-major over the chunk grid (read-only; tensors of a class share it)
    creator: int
    pack: str | None = (
        None  # the pack holding the array (arraycheckpoint.planning.packing), None: its own directory
    )
    derived: bool = False  # the writers follow from the layout (flatgrid.held_writers): not stored
    shift: int | None = None  # derived by the cyclic rule with this shift (owners.Cycle), not "held"


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
    """What tensors with identical region structure share: regions, the chunk grid, each chunk's region."""

    shape: tuple[int, ...]
    boxes: list[Box]
    holders: list[list[int]]  # sorted ranks per region
    layout_shape: tuple[tuple[int, ...], tuple[int, ...]]  # chunk, inner
    choice: np.ndarray  # per chunk: the region whose holders may write it (the holders of most of it)
    straddle: dict[int, list[tuple[Box, int]]]  # chunks in several regions: (piece box, region index)
    uses: list[list[tuple[int, int]]]  # per region: (chunk index, piece index) of the straddling pieces
    nbytes: np.ndarray  # per chunk
    forced: np.ndarray  # per chunk: its writer when it has one candidate, else -1 (worst fit decides)
    straddles: bool  # some chunk lies in several regions (flat runs over flat ranges): fragments travel
    derived: bool  # every writer is the one holder of its chunk's region (flatgrid.held_writers)
    cyclable: bool = False  # replicated chunks may follow the cyclic rule (nested or flat runs, no straddle)
    _held: dict[int, list[int]] | None = None  # rank -> regions it holds (built on first use)
    _cycle: Cycle | None = None
    _arrays: list[np.ndarray] | None = None

    @property
    def counts(self) -> list[int]:
        return [-(-max(s, 1) // c) for s, c in zip(self.shape, self.layout_shape[0])]

    def chunk(self, ci: int) -> Box:
        """Chunk ``ci`` (row-major) of the grid."""
        return chunk_box(self.shape, self.layout_shape[0], self.counts, ci)

    @property
    def chunks(self) -> _Chunks:
        """Every chunk as a sequence (built on access, one at a time)."""
        return _Chunks(len(self.nbytes), self.chunk)

    @property
    def pieces(self) -> _Chunks:
        """Per chunk: its (piece box, region index) pairs (one piece unless it straddles regions)."""
        return _Chunks(len(self.nbytes), self.pieces_of)

    def pieces_of(self, ci: int) -> list[tuple[Box, int]]:
        got = self.straddle.get(ci)
        return got if got is not None else [(self.chunk(ci), int(self.choice[ci]))]

    def candidates(self, ci: int) -> np.ndarray:
        """The ranks that may write chunk ``ci`` (sorted)."""
        if self._arrays is None:
            self._arrays = [np.asarray(h, dtype=np.int64) for h in self.holders]
        return self._arrays[int(self.choice[ci])]

    @property
    def cycle(self) -> Cycle:
        """The cyclic rule's tables of this class (built on first use)."""
        if self._cycle is None:
            self._cycle = Cycle(self.choice, self.holders)
        return self._cycle

    def held_by(self, rank: int) -> list[int]:
        """Indices of the regions ``rank`` holds."""
        if self._held is None:
            self._held = defaultdict(list)
            for i, hs in enumerate(self.holders):
                for r in hs:
                    self._held[r].append(i)
        return self._held.get(rank, [])


class _Chunks(Sequence):
    """A per-chunk sequence of a class computed on access (a class may have millions of chunks)."""

    def __init__(self, n: int, get: Any) -> None:
        self._n, self._get = n, get

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return [self._get(k) for k in range(*i.indices(self._n))]
        if not -self._n <= i < self._n:
            raise IndexError(i)
        return self._get(i % self._n)


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
    unique: list[Box],
    holders: list[list[int]],
    chunk_shape: tuple[int, ...],
    options: PlanOptions,
    dtype: str,
) -> _Class:
    inner = split_chunk(chunk_shape, itemsize, options.inner_chunk_bytes)
    check_loadable(name, shape, dtype, chunk_shape, inner)  # before the chunks are enumerated
    choice, straddle, kind = region_choice(shape, chunk_shape, unique, holders)
    uses: list[list[tuple[int, int]]] = [[] for _ in unique]
    for ci, pieces in straddle.items():
        for pi, (_p, r) in enumerate(pieces):
            uses[r].append((ci, pi))
    nbytes = _chunk_bytes(shape, chunk_shape, itemsize)
    single = np.asarray([h[0] if len(h) == 1 else -1 for h in holders], dtype=np.int64)
    forced = single[choice] if len(choice) else np.zeros(0, dtype=np.int64)
    derived = kind != GENERIC and not (forced < 0).any() and len(forced) <= MAX_DERIVED_WRITERS
    forced.flags.writeable = False  # shared by every tensor of the class
    return _Class(
        shape,
        unique,
        holders,
        (chunk_shape, inner),
        choice,
        straddle,
        uses,
        nbytes,
        forced,
        bool(straddle),
        bool(derived),
        kind != GENERIC and not straddle and len(forced) <= MAX_DERIVED_WRITERS,
    )


def _chunk_bytes(shape: tuple[int, ...], chunk: tuple[int, ...], itemsize: int) -> np.ndarray:
    """Bytes of every chunk of the grid (edge chunks clipped), row-major."""
    if not shape:
        return np.asarray([itemsize], dtype=np.int64)
    out = np.ones(1, dtype=np.int64) * itemsize
    for s, c in zip(shape, chunk):
        if s == 0:
            return np.zeros(0, dtype=np.int64)
        lengths = np.minimum(c, s - np.arange(0, s, c, dtype=np.int64))
        out = np.multiply.outer(out, lengths).ravel()
    return out


def _grids(
    keyed: dict[Any, tuple[str, TensorRule, list[Box], list[list[int]], int | None]],
    uses: Mapping[Any, int],
    options: PlanOptions,
) -> dict[Any, tuple[int, ...]]:
    """The chunk grid of every class: nested where one exists, else flat runs over flat ranges sized
    together for the save (:func:`~arraycheckpoint.planning.chunking.choose_runs`), else whole rows."""
    grids: dict[Any, tuple[int, ...]] = {}
    runs: list[tuple[Any, list[RunOption], int, int]] = []
    total = 0
    for key, (_name, t, unique, holders, cap) in keyed.items():
        total += math.prod(t.shape) * t.itemsize * uses[key]
        grid, nested = tensor_chunk_shape(t.shape, t.itemsize, unique, options, cap)
        grids[key] = grid
        if nested:
            continue
        intervals = [flat_interval(t.shape, b) for b in unique]
        if any(iv is None for iv in intervals):
            continue
        cuts = holder_cuts(np.asarray(intervals, dtype=np.int64), [tuple(h) for h in holders])
        limit = max(t.itemsize, min(options.max_chunk_bytes, cap or options.max_chunk_bytes))
        opts, start = run_options(t.shape, t.itemsize, cuts, limit, options)
        runs.append((key, opts, start, uses[key]))
    if runs:
        picks = choose_runs([(o, s, k) for _key, o, s, k in runs], int(options.range_move_share * total))
        for (key, opts, _s, _k), j in zip(runs, picks):
            grids[key] = opts[j].chunk
    return grids


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
    positions = sum(len(m.ranks) for d, _r in groups for m in d.meshes)
    if positions > MAX_MESH_RANKS:  # readers refuse such metadata (format.metadata): never commit it
        raise PlanError(
            f"the layouts' meshes name {positions} rank positions in all, above the {MAX_MESH_RANKS} a reader "
            "accepts; declare fewer distinct meshes (or boxes)"
        )
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

    names = sorted(contribs)
    # tensors with the same contributions (up to the name) share one analysis: a class, numbered here once
    # per tensor (its key, which holds every contribution's rule, is hashed once, not at every lookup)
    class_of: dict[Any, int] = {}
    keys: dict[str, int] = {}
    key_of: list[Any] = []
    regions_by_key: dict[int, dict[Box, list[int]]] = {}
    uses: dict[int, int] = defaultdict(int)  # tensors per class: a replicated region counts once per tensor
    for name in names:
        t = first[name]
        key = (t.shape, t.itemsize, t.dtype, tuple((id(d), id(r), x.rule) for d, r, x in contribs[name]))
        k = keys[name] = class_of.setdefault(key, len(class_of))
        if k == len(key_of):
            key_of.append(key)
            regions_by_key[k] = _regions_of(name, contribs[name])
        uses[k] += 1
    caps = replica_caps(
        (
            (b.volume * key_of[k][1] * uses[k], sorted(hs))
            for k, regions in regions_by_key.items()
            for b, hs in regions.items()
            if len(hs) > 1
        ),
        options.inner_chunk_bytes,
        options.write_balance,
        options.max_chunk_bytes,
    )
    keyed: dict[Any, tuple[str, TensorRule, list[Box], list[list[int]], int | None]] = {}
    for name in names:
        key = keys[name]
        if key not in keyed:
            regions = regions_by_key[key]
            unique = sorted(regions)
            _validate_cover(name, first[name].shape, unique)
            cap = min((caps[tuple(sorted(hs))] for hs in regions.values() if len(hs) > 1), default=None)
            keyed[key] = (name, first[name], unique, [sorted(regions[b]) for b in unique], cap)
    grids = _grids(keyed, uses, options)
    classes: dict[str, _Class] = {}
    cache: dict[Any, _Class] = {}
    for name in names:
        t, key = first[name], keys[name]
        c = cache.get(key)
        if c is None:
            _n, _t, unique, holders, _cap = keyed[key]
            c = cache[key] = _analyse(
                t.shape, t.itemsize, name, unique, holders, grids[key], options, t.dtype
            )
        classes[name] = c

    # forced chunks (one holder) first, then the tensors with many replicated chunks by the cyclic rule
    # (largest first, each its best shift), then the other replicated chunks by worst fit: largest first,
    # ties by (name, index) (arraycheckpoint.planning.owners), stored as the rule where a shift states them
    load = np.zeros(world, dtype=np.int64)
    cyclic: list[str] = []
    shifts: dict[str, int] = {}
    class_load: dict[int, tuple[np.ndarray, list[int]]] = {}  # per class: bytes per rank, its free chunks
    writers: dict[str, np.ndarray] = {}
    uses_of: dict[int, int] = {}  # tensors per class
    order = []
    for name in names:
        c = classes[name]
        got = class_load.get(id(c))
        if got is None:
            own = c.forced >= 0
            got = class_load[id(c)] = (
                np.bincount(c.forced[own], weights=c.nbytes[own], minlength=world).astype(np.int64),
                np.nonzero(~own)[0].tolist(),
            )
        uses_of[id(c)] = uses_of.get(id(c), 0) + 1
        free = got[1]
        if free and c.cyclable and len(c.nbytes) > CYCLIC_MIN_CHUNKS and c.cycle.balances:
            cyclic.append(name)
            continue
        writers[name] = c.forced.copy() if free else c.forced  # all forced: the class's array, shared
        if free:
            order.extend((-int(c.nbytes[ci]), name, ci) for ci in free)
    for cid, n in uses_of.items():  # each class's bytes per rank, once per tensor of the class
        load += class_load[cid][0] * n
    for name, (shift, ws) in cycle_shifts(
        [(n, classes[n].cycle, classes[n].nbytes) for n in cyclic], load
    ).items():
        shifts[name], writers[name] = shift, ws
    order.sort()
    fit = WorstFit(load)
    for neg, name, ci in order:
        writers[name][ci] = fit.pick(-neg, classes[name].candidates(ci))
    ruled = sorted({n for _nb, n, _ci in order if classes[n].cyclable})  # worst-fit writers a shift states
    shifts.update(Cycle.stated([(n, classes[n].cycle, writers[n]) for n in ruled]))

    files = [0] * world
    decided: dict[str, tuple[ArrayLayout, np.ndarray, int, bool, int | None]] = {}
    firsts: dict[int, int] = {}  # writer array -> its first chunk's writer
    # readers bound the derived writers of a checkpoint and the ranks visited deriving them: list the rest
    derived_total, visits_total, counted = 0, 0, set()
    for name in names:
        t, c = first[name], classes[name]
        shift = shifts.get(name)
        derived = c.derived or shift is not None
        if derived and (id(c), shift) not in counted:
            visits = sum(rule_visits(t.shape, x.rule, d.meshes, len(r)) for d, r, x in contribs[name])
            derived = (
                derived_total + len(c.forced) <= MAX_DERIVED_WRITERS_TOTAL
                and visits_total + visits <= MAX_DERIVED_RANK_VISITS
            )
            if derived:
                derived_total += len(c.forced)
                visits_total += visits
                counted.add((id(c), shift))
        ws = writers[name]
        if len(ws):
            first_writer = firsts.get(id(ws))
            if first_writer is None:  # a writer array shared by the tensors of a class: once
                ws.flags.writeable = False
                first_writer = firsts[id(ws)] = int(ws[0])
            creator = first_writer
        else:
            ws.flags.writeable = False
            creator = min(range(world), key=lambda r: (files[r], r))
        files[creator] += 1
        layout = ArrayLayout(
            name, t.shape, t.dtype, c.layout_shape[0], c.layout_shape[1], options.compression
        )
        decided[name] = (layout, ws, creator, derived, shift if derived else None)
    packs = assign_packs(
        {n: d[:3] for n, d in decided.items()},
        {n: first[n].itemsize for n in names},
        options.pack_array_bytes,
        options.min_chunk_bytes,
    )
    tensors = {
        n: TensorDecision(layout, ws, creator, packs.get(n), derived, shift)
        for n, (layout, ws, creator, derived, shift) in decided.items()
    }
    # a class's regions, an array's writers and a layout but its name, hashed once for all sharers; the
    # digest of every tensor's lines, hashed in one update (the same digest as one update per line)
    lines: list[bytes] = []
    digests: dict[Any, bytes] = {}
    for name in names:
        d, c = tensors[name], classes[name]
        if id(c) not in digests:
            ch = hashlib.sha1()
            for b, hs in zip(c.boxes, c.holders):
                ch.update(repr((b.offsets, b.lengths, hs)).encode())
            digests[id(c)] = ch.digest()
        ws = writers[name]
        if id(ws) not in digests:
            digests[id(ws)] = hashlib.sha1(ws.tobytes()).digest()
        lay = d.layout
        fields = (lay.shape, lay.dtype, lay.chunk_shape, lay.inner_chunk_shape, lay.compression)
        if fields not in digests:
            digests[fields] = repr(fields).encode()
        lines += (
            f"{name}\0{d.creator}\0{d.pack}\0{d.derived}\0{d.shift}\0".encode(),
            digests[fields],
            digests[id(ws)],
            digests[id(c)],
        )
    h = hashlib.sha1(b"".join(lines))
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
    # tensors of one class share its chunks, and those whose writers follow from the layout share one writer
    # array: this rank's chunks of a writer array, and a chunk's box and sourced pieces, are worked out once
    # (100,000 small tensors are a handful of classes)
    chosen: dict[int, list[int]] = {}
    sourced: dict[tuple[int, int], tuple[Box, tuple[Piece, ...]]] = {}
    for name in sorted(plan.tensors):
        d = plan.tensors[name]
        c = plan._classes[name]
        ws = d.writers
        if d.creator == rank:
            mine.add(name)
        cis = chosen.get(id(ws))
        if cis is None:
            cis = chosen[id(ws)] = np.nonzero(ws == rank)[0].tolist()
        for ci in cis:
            got = sourced.get((id(c), ci))
            if got is None:
                resolved = []
                for box, region in c.pieces_of(ci):
                    hs = c.holders[region]
                    resolved.append(Piece(box, rank if _holds(hs, rank) else fragment_source(hs, rank)))
                got = sourced[(id(c), ci)] = (c.chunk(ci), tuple(resolved))
            recvs.extend(Transfer(name, p.box, p.src, rank) for p in got[1] if p.src != rank)
            writes.append(ChunkWrite(name, got[0], got[1]))
            mine.add(name)
        if not c.straddles:
            continue  # no chunk lies in several regions: no fragment leaves this rank
        outgoing = []
        for region in c.held_by(rank):
            hs = c.holders[region]
            for ci, pi in c.uses[region]:
                w = int(ws[ci])
                if w != rank and not _holds(hs, w) and fragment_source(hs, w) == rank:
                    outgoing.append((ci, pi, w))
        for ci, pi, w in sorted(outgoing):  # chunk order, as the reference planner lists them
            sends.append(Transfer(name, c.straddle[ci][pi][0], rank, w))
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
