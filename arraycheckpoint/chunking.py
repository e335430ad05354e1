"""Chunk grids: how big each stored file of a tensor is (pure arithmetic, no I/O).

Two ways, both deterministic and shared by the reference and the compact planner:

* :func:`choose_chunk_shape`: per tensor, a grid aligned with the saved regions, coarsened up to
  ``min_chunk_bytes`` and split down to ``max_chunk_bytes``. Used when the save is small for its world
  (a rank's share of the bytes is below the target file size: some ranks write nothing either way);
* :func:`apportion` + :func:`counted_chunk_shape`: when every rank's share holds at least one target-sized
  file, the number of files is chosen for the whole save at once, per *holder group* (the ranks linked by
  holding parts of the same tensors: the world for FSDP or DDP, one pipeline stage for Megatron).
  ``k = min(share // min_chunk_bytes, 2)`` files per rank of the group (more where files would exceed
  ``max_chunk_bytes``), ``k * ranks`` files apportioned among the group's tensors by the divisor (Jefferson /
  D'Hondt) method, which minimises the largest file for that count (:func:`chunk_counts`). Every file of a
  group is then within a few percent of the same size and there are at most ``k`` per rank, so a worst-fit
  gives every rank ``k`` files of its own group and max/mean bytes written per rank stays near 1 (with
  16-64 MiB files and fewer than ~64 files per rank this is not possible with per-tensor grids: ``k + 1``
  files on some ranks and ``k`` on others is a 1.2-1.5 imbalance). :func:`tensor_chunk_shape` keeps a
  tensor's aligned grid (its shards written where they are) where it has about as many files of about the
  apportioned size; otherwise the apportioned grid, whose file boundaries may fall inside saved regions: the
  sides then travel to one writer (the owner choice keeps that on one host where the regions allow:
  :mod:`arraycheckpoint.owners`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Protocol

import numpy as np

from .regions import Box

FILES_PER_RANK = 2  # apportioned files per rank when the target size allows more: pairs balance well
MIXED_FILES = 8  # aligned files of at most a rank's share / this are kept whatever the apportioned size


class _Sizes(Protocol):
    min_chunk_bytes: int
    max_chunk_bytes: int
    write_balance: float


def tensor_chunk_shape(
    shape: tuple[int, ...],
    itemsize: int,
    boxes: Sequence[Box],
    options: _Sizes,
    files: int | None = None,
    share: int = 0,
) -> tuple[int, ...]:
    """The chunk grid of one tensor: ``files`` apportioned chunks (:func:`counted_chunk_shape`) or the aligned
    grid (:func:`choose_chunk_shape`). ``share``: bytes per rank of the tensor's holder group.

    The apportioned grid is used when it gives about ``files`` chunks (within ``write_balance``) and either
    nests in the saved regions (no chunk straddles two) or the aligned grid's chunks straddle regions anyway,
    or the aligned grid has more files than that or larger ones (beyond ``write_balance``): a few files
    larger than the rest would leave their writers above the balance bound, with two files per rank. Aligned
    files of at most ``share / MIXED_FILES`` are kept whatever their size: with that many files per rank,
    worst fit evens out files of different sizes (and they need no exchange).
    """
    aligned = choose_chunk_shape(shape, itemsize, boxes, options)
    if files is None or not shape:
        return aligned
    count = lambda chunk: math.prod(-(-e // c) for e, c in zip(shape, chunk))  # noqa: E731
    counted = counted_chunk_shape(shape, boxes, files)
    bound = options.write_balance
    if count(counted) * bound < files and count(aligned) <= files:
        return aligned  # the shape cannot be cut into about that many chunks; the aligned grid has no more
    edges = _interior_gcd(shape, boxes)  # a chunk grid nests in the regions when every edge lies on it
    nests = lambda chunk: all(g % c == 0 for g, c in zip(edges, chunk))  # noqa: E731
    if nests(counted) or not nests(aligned):
        return counted
    similar = count(aligned) <= bound * files and math.prod(aligned) <= bound * math.prod(counted)
    small = math.prod(aligned) * itemsize * MIXED_FILES <= share
    return aligned if similar or small else counted


def choose_chunk_shape(
    shape: tuple[int, ...], itemsize: int, boxes: Sequence[Box], options: _Sizes
) -> tuple[int, ...]:
    """A regular chunk grid aligned with the boundaries of ``boxes`` where that keeps files reasonably sized.

    The finest aligned grid is the gcd of all interior region boundaries per dimension. It is coarsened
    (innermost dims first, up to the full extent) while a chunk is below ``min_chunk_bytes``, then split by
    divisors (outermost dims first, so alignment is kept) while above ``max_chunk_bytes``.
    """
    if not shape:
        return ()
    grid = aligned_grid(shape, boxes)
    nbytes = lambda c: math.prod(c) * itemsize  # noqa: E731
    for d in reversed(range(len(grid))):
        if nbytes(grid) >= options.min_chunk_bytes:
            break
        factor = math.ceil(options.min_chunk_bytes / nbytes(grid))
        grid[d] = min(max(shape[d], 1), grid[d] * factor)
    return split_chunk(tuple(grid), itemsize, options.max_chunk_bytes)


def aligned_grid(shape: tuple[int, ...], boxes: Sequence[Box]) -> list[int]:
    """Per dimension, the gcd of every interior region boundary (the full extent where there is none)."""
    return [g or max(extent, 1) for g, extent in zip(_interior_gcd(shape, boxes), shape)]


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


def chunk_counts(sizes: Iterable[int], world: int, options: _Sizes) -> dict[int, int] | None:
    """Files per tensor size for ``world`` ranks sharing the tensors of ``sizes`` (``{tensor bytes: files}``),
    or None when they are too few bytes for that many ranks (a rank's share below ``min_chunk_bytes``).

    ``sizes`` lists every tensor's bytes (one entry per tensor). The count depends on a tensor's bytes only,
    so tensors of equal size get equal grids (the compact planner analyses them once).
    """
    weights: dict[int, int] = {}
    for s in sizes:
        if s > 0:
            weights[s] = weights.get(s, 0) + 1
    total = sum(s * n for s, n in weights.items())
    if world < 1 or not weights or total // world < options.min_chunk_bytes:
        return None
    share = total // world
    # files per rank: few (each near the target size or larger), enough to keep files under the maximum
    per_rank = max(
        min(share // options.min_chunk_bytes, FILES_PER_RANK), -(-share // options.max_chunk_bytes), 1
    )
    seats = per_rank * world

    def files(s: int, d: int) -> int:
        return max(1, s // d, -(-s // options.max_chunk_bytes))  # none above the maximum

    def count(d: int) -> int:
        return sum(files(s, d) * n for s, n in weights.items())

    lo, hi = 1, max(weights) + 1  # count(hi): the fewest files (one per tensor, or as the maximum needs)
    if count(hi) > seats:
        return {s: files(s, hi) for s in weights}
    while lo < hi:  # the smallest divisor whose apportionment fits the seats (the largest files are smallest)
        mid = (lo + hi) // 2
        if count(mid) <= seats:
            hi = mid
        else:
            lo = mid + 1
    return {s: files(s, lo) for s in weights}


def apportion(
    tensors: Mapping[str, tuple[int, np.ndarray]], world: int, options: _Sizes
) -> dict[str, tuple[int, int]] | None:
    """Files per tensor and the bytes per rank of its holder group (``{name: (files, share)}``; a tensor left
    out keeps its aligned grid), or None when the save is too small for its world (a rank's share below
    ``min_chunk_bytes``: aligned grids everywhere).

    ``tensors[name]`` is (bytes, sorted ranks holding part of it). Tensors are apportioned per *holder
    group*: the ranks linked by holding parts of the same tensors (a Megatron pipeline stage; the whole world
    for FSDP or DDP), each group's files among its own ranks (:func:`chunk_counts`). Every file of a group is
    then about its bytes per rank / files per rank, and the group's ranks write their own data with two
    files each, where one world-wide count would give groups holding a few percent more than the mean a
    third file on some ranks (or send it to another group). Tensors below ``min_chunk_bytes`` are one file and
    link no groups (a small tensor held everywhere would otherwise merge them all). Where some rank holds no
    large tensor (FSDP with fewer rows than ranks) it writes too: one group then, of the whole world.
    """
    total = sum(n for n, _h in tensors.values())
    if world < 1 or total // world < options.min_chunk_bytes:
        return None
    counts = {name: (1, 0) for name, (n, _h) in tensors.items() if 0 < n < options.min_chunk_bytes}
    big = sorted(name for name, (n, h) in tensors.items() if n >= options.min_chunk_bytes and len(h))
    group = np.full(world, -1, dtype=np.int64)  # rank -> holder group (union-find over tensors)
    parent: list[int] = []

    def root(g: int) -> int:
        while parent[g] != g:
            parent[g] = parent[parent[g]]
            g = parent[g]
        return g

    of: dict[str, int] = {}
    seen: dict[bytes, int] = {}  # tensors held by the same ranks link them once
    for name in big:
        ranks = tensors[name][1]
        g = seen.setdefault(ranks.tobytes(), len(parent))
        if g == len(parent):
            parent.append(g)
            for other in np.unique(group[ranks]).tolist():
                if other >= 0:
                    parent[root(other)] = g
            group[ranks] = g
        of[name] = g
    members: dict[int, list[str]] = {}
    for name in big:
        members.setdefault(root(of[name]), []).append(name)
    roots = np.asarray([root(g) for g in range(len(parent))], dtype=np.int64)
    ranks_in = np.bincount(roots[group[group >= 0]], minlength=len(parent))
    if (group < 0).any():  # ranks holding nothing large write too: one group, the world
        members, ranks_in = {0: big}, np.asarray([world])
    for g, names in members.items():
        sizes = [tensors[n][0] for n in names]
        by_size = chunk_counts(sizes, int(ranks_in[g]), options)
        if by_size is not None:
            share = sum(sizes) // int(ranks_in[g])
            counts.update({n: (by_size[tensors[n][0]], share) for n in names})
    return counts


def counted_chunk_shape(shape: tuple[int, ...], boxes: Sequence[Box], files: int) -> tuple[int, ...]:
    """A grid of at most ``files`` near-equal chunks, split along the outermost dimensions.

    Row counts that keep the number of chunks and fall on the regions' aligned grid are preferred (then no
    file straddles a region boundary that its grid would not).
    """
    if not shape:
        return ()
    out = list(shape)
    aligned = aligned_grid(shape, boxes)
    remaining = max(1, files)
    for d, extent in enumerate(shape):
        if remaining <= 1 or extent <= 0:
            break
        if remaining <= extent:  # this dimension alone gives the count (or the most it can below it)
            out[d] = _snap(-(-extent // remaining), extent, aligned[d])
            break
        out[d] = 1
        remaining = -(-remaining // extent)
    return tuple(max(c, 1) for c in out)


def _snap(rows: int, extent: int, grid: int) -> int:
    """``rows``, or the aligned row count nearest to it that gives the same number of chunks."""
    parts = -(-extent // rows)
    if grid % rows == 0 or rows % grid == 0:
        return rows
    options = [grid * m for m in (rows // grid, rows // grid + 1) if m > 0]
    options += [grid // k for k in range(max(1, grid // rows - 1), grid // rows + 3) if k and grid % k == 0]
    fits = [c for c in options if c > 0 and -(-extent // c) == parts]
    return min(fits, key=lambda c: (abs(c - rows), c)) if fits else rows
