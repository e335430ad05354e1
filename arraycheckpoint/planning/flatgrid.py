"""Which region each chunk of a grid belongs to, and the chunk grids of flat ranges (pure, vectorised).

Every chunk of a stored array is written by one rank. :func:`region_choice` says, for every chunk of a grid,
the saved region whose holders hold the most of it: the one region containing it when the grid nests in the
regions, else (a grid over flat ranges, FSDP1) the holder set with the most elements in it, ties going to
the set whose first piece comes first. When every chosen region has a single holder, the writer of every
chunk is a pure function of the layout (the regions and the grid): the metadata then stores no writer list
(``"writers": "held"``) and a reader derives it with :func:`held_writers`, the code the planner ran.

Flat ranges (a tensor's row-major elements split anywhere, as FSDP1's flat parameters are) admit no nested
grid finer than the tensor. Their grids are *flat runs*: chunks ``(1, ..., 1, a, n_{d+1}, ..., n_k)``, each a
contiguous run of the flattened tensor (sub-row runs where ``a`` divides ``n_d``), so the chunk that
straddles a rank boundary holds at most one run and only its smaller side travels (:func:`run_shapes`,
:func:`moved_elements`). Work grows with regions and chunks, never regions x chunks.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .regions import Box, intersect

NESTED, FLAT, GENERIC = "nested", "flat", "generic"


def flat_interval(shape: Sequence[int], box: Box) -> tuple[int, int] | None:
    """``[start, stop)`` of ``box`` in the flattened tensor when its elements are contiguous there (1 in
    every dimension before some ``d``, whole in every dimension after it), else None."""
    d = next((i for i, n in enumerate(box.lengths) if n != 1), len(shape) - 1)
    if any(box.lengths[i] != shape[i] or box.offsets[i] for i in range(d + 1, len(shape))):
        return None
    start = 0
    for o, s in zip(box.offsets, shape):
        start = start * s + o
    return start, start + box.volume


def is_run(shape: Sequence[int], chunk: Sequence[int]) -> bool:
    """Whether every chunk of the grid ``chunk`` is one contiguous run of the flattened tensor, all runs of
    one length (the last one may be shorter): 1 before some dimension ``d``, whole after it, and dividing
    ``shape[d]`` unless ``d`` is 0."""
    d = next((i for i, c in enumerate(chunk) if c != 1), len(shape) - 1)
    if any(chunk[i] != max(shape[i], 1) for i in range(d + 1, len(shape))):
        return False
    return d == 0 or shape[d] % chunk[d] == 0


def run_shapes(shape: Sequence[int], itemsize: int, limit: int, floor: int) -> list[tuple[int, ...]]:
    """The flat-run chunk shapes of a tensor, largest first: runs of at most ``limit`` bytes and at least
    ``floor`` bytes (the smallest run above ``limit`` is never offered; when no run is at least ``floor``,
    the largest within ``limit`` is the only one). Rows: powers of two and the whole extent; within a row,
    every divisor of the dimension cut."""
    shape = tuple(max(int(s), 1) for s in shape)
    out: dict[int, tuple[int, ...]] = {}
    for d, n in enumerate(shape):
        tail = math.prod(shape[d + 1 :])
        parts = {n, *(1 << k for k in range(n.bit_length()) if (1 << k) <= n)} if d == 0 else _divisors(n)
        for a in parts:
            if d and a == n:
                continue  # the same run as one whole row of the dimension before
            m = a * tail
            if m * itemsize <= limit:
                out.setdefault(m, (1,) * d + (a,) + shape[d + 1 :])
    if not out:
        out[1] = (1,) * len(shape)
    runs = sorted(out, reverse=True)
    kept = [m for m in runs if m * itemsize >= floor] or runs[:1]
    return [out[m] for m in kept]


def _divisors(n: int) -> set[int]:
    small = [k for k in range(1, math.isqrt(n) + 1) if n % k == 0]
    return {*small, *(n // k for k in small)}


def holder_cuts(intervals: np.ndarray, keys: Sequence[object]) -> np.ndarray:
    """Interior positions where the holder set changes along the flattened tensor (``intervals``: sorted
    ``[start, stop)`` rows covering it, ``keys`` the holder set of each)."""
    if len(intervals) < 2:
        return np.zeros(0, dtype=np.int64)
    change = [i for i in range(1, len(keys)) if keys[i] != keys[i - 1]]
    return intervals[change, 0].astype(np.int64)


def moved_elements(cuts: np.ndarray, n: int, run: int) -> int:
    """An upper bound of the elements that travel under a grid of runs of ``run`` elements over a flat
    tensor of ``n`` elements whose holder set changes at ``cuts`` (sorted): each chunk a cut falls inside is
    written by the holder of its largest piece, the rest of it travels (pieces of one holder set are not
    summed across another set's piece, hence an upper bound)."""
    inside = cuts[cuts % run != 0]
    if not len(inside):
        return 0
    chunk = inside // run
    start = chunk * run
    first = np.ones(len(inside), dtype=bool)
    first[1:] = chunk[1:] != chunk[:-1]
    prev = np.where(first, start, np.roll(inside, 1))
    left = inside - prev  # the piece before each cut
    heads = np.flatnonzero(first)
    last = np.append(heads[1:], len(inside)) - 1
    tail = np.minimum(start[last] + run, n) - inside[last]  # each chunk's piece after its last cut
    biggest = np.maximum(np.maximum.reduceat(left, heads), tail)
    return int((np.minimum(start[heads] + run, n) - start[heads] - biggest).sum())


def region_choice(
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    boxes: Sequence[Box],
    holders: Sequence[Sequence[int]],
    generic: bool = True,
) -> tuple[np.ndarray, dict[int, list[tuple[Box, int]]], str]:
    """Per chunk of the grid ``chunk`` (row-major), the index of the region (of ``boxes``: distinct, sorted,
    covering the tensor) whose holders write it, the pieces of every chunk that lies in several regions
    (``chunk -> [(piece, region)]``, regions in order) and the path taken: ``nested`` (each chunk lies in
    one region), ``flat`` (flat runs over contiguous regions) or ``generic`` (any other grid, chunk by
    chunk; refused with ``generic=False``: a ValueError, as readers derive writers for the first two only).
    """
    counts = [-(-max(s, 1) // c) for s, c in zip(shape, chunk)]
    if not shape or math.prod(shape) == 0:
        return np.zeros(1 if not shape else 0, dtype=np.int64), {}, NESTED
    if _nests(shape, chunk, boxes):
        choice = np.full(counts, -1, dtype=np.int64)
        for r, b in enumerate(boxes):
            choice[tuple(slice(o // c, -(-(o + n) // c)) for o, n, c in zip(b.offsets, b.lengths, chunk))] = r
        return choice.ravel(), {}, NESTED
    intervals = [flat_interval(shape, b) for b in boxes] if is_run(shape, chunk) else None
    if intervals is not None and all(iv is not None for iv in intervals):
        return _flat_choice(shape, chunk, boxes, np.asarray(intervals, dtype=np.int64), holders) + (FLAT,)
    if not generic:
        raise ValueError("the chunk grid neither nests in the saved regions nor runs along flat ranges")
    return _generic_choice(shape, chunk, boxes, holders) + (GENERIC,)


def _nests(shape: Sequence[int], chunk: Sequence[int], boxes: Sequence[Box]) -> bool:
    return all(
        e % c == 0 or e == s
        for b in boxes
        for o, n, c, s in zip(b.offsets, b.lengths, chunk, shape)
        for e in (o, o + n)
    )


def _most_held(pieces: list[tuple[Box, int]], holders: Sequence[Sequence[int]]) -> int:
    """The region whose holder set holds the most of a chunk (pieces summed per holder set; ties: the set
    whose first piece comes first), as the lowest index of that set's regions in the chunk."""
    held: dict[tuple[int, ...], list[int]] = {}
    for box, region in pieces:
        entry = held.setdefault(tuple(holders[region]), [0, region])
        entry[0] += box.volume
    return min(held.values(), key=lambda x: (-x[0], x[1]))[1]


def chunk_box(shape: Sequence[int], chunk: Sequence[int], counts: Sequence[int], flat: int) -> Box:
    """Chunk ``flat`` (row-major) of the grid, clipped to the tensor."""
    if not 0 <= flat < math.prod(counts):
        raise ValueError(f"chunk {flat} is outside a grid of {list(counts)} chunks")
    idx = []
    for n in reversed(counts):  # numpy's unravel_index, without its per-call cost (once per chunk written)
        flat, i = divmod(flat, n)
        idx.append(i)
    offsets = tuple(int(i) * c for i, c in zip(reversed(idx), chunk))
    return Box(offsets, tuple(min(c, s - o) for o, c, s in zip(offsets, chunk, shape)))


def _flat_choice(
    shape: tuple[int, ...], chunk: tuple[int, ...], boxes: Sequence[Box], iv: np.ndarray, holders
) -> tuple[np.ndarray, dict[int, list[tuple[Box, int]]]]:
    n = math.prod(shape)
    run = math.prod(chunk)
    order = np.argsort(iv[:, 0], kind="stable")  # sorted boxes are in flat order already; be sure
    starts = iv[order, 0]
    count = -(-n // run)
    choice = order[np.searchsorted(starts, np.arange(count, dtype=np.int64) * run, side="right") - 1]
    counts = [-(-max(s, 1) // c) for s, c in zip(shape, chunk)]
    straddle: dict[int, list[tuple[Box, int]]] = {}
    cuts = starts[1:]
    for ci in np.unique(cuts[cuts % run != 0] // run).tolist():
        box = chunk_box(shape, chunk, counts, ci)
        lo, hi = ci * run, min(ci * run + run, n)
        first, last = np.searchsorted(starts, [lo, hi - 1], side="right") - 1
        pieces = [(intersect(box, boxes[int(order[k])]), int(order[k])) for k in range(first, last + 1)]
        pieces = [(p, r) for p, r in pieces if p is not None]
        straddle[ci] = pieces
        choice[ci] = _most_held(pieces, holders)
    return choice, straddle


def _generic_choice(
    shape: tuple[int, ...], chunk: tuple[int, ...], boxes: Sequence[Box], holders
) -> tuple[np.ndarray, dict[int, list[tuple[Box, int]]]]:
    import bisect

    from .regions import chunk_boxes

    starts = [b.offsets[0] for b in boxes]
    longest = max(b.lengths[0] for b in boxes)
    choice = []
    straddle: dict[int, list[tuple[Box, int]]] = {}
    for ci, c in enumerate(chunk_boxes(shape, chunk)):
        lo, hi = c.offsets[0], c.offsets[0] + c.lengths[0]
        idx = range(bisect.bisect_right(starts, lo - longest), bisect.bisect_left(starts, hi))
        pieces = [(p, i) for i in idx if (p := intersect(boxes[i], c)) is not None]
        if len(pieces) > 1:
            straddle[ci] = pieces
        choice.append(_most_held(pieces, holders))
    return np.asarray(choice, dtype=np.int64), straddle


def held_writers(
    shape: tuple[int, ...], chunk: tuple[int, ...], boxes: Sequence[Box], holders: Sequence[Sequence[int]]
) -> np.ndarray:
    """The writer of every chunk of a layout whose writers are derived (``"writers": "held"``): the one
    holder of the region :func:`region_choice` picks (nested or flat-run grids only).

    The regions (untrusted: read from a checkpoint) must cut the tensor exactly, checked in
    O(regions + chunks) before anything is painted (:func:`partition_problem`).

    Raises:
        ValueError: the grid is neither, the regions overlap or leave part of the tensor unsaved, or a chosen
            region has several holders (its writer was picked by worst fit, which the metadata lists).
    """
    problem = partition_problem(shape, chunk, boxes)
    if problem is not None:
        raise ValueError(problem)
    choice, _s, _k = region_choice(shape, chunk, boxes, holders, generic=False)
    single = np.asarray([h[0] if len(h) == 1 else -1 for h in holders], dtype=np.int64)
    out = single[choice] if len(choice) else choice
    if len(out) and int(out.min()) < 0:
        raise ValueError("a chunk lies in a region held by several ranks: its writer is not derived")
    return out


def partition_problem(shape: Sequence[int], chunk: Sequence[int], boxes: Sequence[Box]) -> str | None:
    """Why the distinct, non-empty ``boxes`` (inside ``shape``) do not cut the tensor exactly into disjoint
    parts, or None when they do; only for the grids whose writers a reader derives (a nested grid: compared
    in whole chunks; flat runs: compared as intervals of the flattened tensor), else None (refused by
    :func:`region_choice`). Linear in regions and chunks, never regions x regions: the regions come from
    a checkpoint, and a few hundred bytes of mesh rule can name millions."""
    n = math.prod(shape) if shape else 1
    if not shape or n == 0:
        return None
    if _nests(shape, chunk, boxes):
        counts = [-(-s // c) for s, c in zip(shape, chunk)]
        spans = [
            math.prod(-(-(o + k) // c) - o // c for o, k, c in zip(b.offsets, b.lengths, chunk))
            for b in boxes
        ]
        if sum(spans) != math.prod(counts):  # chunks of a nested grid: disjoint and covering iff each once
            return (
                f"its regions hold {sum(spans)} chunks of its {math.prod(counts)} (counted with repeats): "
                "they overlap or do not cover it"
            )
        seen = np.zeros(counts, dtype=bool)
        for b in boxes:  # each chunk painted once at most (the sum above), so linear in the chunks
            seen[tuple(slice(o // c, -(-(o + k) // c)) for o, k, c in zip(b.offsets, b.lengths, chunk))] = (
                True
            )
        if not seen.all():
            return "its regions overlap and do not cover it"
        return None
    if not is_run(shape, chunk):
        return None
    intervals = [flat_interval(shape, b) for b in boxes]
    if any(iv is None for iv in intervals):
        return None
    iv = np.asarray(sorted(intervals), dtype=np.int64).reshape(-1, 2)  # type: ignore[arg-type]
    if len(iv) == 0 or iv[0, 0] != 0 or iv[-1, 1] != n or not np.array_equal(iv[1:, 0], iv[:-1, 1]):
        return "its regions, as ranges of the flattened tensor, overlap or do not cover it"
    return None
