"""Who writes each chunk (pure): one of the ranks that already hold it, by worst fit on bytes.

Chunk grids nest in the saved regions (:mod:`arraycheckpoint.planning.chunking`), so every chunk lies inside one
region and the candidates to write it are that region's holders: one rank for a sharded region (FSDP2,
Megatron TP, JAX; no choice), every replica for a replicated one (DDP, data-parallel replicas, replicated
JAX or DTensor placements). Replicated chunks are placed largest first on the least-loaded holder (the
lowest rank among equals), after every forced chunk is counted: replicas are written once and the bytes
each rank writes stay within ``write_balance`` of the mean wherever the regions allow it (the planner caps
replicated chunks for that: :func:`replica_caps`). No chunk is ever written by a rank that lacks its bytes,
so no tensor byte travels.

The one exception, a chunk of a flat-run grid over flat ranges (FSDP1), is written by a holder of its largest
piece; each piece it lacks comes from :func:`fragment_source`.

A tensor with many replicated chunks (more than :data:`CYCLIC_MIN_CHUNKS`: a stacked mixture-of-experts
weight at thousands of ranks has thousands) whose holder sets are small (every shift is tried) or each hold
at least one of its chunks per holder takes its writers from a rule instead (:class:`Cycle`, format 8:
``"writers": ["cyclic", shift]``): the chunks of each holder set, in row-major order, go round its holders
starting ``shift`` places on, so the metadata stores one number instead of one rank per chunk and a reader
derives them (:func:`cyclic_writers`). The planner picks each such tensor's shift for balance, largest tensors
first (:func:`best_shift`); the other tensors then fill in by worst fit, and where one shift states a tensor's
worst-fit writers (:meth:`Cycle.stated`; wide holder sets of symmetric layouts, where the least loaded holders
come round in order) they are stored as that rule too: the plan is the worst fit's, only its encoding changes.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterable, Sequence
from functools import cached_property

import numpy as np

from .flatgrid import partition_problem, region_choice
from .regions import Box

#: A tensor with replicated chunks and more chunks than this takes its writers from a rule (:class:`Cycle`),
#: not a list, where the rule balances (:attr:`Cycle.balances`): what listing them would cost the metadata (a
#: few bytes per chunk) stays below a few hundred bytes per tensor, and the small tensors every test and
#: small save has keep the worst fit.
CYCLIC_MIN_CHUNKS = 64
#: A tensor whose replicated chunks the worst fit placed, with more chunks than this, stores its writers as
#: ``["cyclic", shift]`` where one shift states every one of them (:meth:`Cycle.stated`): the same plan in
#: about 15 bytes instead of a few per chunk (symmetric layouts such as megatron's dense towers over
#: data-parallel replicas: each (PP, TP) position's replicas carry the same load, so the worst fit goes
#: round them in order).
RULED_MIN_CHUNKS = 8
#: Shifts the planner tries per tensor (all of them when the largest holder set is no larger).
SHIFT_CANDIDATES = 32


def fragment_source(holders: Sequence[int], owner: int) -> int:
    """The holder that sends a region's fragment to ``owner`` (which does not hold it): ``holders[owner mod
    len(holders)]`` (``holders`` sorted), so replicas take turns over the owners."""
    return int(holders[owner % len(holders)])


def replica_caps(
    regions: Iterable[tuple[int, Sequence[int]]], min_bytes: int, balance: float, max_bytes: int
) -> dict[tuple[int, ...], int]:
    """The largest chunk of a region replicated on each holder set: ``(balance - 1)`` of the bytes a holder
    of the set writes on average from it (at least ``min_bytes``, at most ``max_bytes``).

    ``regions`` lists (bytes, sorted holders) of every distinct replicated region of the save. A worst fit
    that places chunks largest first leaves no rank more than its last (smallest) chunk above the mean, so
    chunks of at most ``(balance - 1) x`` a rank's share keep every holder within ``balance`` of it.
    """
    total: dict[tuple[int, ...], int] = {}
    for nbytes, holders in regions:
        key = tuple(holders)
        total[key] = total.get(key, 0) + nbytes
    return {
        key: min(max_bytes, max(min_bytes, int((balance - 1) * b / len(key)))) for key, b in total.items()
    }


class WorstFit:
    """Worst-fit placement of replicated chunks over ``load`` (bytes each rank already writes: the forced
    chunks). Feed the chunks largest first (ties in a deterministic order) with :meth:`pick`."""

    def __init__(self, load: np.ndarray) -> None:
        self.load = load.astype(np.int64, copy=True)
        self._heap = [(int(x), r) for r, x in enumerate(self.load.tolist())]  # refreshed lazily
        heapq.heapify(self._heap)

    def _least(self) -> int:
        while True:
            load, r = self._heap[0]
            if load == self.load[r]:
                return r
            heapq.heapreplace(self._heap, (int(self.load[r]), r))

    def pick(self, nbytes: int, holders: np.ndarray) -> int:
        """The writer of a chunk of ``nbytes`` held by the sorted ``holders``: the least loaded of them (the
        lowest rank among equals). Records its load."""
        if len(holders) == len(self.load):  # held everywhere: the heap answers without a scan
            r = self._least()
        elif len(holders) == 1:
            r = int(holders[0])
        else:
            r = int(holders[np.argmin(self.load[holders])])
        self.load[r] += nbytes  # its heap entry is now stale: _least refreshes it when it reaches the top
        return r


class Cycle:
    """The writers of a chunk grid under the cyclic rule: chunk ``ci`` lies in region ``choice[ci]`` whose
    sorted holders are ``H``; among the chunks whose region has the same holder set, in row-major order, the
    ``j``-th is written by ``H[(j + shift) % len(H)]`` (a region with one holder: that holder, as
    ``"writers": "held"`` says). Built once per layout; :meth:`writers` per shift.

    A reader builds one per layout of a checkpoint (untrusted: up to 2^26 chunks an array), so per chunk it
    keeps only its holder set (:attr:`sid`, the smallest unsigned type that numbers the sets) and its place in
    the set (:attr:`ordinal`, int32 below 2^31 chunks), and works in blocks of :data:`_BLOCK` chunks: 2^26
    chunks took 3.7 GB and 9 s (seven int64 arrays per chunk, kept per layout, and a comparison sort)."""

    def __init__(self, choice: np.ndarray, holders: Sequence[Sequence[int]]) -> None:
        keys: dict[tuple[int, ...], int] = {}
        set_of_region = [keys.setdefault(tuple(h), len(keys)) for h in holders]
        #: holders of each set, and where they start in :attr:`flat`
        self.sizes = np.asarray([len(k) for k in keys], dtype=np.int64)
        self.offsets = np.zeros(len(self.sizes), dtype=np.int64)
        np.cumsum(self.sizes[:-1], out=self.offsets[1:])
        self.flat = np.fromiter(
            itertools.chain.from_iterable(keys), dtype=np.int64, count=int(self.sizes.sum())
        )
        n = len(choice)
        kind = next(t for t in (np.uint8, np.uint16, np.uint32, np.int64) if len(keys) <= np.iinfo(t).max + 1)
        if len(keys) == 1 or not n:  # one holder set (every chunk replicated on the same ranks): no gather
            self.sid = np.zeros(n, dtype=kind)
            counts = np.full(len(self.sizes), n, dtype=np.int64)
        else:
            self.sid = np.asarray(set_of_region, dtype=kind)[choice]
            counts = np.bincount(self.sid, minlength=len(self.sizes))
        self.ordinal = np.empty(n, dtype=np.int32 if n < 1 << 31 else np.int64)
        if len(keys) == 1:
            self.ordinal[:] = np.arange(n, dtype=self.ordinal.dtype)
        elif n:
            # the place of each chunk among its set's, in row-major order: a stable sort by set (numpy's
            # radix sort for sets numbered in 8 or 16 bits: linear), then each set's run counted from 0
            starts = np.zeros(len(self.sizes), dtype=np.int64)
            np.cumsum(counts[:-1], out=starts[1:])
            order = np.argsort(self.sid, kind="stable")
            for a in range(0, n, _BLOCK):
                at = order[a : a + _BLOCK]
                self.ordinal[at] = np.arange(a, a + len(at), dtype=np.int64) - starts[self.sid[at]]
            del order
        self.widest = int(self.sizes.max()) if len(self.sizes) else 1
        multi = self.sizes > 1
        # the rule balances as well as a worst fit would: every shift is tried, or every holder set with a
        # choice has a chunk for each of its holders (a tensor spreads over all of them by itself)
        self.balances = self.widest <= SHIFT_CANDIDATES or bool((counts[multi] >= self.sizes[multi]).all())

    @cached_property
    def free(self) -> np.ndarray:
        """The chunks with a choice of writer (their set has several holders; what the planner asks)."""
        return np.flatnonzero((self.sizes > 1)[self.sid])

    @cached_property
    def _firsts(self) -> tuple[list[int], int]:
        """The first chunk of a holder set of each size with a choice, the widest first, those whose size
        adds to the period of the sizes before it only (the shift modulo each of them fixes it within that
        period), up to a period of :data:`SHIFT_CANDIDATES` times the widest; and that period."""
        firsts = np.flatnonzero(self.ordinal == 0)  # one per holder set (a linear pass, no sort of chunks)
        sizes, at = np.unique(self.sizes[self.sid[firsts]], return_index=True)
        out: list[int] = []
        period = 1
        for size, chunk in zip(sizes[::-1].tolist(), firsts[at][::-1].tolist()):
            if size < 2 or (out and period >= int(sizes[-1]) * SHIFT_CANDIDATES):
                break
            if period % size:
                period = math.lcm(period, size)
                out.append(chunk)
        return out, period

    def shifts_of(self, writers: np.ndarray) -> np.ndarray:
        """Per row of ``writers`` (tensors of this layout, one row of writers each, chosen by worst fit): the
        shift whose writers are that row, or -1 when none states them. The writer of the first chunk of a
        widest holder set fixes the shift modulo that set's size, the first chunk of sets of other sizes
        modulo theirs: of the shifts up to the period of those sizes (at most :data:`SHIFT_CANDIDATES` times
        the widest), one is left, then checked against every chunk (all rows at once)."""
        out = np.full(len(writers), -1, dtype=np.int64)
        if not len(self.free) or not len(writers):
            return out
        firsts, period = self._firsts
        widest = int(self.sizes[self.sid[firsts[0]]])
        tries = min(SHIFT_CANDIDATES, -(-period // widest))
        ok = np.ones(len(writers), dtype=bool)
        shifts = np.zeros((len(writers), tries), dtype=np.int64)
        fits = np.ones(shifts.shape, dtype=bool)
        for k, chunk in enumerate(firsts):  # the shift modulo each size, from a set's first chunk
            size, base = int(self.sizes[self.sid[chunk]]), int(self.offsets[self.sid[chunk]])
            members = self.flat[base : base + size]  # sorted ranks
            at = np.minimum(np.searchsorted(members, writers[:, chunk]), size - 1)
            ok &= members[at] == writers[:, chunk]
            residue = (at - int(self.ordinal[chunk])) % size
            if k == 0:  # the widest: the shifts consistent with it
                shifts = residue[:, None] + size * np.arange(tries, dtype=np.int64)
            else:
                fits &= shifts % size == residue[:, None]
        ok &= fits.any(axis=1)
        shift = shifts[np.arange(len(writers)), fits.argmax(axis=1)]
        sizes = self.sizes[self.sid]
        derived = self.flat[self.offsets[self.sid] + (self.ordinal.astype(np.int64) + shift[:, None]) % sizes]
        ok &= (derived == writers).all(axis=1)
        out[ok] = shift[ok]
        return out

    @staticmethod
    def stated(tensors: Sequence[tuple[str, Cycle, np.ndarray]]) -> dict[str, int]:
        """The shift of each tensor (name, its class's :class:`Cycle`, its worst-fit writers) whose writers one
        shift of the cyclic rule states, for tensors of more than :data:`RULED_MIN_CHUNKS` chunks (fewer are
        listed: a rule would save no bytes); the tensors of one class are checked together
        (:meth:`shifts_of`)."""
        groups: dict[int, list[tuple[str, Cycle, np.ndarray]]] = {}
        for t in tensors:
            if len(t[2]) > RULED_MIN_CHUNKS:
                groups.setdefault(id(t[1]), []).append(t)
        out = {}
        for group in groups.values():
            found = group[0][1].shifts_of(np.stack([w for _n, _c, w in group]))
            out.update((name, int(s)) for (name, _c, _w), s in zip(group, found.tolist()) if s >= 0)
        return out

    def writers(self, shift: int, chunks: np.ndarray | None = None) -> np.ndarray:
        """The writer of every chunk (or of ``chunks``) under ``shift``."""
        if chunks is not None:
            sid = self.sid[chunks]
            at = self.ordinal[chunks].astype(np.int64)  # int32 + shift could wrap
            return self.flat[self.offsets[sid] + (at + shift) % self.sizes[sid]]
        out = np.empty(len(self.sid), dtype=np.int64)
        for a in range(0, len(out), _BLOCK):
            sid = self.sid[a : a + _BLOCK]
            at = self.ordinal[a : a + _BLOCK].astype(np.int64)
            at += shift
            at %= self.sizes[sid]
            at += self.offsets[sid]
            out[a : a + _BLOCK] = self.flat[at]
        return out


#: chunks :class:`Cycle` works on at once (its temporaries: a few int64 arrays of this length)
_BLOCK = 1 << 18


def best_shift(cycle: Cycle, nbytes: np.ndarray, load: np.ndarray) -> int:
    """The shift whose writers leave the least loaded ranks: the smallest largest load over the ranks that
    write a chunk with a choice, then the smallest sum of squares (ties: the smallest shift). Tried: every
    shift up to :data:`SHIFT_CANDIDATES`, and the one giving the first free chunk the least loaded holder of
    its set."""
    free = cycle.free
    if not len(free):
        return 0
    candidates = list(range(min(cycle.widest, SHIFT_CANDIDATES)))
    if cycle.widest > SHIFT_CANDIDATES:
        first = int(free[0])
        base, size = int(cycle.offsets[cycle.sid[first]]), int(cycle.sizes[cycle.sid[first]])
        least = int(np.argmin(load[cycle.flat[base : base + size]]))
        candidates.append(int((least - int(cycle.ordinal[first])) % size))
    nb = nbytes[free].astype(np.float64)
    best: tuple[float, float, int] | None = None
    for shift in candidates:
        w = cycle.writers(shift, free)
        ranks, inverse = np.unique(w, return_inverse=True)
        new = load[ranks] + np.bincount(inverse, weights=nb, minlength=len(ranks))
        score = (float(new.max()), float(np.square(new).sum()), shift)
        if best is None or score < best:
            best = score
    assert best is not None
    return best[2]


def cycle_shifts(
    tensors: Sequence[tuple[str, Cycle, np.ndarray]], load: np.ndarray
) -> dict[str, tuple[int, np.ndarray]]:
    """Each tensor's shift and writers under the cyclic rule (``tensors``: name, its class's :class:`Cycle`,
    bytes per chunk), largest tensors first (ties by name), each the :func:`best_shift` over ``load`` (bytes
    each rank writes already; updated). Tensors of one class and shift share one read-only writer array."""
    weight = {id(cy): int(nb[cy.free].sum()) for _n, cy, nb in tensors}
    shared: dict[tuple[int, int], np.ndarray] = {}
    out = {}
    for name, cy, nb in sorted(tensors, key=lambda x: (-weight[id(x[1])], x[0])):
        shift = best_shift(cy, nb, load)
        ws = shared.get((id(cy), shift))
        if ws is None:
            ws = shared[(id(cy), shift)] = cy.writers(shift)
        out[name] = (shift, ws)
        load += np.bincount(ws[cy.free], weights=nb[cy.free], minlength=len(load)).astype(np.int64)
    return out


def cyclic_writers(
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    boxes: Sequence[Box],
    holders: Sequence[Sequence[int]],
    shift: int,
) -> np.ndarray:
    """The writers a reader derives for ``"writers": ["cyclic", shift]`` (format 8): :class:`Cycle` over the
    region :func:`~arraycheckpoint.planning.flatgrid.region_choice` picks for each chunk (nested or flat-run
    grids only), the code the planner ran.

    Raises:
        ValueError: the regions (untrusted: read from a checkpoint) do not cut the tensor exactly, or the grid
            is neither nested nor flat runs.
    """
    return cycle_of(shape, chunk, boxes, holders).writers(shift)


def cycle_of(
    shape: tuple[int, ...], chunk: tuple[int, ...], boxes: Sequence[Box], holders: Sequence[Sequence[int]]
) -> Cycle:
    """The :class:`Cycle` of a layout read from a checkpoint (any shift's writers follow from it), after the
    checks of :func:`cyclic_writers` (ValueError)."""
    problem = partition_problem(shape, chunk, boxes)
    if problem is not None:
        raise ValueError(problem)
    choice, _s, _k = region_choice(shape, chunk, boxes, holders, generic=False)
    return Cycle(choice, holders)
