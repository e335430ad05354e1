"""Chunk grids: how big each stored file of a tensor is (pure arithmetic, no I/O).

A chunk is written by one rank, and a save moves no tensor bytes between ranks, so every chunk grid *nests*
in the saved regions: every interior region boundary lies on the grid (:func:`tensor_chunk_shape`). The
coarsest such grid has one chunk per region (per dimension, the gcd of the interior boundaries); it is split
by divisors down to ``max_chunk_bytes`` (never above it) and, for replicated regions, down to the size that
lets the worst fit over their holders keep every rank within ``write_balance`` of the mean (a ``cap`` from
the planner). It is never coarsened across a boundary: chunk files smaller than the target file size
(``min_chunk_bytes``) go into their writer's packs (:mod:`arraycheckpoint.planning.packing`), which bound the number
of files without moving bytes.

The one layout no regular grid nests in is a flat range cut anywhere inside a row (FSDP1's flat parameters,
ZeRO): a nested grid would be one row or less. Such tensors get a grid of flat runs
(:func:`arraycheckpoint.planning.flatgrid.run_shapes`: whole rows, or sub-row runs that divide a row); the
chunk that straddles a rank boundary is written by the holder of most of it and only the rest of that chunk
travels. :func:`choose_runs` sizes the runs: at most ``1 / ROW_SPREAD`` of the elements between two
boundaries (not below ``min_chunk_bytes / RUN_START_DIV``), then smaller where needed, down to
``min_chunk_bytes / ROW_FLOOR_DIV``, until at most ``range_move_share`` of the save's bytes travels, the
refinements that spare the most bytes per added chunk first.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import numpy as np

from .regions import Box

NEST_FACTOR = 4  # a nested grid of more than this many chunks per region: the regions are flat ranges
ROW_SPREAD = 32  # straddling grids start at chunks of 1/ROW_SPREAD of a region (the part that may travel)
ROW_FLOOR_DIV = 4096  # ... and of at least min_chunk_bytes / ROW_FLOOR_DIV bytes (runs of flat ranges)
RUN_START_DIV = 256  # flat runs start at no less than min_chunk_bytes / RUN_START_DIV bytes


class _Sizes(Protocol):
    min_chunk_bytes: int
    max_chunk_bytes: int


def tensor_chunk_shape(
    shape: tuple[int, ...], itemsize: int, boxes: Sequence[Box], options: _Sizes, cap: int | None = None
) -> tuple[tuple[int, ...], bool]:
    """The chunk grid of one tensor and whether it nests in ``boxes`` (its distinct saved regions).

    Nested: per dimension the gcd of the interior region boundaries (the full extent where there is none),
    split to at most ``min(max_chunk_bytes, cap)`` bytes. A dimension without interior boundaries may be
    split into any number of chunks (only the last one is partial); one with boundaries only by divisors of
    the gcd, so every boundary stays on the grid. Flat ranges (a nested grid of more than ``NEST_FACTOR``
    chunks per region) get a grid of whole rows instead, which does not nest (the planner replaces it by flat
    runs where every region is a contiguous run of the flattened tensor: :func:`choose_runs`).
    """
    if not shape:
        return (), True
    limit = max(itemsize, min(options.max_chunk_bytes, cap or options.max_chunk_bytes))
    edges = _interior_gcd(shape, boxes)
    grid = [g or max(extent, 1) for g, extent in zip(edges, shape)]
    count = math.prod(-(-max(e, 1) // c) for e, c in zip(shape, grid))
    if count <= NEST_FACTOR * max(1, len(boxes)):
        return split_nested(tuple(grid), itemsize, limit, [g == 0 for g in edges]), True
    rows = _row_chunk_rows(shape, itemsize, boxes, options)
    free = [True] * len(shape)
    return split_nested((rows, *(max(e, 1) for e in shape[1:])), itemsize, limit, free), False


def _row_chunk_rows(shape: tuple[int, ...], itemsize: int, boxes: Sequence[Box], options: _Sizes) -> int:
    """Rows per chunk of a tensor whose regions straddle every nested grid but are not flat runs (the flat
    ranges themselves get :func:`choose_runs`): at most ``1 / ROW_SPREAD`` of the rows between two
    region boundaries (so at most that share of a region travels at each boundary), but chunks of at least
    ``min_chunk_bytes / ROW_FLOOR_DIV`` (so the chunk count stays bounded where ranks hold a few rows each)."""
    extent = max(shape[0], 1)
    cuts = {e for b in boxes for e in (b.offsets[0], b.offsets[0] + b.lengths[0]) if 0 < e < extent}
    band = extent // (len(cuts) + 1)
    row_bytes = max(1, math.prod(max(e, 1) for e in shape[1:]) * itemsize)
    floor = -(-(options.min_chunk_bytes // ROW_FLOOR_DIV) // row_bytes)
    return max(1, min(extent, max(band // ROW_SPREAD, floor)))


def _interior_gcd(shape: tuple[int, ...], boxes: Sequence[Box]) -> list[int]:
    """Per dimension, the gcd of every interior region boundary (0 where there is none)."""
    out = []
    for d, extent in enumerate(shape):
        g = 0
        for b in boxes:
            for edge in (b.offsets[d], b.offsets[d] + b.lengths[d]):
                if 0 < edge < extent:
                    g = math.gcd(g, edge)
        out.append(g)
    return out


def nests(shape: tuple[int, ...], chunk: tuple[int, ...], boxes: Sequence[Box]) -> bool:
    """Whether every interior boundary of ``boxes`` lies on the grid of ``chunk`` (no chunk straddles two)."""
    return all(g % c == 0 for g, c in zip(_interior_gcd(shape, boxes), chunk))


def split_nested(chunk: tuple[int, ...], itemsize: int, limit: int, free: Sequence[bool]) -> tuple[int, ...]:
    """Shrink ``chunk`` (outermost dimension first) until it holds at most ``limit`` bytes.

    A ``free`` dimension is cut into any number of parts (``ceil`` rows each); any other only by a divisor
    of its extent, so every old grid line stays on the new grid: the smallest divisor that is enough, or,
    where that is more than twice what is needed and an inner dimension remains, the largest divisor below
    it (the inner dimension is cut for the rest). The last dimension always takes enough: the result holds
    at most ``limit`` bytes whenever one element does.
    """
    out = [max(c, 1) for c in chunk]
    for d in range(len(out)):
        size = math.prod(out) * itemsize
        if size <= limit:
            break
        need = -(-size // limit)
        last = d == len(out) - 1
        if free[d]:
            unit = size // out[d]
            if unit > limit:  # one slice of this dimension is too big: the inner dimensions are cut
                out[d] = 1
                continue
            parts = min(need, out[d])
            while parts < out[d] and -(-out[d] // parts) * unit > limit:
                parts += 1
            out[d] = -(-out[d] // parts)
            continue
        k = next((k for k in range(need, out[d] + 1) if out[d] % k == 0), out[d])
        if k > 2 * need and not last:
            k = max(k for k in range(1, min(need, out[d]) + 1) if out[d] % k == 0)
        out[d] //= k
    return tuple(out)


def split_chunk(chunk: tuple[int, ...], itemsize: int, limit: int) -> tuple[int, ...]:
    """Shrink ``chunk`` by integer divisors (outermost dim first) until it holds at most ``limit`` bytes.

    Dividing keeps every old grid line on the new grid, and the result always divides ``chunk`` (inner read
    chunks inside a stored chunk).
    """
    out = list(chunk)
    for d in range(len(out)):
        size = math.prod(out) * itemsize
        if size <= limit:
            break
        need = math.ceil(size / limit)
        out[d] = out[d] // next((k for k in range(need, out[d] + 1) if out[d] % k == 0), out[d])
    return tuple(max(c, 1) for c in out)


class RunOption(NamedTuple):
    """One flat-run grid of a class of tensors: its chunk shape, chunks and elements moved per tensor."""

    chunk: tuple[int, ...]
    chunks: int
    moved: int  # bytes moved per tensor (an upper bound: flatgrid.moved_elements x itemsize)


def run_options(
    shape: tuple[int, ...], itemsize: int, cuts: np.ndarray, limit: int, options: _Sizes
) -> tuple[list[RunOption], int]:
    """The flat-run grids a class of tensors may take (largest runs first) and the index to start from:
    runs of at most ``1 / ROW_SPREAD`` of the elements between two holder changes ``cuts``, not below
    ``min_chunk_bytes / RUN_START_DIV`` bytes; none below ``min_chunk_bytes / ROW_FLOOR_DIV`` bytes."""
    from .flatgrid import moved_elements, run_shapes

    n = math.prod(shape)
    shapes = run_shapes(shape, itemsize, limit, options.min_chunk_bytes // ROW_FLOOR_DIV)
    out = []
    for chunk in shapes:
        run = math.prod(chunk)
        out.append(RunOption(chunk, -(-n // run), moved_elements(cuts, n, run) * itemsize))
    band = n // (len(cuts) + 1) // ROW_SPREAD
    start_floor = options.min_chunk_bytes // RUN_START_DIV
    fine = next((j for j, o in enumerate(out) if math.prod(o.chunk) <= band), len(out) - 1)
    big = max((j for j, o in enumerate(out) if math.prod(o.chunk) * itemsize >= start_floor), default=0)
    return out, min(fine, big)


def choose_runs(classes: Sequence[tuple[list[RunOption], int, int]], budget: int) -> list[int]:
    """For each class ``(options, start index, tensors of the class)``, the option chosen: from the start,
    refined (a later option, fewer bytes moved) while the bytes moved by every class together exceed
    ``budget``, the refinement that spares the most bytes moved per added chunk first."""
    pick = [start for _o, start, _k in classes]
    moved = sum(o[j].moved * k for (o, _s, k), j in zip(classes, pick))

    def step(c: int) -> tuple[float, int, int] | None:
        opts, cur = classes[c][0], classes[c][0][pick[c]]
        best = None
        for j in range(pick[c] + 1, len(opts)):
            spared, added = cur.moved - opts[j].moved, max(1, opts[j].chunks - cur.chunks)
            if spared > 0 and (best is None or spared / added > -best[0]):
                best = (-spared / added, c, j)
        return best

    heap = [s for c in range(len(classes)) if (s := step(c)) is not None]
    heapq.heapify(heap)
    while moved > budget and heap:
        _r, c, j = heapq.heappop(heap)
        moved -= (classes[c][0][pick[c]].moved - classes[c][0][j].moved) * classes[c][2]
        pick[c] = j
        if (s := step(c)) is not None:
            heapq.heappush(heap, s)
    return pick
