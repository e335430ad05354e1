"""Mesh rules for layouts declared as boxes on a regular process grid (megatron-core TP/PP/DP/EP).

megatron-core gives each rank its part of a tensor as boxes (``ShardedTensor`` global offsets), never as a
rule: with pipeline, tensor and expert parallelism every (TP, PP, EP) position declares different boxes, and
at 10,000 ranks a mixture-of-experts model has thousands of distinct declarations. Yet the ranks sit on a
regular grid (megatron's ``RankGenerator``: ``rank = base + sum(coord[i] * stride[i])``) and each box is a
cell of a regular split of the tensor whose index is one grid coordinate. :func:`grid_rule` recognises that
and states the boxes as a ``["mesh", m, placements]`` rule (:mod:`arraycheckpoint.planning.rules`), the same
on every rank of the grid, so the declarations of all ranks agree (one group: each rank plans alone) and the
metadata stores a few affine meshes instead of one box per rank.

A rank holding several cells of one axis (the layers of its pipeline stage, the local experts of its
expert-parallel rank, the two halves of a gated MLP's ``linear_fc1``) occupies several positions of a
*repeat* mesh dimension (stride 0): the rank holds the box of every position it occupies. The rule is only
a claim about this rank's own boxes (the engine checks it and falls back to boxes when it does not match);
a rank reaching a different rule (coordinates that coincide) declares differently but still correctly.
This module is pure: no framework import, no I/O.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .regions import Box
from .rules import MAX_MESH_RANKS, Mesh, chunk_part

# which grid dimension explains a split when several have its size and coordinate: model-parallel ones
# first (their coordinate is what a split follows), data-parallel ones (replicas) last
PREFERENCE = ("tp", "etp", "cp", "pp", "ep", "dp", "edp")
PREFER_LEADING = ("pp", "ep", "tp", "etp", "cp", "dp", "edp")  # prepended (stacked layer, expert) axes
DATA_PARALLEL = ("dp", "edp")
# positions of all distinct meshes one rank's rules use (repeats included): a reader accepts MAX_MESH_RANKS
# over every layout group of a checkpoint, so one declaration keeps to a quarter; past it, boxes
MESH_POSITIONS_BUDGET = MAX_MESH_RANKS // 4


@dataclass(frozen=True)
class Grid:
    """A regular process grid: ``rank = base + sum(coord[i] * strides[i])`` over named dimensions.

    Built identically on every rank (it names no rank-specific value); ``coords`` (compared by nothing) is
    this rank's position. Dimensions of size 1 are dropped.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]
    strides: tuple[int, ...]
    base: int
    coords: tuple[int, ...] = field(default=(), compare=False)

    @staticmethod
    def from_groups(rank: int, world: int, groups: Mapping[str, Sequence[int]]) -> Grid | None:
        """The grid of ``rank``'s process groups (each listed in coordinate order, as megatron lists them),
        or None when they are not arithmetic progressions that tile ``range(world)`` exactly once."""
        names, sizes, strides, coords = [], [], [], []
        base = rank
        for name, members in groups.items():
            g = [int(r) for r in members]
            if len(g) <= 1:
                continue
            if rank not in g:
                return None
            step = g[1] - g[0]
            if step <= 0 or g != list(range(g[0], g[0] + step * len(g), step)):
                return None
            idx = g.index(rank)
            names.append(name)
            sizes.append(len(g))
            strides.append(step)
            coords.append(idx)
            base -= idx * step
        order = sorted(range(len(names)), key=lambda i: -strides[i])  # outermost first
        grid = Grid(
            tuple(names[i] for i in order),
            tuple(sizes[i] for i in order),
            tuple(strides[i] for i in order),
            base,
            tuple(coords[i] for i in order),
        )
        if math.prod(grid.sizes) != world or world > MAX_MESH_RANKS:
            return None
        ranks = grid_ranks(grid.sizes, grid.strides, grid.base)
        if len(ranks) != world or not np.array_equal(np.sort(ranks), np.arange(world)):
            return None
        return grid


def grid_ranks(sizes: Sequence[int], strides: Sequence[int], base: int) -> np.ndarray:
    """Every position's rank of an affine grid (row-major), as int64."""
    total = np.full(tuple(sizes), base, dtype=np.int64)
    for i, (n, s) in enumerate(zip(sizes, strides)):
        total += (np.arange(n, dtype=np.int64) * s).reshape([-1 if j == i else 1 for j in range(len(sizes))])
    return total.reshape(-1)


# one split step of a tensor axis: ("grid", parts, coordinate) or ("repeat", parts)
Step = tuple[Any, ...]


def axis_steps(extent: int, cells: Sequence[tuple[int, int]]) -> list[Step] | None:
    """The nested splits of one tensor axis that give exactly ``cells`` (sorted ``(offset, length)``) to one
    rank, in mesh order; None when the cells are no such pattern.

    Cells of equal length, in ``runs`` runs of ``run`` consecutive cells each, the runs ``spacing`` cells
    apart: ``[grid, repeat runs, grid, repeat run]`` (each step only where it splits anything). A grid step
    (``("grid", parts, coordinate)``) picks this rank's part, a repeat (``("repeat", parts)``) gives it every
    part. This covers one block (a TP slice), a stage's consecutive layers or a rank's local experts (grid,
    repeat), the two halves of a gated fc1 (repeat, grid) and the layer chunks of interleaved (virtual)
    pipeline stages (repeat over the virtual stages, grid over the stages, repeat over a chunk's layers).
    """
    if list(cells) == [(0, extent)]:
        return []
    length = cells[0][1]
    if length <= 0 or extent % length or any(n != length for _o, n in cells):
        return None
    index = [o // length for o, _n in cells]
    if any(o % length for o, _n in cells):
        return None
    total = extent // length  # cells of this length along the axis
    run = 1
    while run < len(index) and index[run] == index[0] + run:
        run += 1
    runs = len(index) // run
    spacing = index[run] - index[0] if runs > 1 else run
    if (
        runs * run != len(index)
        or spacing < run
        or spacing % run
        or any(index[v * run + j] != index[0] + v * spacing + j for v in range(runs) for j in range(run))
    ):
        return None
    period = runs * spacing  # the cells repeat within one period of the axis; the outer grid picks the period
    if total % period:
        return None
    inner = index[0] % period  # the first run's place in its period: a whole part of the spacing
    if inner >= spacing or inner % run:
        return None
    out: list[Step] = []
    if total > period:
        out.append(("grid", total // period, index[0] // period))
    if runs > 1:
        out.append(("repeat", runs))
    if spacing > run:
        out.append(("grid", spacing // run, inner // run))
    if run > 1:
        out.append(("repeat", run))
    return out


def box_axes(shape: Sequence[int], boxes: Sequence[Box]) -> list[list[tuple[int, int]]] | None:
    """Per axis, the sorted cells of ``boxes`` when the boxes are exactly their product; else None."""
    if not boxes:
        return None
    axes = [sorted({(b.offsets[d], b.lengths[d]) for b in boxes}) for d in range(len(shape))]
    if math.prod(len(a) for a in axes) != len(set(boxes)):
        return None
    return axes  # every box is in the product and the counts agree: the boxes are the product


class GridRules:
    """Finds mesh rules on a rank's grids; meshes are shared between tensors (one object per distinct mesh,
    so the engine's checks of a rule expand each mesh once)."""

    def __init__(self, grids: Sequence[Grid]) -> None:
        self.grids = tuple(grids)
        self._meshes: dict[tuple[Any, ...], Mesh] = {}  # kept across declarations (made and expanded once)
        self._used: set[tuple[Any, ...]] = set()  # meshes of the current declaration
        self._positions = 0  # their rank positions (MESH_POSITIONS_BUDGET, per declaration)

    def begin(self) -> None:
        """Start a declaration (one save's tensors): the positions budget counts its meshes only."""
        self._used.clear()
        self._positions = 0

    def rule(
        self, shape: Sequence[int], boxes: Sequence[Box], leading: int = 0
    ) -> tuple[str, Mesh, tuple[int, ...]] | None:
        """``("mesh", mesh, placements)`` stating ``boxes`` on one of the grids, or None. Where several grid
        dimensions fit a split (equal sizes and coordinates on this rank), model-parallel ones win, and the
        first ``leading`` axes (megatron's prepended ones) prefer pipeline and expert parallelism."""
        shape = tuple(int(s) for s in shape)
        axes = box_axes(shape, boxes)
        if axes is None:
            return None
        steps = [axis_steps(n, cells) for n, cells in zip(shape, axes)]
        if any(s is None for s in steps) or not any(steps):
            return None  # no pattern, or the whole tensor (a replica: the engine says so itself)
        best = None
        for grid in self.grids:
            found = _assign(grid, [s for s in steps if s is not None], leading)
            if found is not None and (best is None or found[0] < best[0]):
                best = (found[0], grid, found[1])
        if best is None:
            return None
        _score, grid, dims = best
        return self._mesh_rule(grid, [s for s in steps if s is not None], dims)

    def _mesh_rule(
        self, grid: Grid, steps: list[list[Step]], dims: list[list[tuple[int, ...]]]
    ) -> tuple[str, Mesh, tuple[int, ...]] | None:
        sizes, strides, placements = [], [], []
        used = set()
        for axis, (axis_steps_, axis_dims) in enumerate(zip(steps, dims)):
            for step, g in zip(axis_steps_, axis_dims):
                if step[0] == "repeat":
                    sizes.append(step[1])
                    strides.append(0)
                    placements.append(axis)
                    continue
                for (
                    d
                ) in g:  # one grid dimension, or a chain splitting the axis over their product (outer first)
                    sizes.append(grid.sizes[d])
                    strides.append(grid.strides[d])
                    placements.append(axis)
                    used.add(d)
        for g in range(len(grid.sizes)):  # the rest: replicated over these dimensions
            if g not in used:
                sizes.append(grid.sizes[g])
                strides.append(grid.strides[g])
                placements.append(-1)
        key = (tuple(sizes), tuple(strides), grid.base)
        if key not in self._used:
            if self._positions + math.prod(sizes) > MESH_POSITIONS_BUDGET:
                return None
            self._positions += math.prod(sizes)
            self._used.add(key)
        mesh = self._meshes.get(key)
        if mesh is None:
            ranks = grid_ranks(sizes, strides, grid.base)
            mesh = self._meshes[key] = Mesh(tuple(sizes), tuple(ranks.tolist()))
        return ("mesh", mesh, tuple(placements))


def _assign(
    grid: Grid, steps: list[list[Step]], leading: int
) -> tuple[tuple[int, int], list[list[tuple[int, ...]]]] | None:
    """Grid dimensions for every grid step, each dimension used once: one dimension (its size and this rank's
    coordinate equal the step's), or a chain of two or more that flattens into one dimension (each one's
    stride is the next one's times its size: a combined process group such as megatron's TP x DP or
    TP x CP x DP group, or the expert grid's ETP x EP x EDP, in its rank order), for an axis split over their
    product (sizes multiply to the step's parts, their coordinates in mixed radix, outer first, are its
    coordinate). The assignment using the fewest data-parallel dimensions, then single dimensions, then the
    most preferred ones (the first ``leading`` axes, megatron's prepended layer and expert axes, prefer
    :data:`PREFER_LEADING`, the others :data:`PREFERENCE`); returns (score, dims per step) or None."""
    wanted = [(a, i, s) for a, ss in enumerate(steps) for i, s in enumerate(ss) if s[0] == "grid"]
    best: list[Any] = [None, None]
    out: list[list[tuple[int, ...]]] = [[()] * len(ss) for ss in steps]
    n = len(grid.names)

    def cost(axis: int, dims: tuple[int, ...]) -> tuple[int, int]:
        order = PREFER_LEADING if axis < leading else PREFERENCE
        pref = sum(order.index(grid.names[g]) if grid.names[g] in order else len(order) for g in dims)
        return sum(grid.names[g] in DATA_PARALLEL for g in dims), pref + (len(dims) - 1) * 4 * len(order)

    def fits(parts: int, coord: int) -> list[tuple[int, ...]]:
        out = []
        for k in range(1, n + 1):  # one dimension, or a chain of them flattening into one, outer first
            for dims in itertools.permutations(range(n), k):
                if any(grid.strides[g] != grid.strides[h] * grid.sizes[h] for g, h in zip(dims, dims[1:])):
                    continue
                if math.prod(grid.sizes[g] for g in dims) != parts:
                    continue
                at = 0
                for g in dims:  # this rank's coordinate on the flattened dimension
                    at = at * grid.sizes[g] + grid.coords[g]
                if at == coord:
                    out.append(dims)
        return out

    def search(k: int, taken: frozenset[int], replicas: int, pref: int) -> None:
        if k == len(wanted):
            if best[0] is None or (replicas, pref) < best[0]:
                best[0], best[1] = (replicas, pref), [list(x) for x in out]
            return
        a, i, (_kind, parts, coord) = wanted[k]
        for dims in fits(parts, coord):
            if not taken.intersection(dims):
                out[a][i] = dims
                more, extra = cost(a, dims)
                search(k + 1, taken | set(dims), replicas + more, pref + extra)

    search(0, frozenset(), 0, 0)
    return None if best[0] is None else (best[0], best[1])


_WORLD_MESHES: dict[int, Mesh] = {}  # per world size: one mesh object (its rank positions expanded once)


def world_mesh(world: int) -> Mesh:
    """The 1-D grid of the whole world (``arange``), one object per world size."""
    mesh = _WORLD_MESHES.get(world)
    if mesh is None:
        while len(_WORLD_MESHES) >= 4:
            _WORLD_MESHES.pop(next(iter(_WORLD_MESHES)))
        mesh = _WORLD_MESHES[world] = Mesh((world,), tuple(range(world)))
    return mesh


def world_split(shape: Sequence[int], boxes: Sequence[Box], rank: int, world: int) -> int | None:
    """The axis along which ``boxes`` is ``rank``'s ``torch.chunk`` part of a ``world``-way split (the whole
    tensor along every other axis), or None: a sharded dict built by hand with no process grid, one block per
    rank, then declares ``["mesh", world, [axis]]`` like every other rank instead of its own box. A rank
    holding nothing of a non-empty tensor takes the first axis whose part is empty here (the trailing ranks of
    a split into fewer parts than ranks); a wrong guess only makes its declaration differ, never wrong."""
    if len(boxes) > 1 or world < 2 or world > MAX_MESH_RANKS or not 0 <= rank < world:
        return None
    if (
        not boxes
    ):  # nothing here: the first axis whose part here is empty (a split into fewer parts than ranks)
        if not math.prod(shape):
            return None
        return next((d for d, n in enumerate(shape) if not chunk_part(int(n), world, rank)[1]), None)
    box = boxes[0]
    split = [d for d in range(len(shape)) if (box.offsets[d], box.lengths[d]) != (0, shape[d])]
    if len(split) != 1:
        return None
    d = split[0]
    return d if (box.offsets[d], box.lengths[d]) == chunk_part(int(shape[d]), world, rank) else None
