"""Layout rules: what one rank holds of a tensor, said once for every rank that holds it the same way.

A rank declares each tensor it saves with one rule instead of a list of boxes wherever a rule exists:

* ``["replica"]``: the whole tensor (DDP, replicated DTensor placements, small state);
* ``["mesh", m, placements]``: a DTensor-style layout over mesh ``m`` of the declaration's mesh table:
  ``placements[i]`` is the tensor dimension split over mesh dimension ``i`` (``-1`` = replicated). Splits
  follow ``torch.chunk`` (what DTensor's ``Shard`` does): ``ceil(n / parts)`` per part, trailing parts
  short or empty. Which box a rank holds follows from its coordinate in the mesh, so the rule is the same
  on every rank of the mesh;
* ``["range", m, offset, total]``: a slice of a flat space (FSDP1's ``FlatParameter``): the tensor's row-major
  elements are elements ``[offset, offset + numel)`` of a flat space of ``total`` elements that is split over
  the ranks of mesh ``m`` (in row-major mesh order) by ``torch.chunk``, which is how FSDP1 shards a flat
  parameter (its padding is part of ``total``). The rank at mesh position ``i`` holds the part of the tensor
  inside chunk ``i``, as up to ``2 * ndim - 1`` boxes (:func:`arraycheckpoint.planning.regions.flat_range_to_boxes`);
* ``["boxes", [[offsets, lengths], ...]]``: explicit regions (irregular shards, megatron fragments).

A mesh may name one rank at several coordinates (a JAX mesh of devices, mapped to the process owning each
device): that rank holds the box of every coordinate it occupies.

A rule that names no rank-specific value makes every rank's declaration identical: identical declarations
travel once (their digest stands for them), and when every rank's declaration is identical each rank can
plan the whole save by itself. This module is pure: no I/O, no communication.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np

from ..errors import PlanError
from .regions import Box, flat_range_to_boxes

REPLICA = ("replica",)
MAX_MESH_RANKS = 1 << 22  # far above any job (the ByteCheckpoint paper's largest is 8,960 ranks)
MAX_FLAT_ELEMENTS = 1 << 62  # a range rule's flat space (int64 arithmetic stays exact below it)


@dataclass(frozen=True)
class Mesh:
    """A device mesh: its shape and the rank at every coordinate (row-major).

    JSON (:meth:`to_json`) says the ranks compactly where it can: ``["arange", start]`` for consecutive ranks,
    ``["affine", start, [[div, stride], ...]]`` for ``rank = start + sum((coord[i] // div[i]) * stride[i])``
    (a mesh of devices mapped to their processes, a strided sub-mesh, a transposed mesh), else the list.
    """

    shape: tuple[int, ...]
    ranks: tuple[int, ...]

    def to_json(self) -> list[Any]:
        start = self.ranks[0] if self.ranks else 0
        if self.ranks == tuple(range(start, start + len(self.ranks))):
            return [list(self.shape), ["arange", start]]
        fit = _fit_affine(self.shape, self.ranks)
        if fit is not None:
            return [list(self.shape), ["affine", start, fit]]
        return [list(self.shape), ["list", list(self.ranks)]]

    @staticmethod
    def from_json(j: Any) -> Mesh:
        if not isinstance(j, list) or len(j) != 2 or not isinstance(j[1], list) or len(j[1]) not in (2, 3):
            raise PlanError(f"malformed mesh {j!r}")
        shape = tuple(int(s) for s in j[0])
        kind, value = j[1][0], j[1][1]
        n = math.prod(shape)
        if any(s < 1 for s in shape) or n > MAX_MESH_RANKS:  # untrusted: bound before building rank lists
            raise PlanError(f"mesh of shape {shape} is empty or larger than {MAX_MESH_RANKS} ranks")
        if kind == "arange" and len(j[1]) == 2:
            ranks = tuple(range(int(value), int(value) + n))
        elif kind == "list" and len(j[1]) == 2:
            ranks = tuple(int(r) for r in value)
        elif kind == "affine" and len(j[1]) == 3:
            ranks = _affine_ranks(shape, value, j[1][2])
        else:
            raise PlanError(f"malformed mesh ranks {j[1]!r}")
        if len(ranks) != n:
            raise PlanError(f"mesh of shape {shape} lists {len(ranks)} ranks")
        if ranks and (min(ranks) < 0 or max(ranks) >= MAX_MESH_RANKS):
            raise PlanError(f"mesh of shape {shape} names ranks outside [0, {MAX_MESH_RANKS})")
        return Mesh(shape, ranks)

    @staticmethod
    def json_size(j: Any) -> int:
        """How many ranks the mesh ``j`` (its JSON form, untrusted) expands to, ``MAX_MESH_RANKS + 1`` for any
        number above the limit; 0 when malformed (refused by :meth:`from_json`). Lets a reader bound the total
        of many meshes before building any. The product stops at the limit: 600,000 dimensions of 2 (1.8 MB of
        JSON) made a number of 180,000 digits in quadratic time (4 s), which no error message could print."""
        total = 1
        try:
            for s in j[0]:
                total *= max(int(s), 0)
                if total > MAX_MESH_RANKS:
                    return MAX_MESH_RANKS + 1
        except (TypeError, ValueError, IndexError, KeyError, OverflowError):  # Infinity: refused later
            return 0
        return total

    @cached_property
    def repeats(self) -> bool:
        """Whether a rank stands at several positions of the mesh (a process holding several devices)."""
        ranks = np.asarray(self.ranks, dtype=np.int64)
        if len(ranks) < 2 or (np.diff(ranks) > 0).all():  # increasing (the usual mesh): no repeats
            return False
        ranks.sort()
        return bool((ranks[1:] == ranks[:-1]).any())

    @cached_property
    def positions(self) -> dict[int, tuple[int, ...]]:
        """``rank -> flat mesh positions`` it occupies (several for a process holding several devices)."""
        out: dict[int, list[int]] = {}
        for i, r in enumerate(self.ranks):
            out.setdefault(r, []).append(i)
        return {r: tuple(p) for r, p in out.items()}


def _fit_affine(shape: tuple[int, ...], ranks: tuple[int, ...]) -> list[list[int]] | None:
    """``[[div, stride], ...]`` per mesh dimension when ``ranks`` follow the affine form, else None."""
    if not ranks or not shape or len(ranks) != math.prod(shape):
        return None
    arr = np.asarray(ranks, dtype=np.int64).reshape(shape)
    start = int(arr.flat[0])
    fit = []
    for i, size in enumerate(shape):
        line = arr[tuple(slice(None) if j == i else 0 for j in range(len(shape)))] - start
        nonzero = np.flatnonzero(line)
        div = int(nonzero[0]) if len(nonzero) else size
        fit.append([div, int(line[div]) if len(nonzero) else 0])
    try:
        rebuilt = _affine_ranks(shape, start, fit)
    except PlanError:
        return None
    return fit if rebuilt == ranks else None


def _affine_ranks(shape: tuple[int, ...], start: Any, fit: Any) -> tuple[int, ...]:
    """The ranks of the ``affine`` mesh form (bounded: ``shape`` was checked, every value is small)."""
    ok = (
        isinstance(start, int)
        and not isinstance(start, bool)
        and 0 <= start < MAX_MESH_RANKS
        and isinstance(fit, list)
        and len(fit) == len(shape)
        and all(
            isinstance(f, list)
            and len(f) == 2
            and all(isinstance(x, int) and not isinstance(x, bool) for x in f)
            and 1 <= f[0] <= s
            and abs(f[1]) < MAX_MESH_RANKS
            for f, s in zip(fit, shape)
        )
    )
    if not ok:
        raise PlanError(f"malformed affine mesh ranks {start!r}, {fit!r} for shape {shape}")
    total = np.full(shape, start, dtype=np.int64)
    for i, (div, stride) in enumerate(fit):
        axis = (np.arange(shape[i], dtype=np.int64) // div) * stride
        total += axis.reshape([-1 if j == i else 1 for j in range(len(shape))])
    if total.size and (int(total.min()) < 0 or int(total.max()) >= MAX_MESH_RANKS):
        raise PlanError(f"affine mesh ranks {start!r}, {fit!r} leave [0, {MAX_MESH_RANKS})")
    return tuple(total.ravel().tolist())


def chunk_bounds(extent: int, parts: int) -> list[tuple[int, int]]:
    """``torch.chunk`` / DTensor ``Shard`` split of ``extent`` into ``parts``: (offset, length) per part."""
    return [chunk_part(extent, parts, i) for i in range(parts)]


def chunk_part(extent: int, parts: int, index: int) -> tuple[int, int]:
    """Part ``index`` of :func:`chunk_bounds` (O(1)): ``ceil(extent / parts)`` each, trailing parts short."""
    size = -(-extent // parts) if parts else 0
    start = min(size * index, extent)
    return start, max(0, min(start + size, extent) - start)


def mesh_box(shape: Sequence[int], mesh: Mesh, placements: Sequence[int], coord: Sequence[int]) -> Box:
    """The box a rank at mesh coordinate ``coord`` holds (DTensor semantics, nested splits in mesh order)."""
    offsets = [0] * len(shape)
    lengths = list(shape)
    for i, dim in enumerate(placements):
        if dim < 0:
            continue
        start, length = chunk_part(lengths[dim], mesh.shape[i], coord[i])
        offsets[dim] += start
        lengths[dim] = length
    return Box(tuple(offsets), tuple(lengths))


def mesh_regions(
    shape: tuple[int, ...], mesh: Mesh, placements: Sequence[int], members: frozenset[int] | None = None
) -> dict[Box, list[int]]:
    """Every non-empty box of a mesh rule and the ranks holding it (only ranks in ``members`` if given).

    A rank at several coordinates holding the same box is listed once. Boxes in the order of their first
    mesh position, each one's ranks in mesh order. Vectorised over the mesh (a mesh rule of a few bytes in a
    checkpoint names up to :data:`MAX_MESH_RANKS` ranks): Python work per box, not per rank.
    """
    ranks = np.asarray(mesh.ranks, dtype=np.int64)
    flat = np.arange(len(ranks), dtype=np.int64)
    if members is not None:
        flat = flat[np.isin(ranks, np.fromiter(members, dtype=np.int64, count=len(members)))]
    if not len(flat) or not math.prod(shape):
        return {}
    coords = np.unravel_index(flat, mesh.shape) if mesh.shape else ()
    offsets = np.zeros((len(flat), len(shape)), dtype=np.int64)
    lengths = np.tile(np.asarray(shape, dtype=np.int64), (len(flat), 1))
    split = [(i, d) for i, d in enumerate(placements) if d >= 0]
    for i, dim in split:  # chunk_part, for every position at once (nested splits in mesh order)
        extent, parts = lengths[:, dim], mesh.shape[i]
        size = -(-extent // parts)
        whole = extent // np.maximum(size, 1)  # parts that start inside the extent: no int64 overflow
        start = np.where(coords[i] <= whole, np.minimum(coords[i], whole) * size, extent)
        start = np.minimum(start, extent)
        offsets[:, dim] += start
        lengths[:, dim] = np.maximum(0, np.minimum(start + size, extent) - start)
    keep = np.flatnonzero((lengths > 0).all(axis=1))
    if not len(keep):
        return {}
    held = ranks[flat[keep]]
    out: dict[Box, list[int]] = {}
    if not mesh.repeats and all(mesh.shape[i] == 1 for i, d in enumerate(placements) if d < 0):
        # no replicated mesh dimension and no rank at two positions: one holder per box, in mesh order
        for o, n, r in zip(offsets[keep].tolist(), lengths[keep].tolist(), held.tolist()):
            out[Box(tuple(o), tuple(n))] = [r]
        return out
    # positions with equal split coordinates hold the same box: group them (stable: mesh order kept)
    key = (
        np.ravel_multi_index([coords[i][keep] for i, _d in split], [mesh.shape[i] for i, _d in split])
        if split
        else np.zeros(len(keep), dtype=np.int64)
    )
    order = np.argsort(key, kind="stable")
    heads = np.flatnonzero(np.r_[True, key[order][1:] != key[order][:-1]])
    bounds = np.r_[heads, len(order)].tolist()
    who_all = held[order].tolist()
    firsts = keep[order[heads]]  # each box's first mesh position: only those boxes are listed
    offs, lens = offsets[firsts].tolist(), lengths[firsts].tolist()
    repeated = mesh.repeats
    for g in np.argsort(order[heads], kind="stable").tolist():  # boxes by first mesh position
        who = who_all[bounds[g] : bounds[g + 1]]
        holders = out.setdefault(Box(tuple(offs[g]), tuple(lens[g])), [])
        if repeated:  # a rank at several positions holding this box: listed once
            have = set(holders)
            who = [r for r in dict.fromkeys(who) if r not in have]
        holders.extend(who)
    return out


def range_part(shape: Sequence[int], offset: int, total: int, parts: int, index: int) -> list[Box]:
    """The boxes of a tensor at ``[offset, offset + numel)`` of a flat space of ``total`` elements that lie
    in ``torch.chunk`` part ``index`` of ``parts`` (FSDP1: what rank ``index`` of the group holds)."""
    start, length = chunk_part(total, parts, index)
    numel = math.prod(shape)
    lo, hi = max(start, offset), min(start + length, offset + numel)
    return flat_range_to_boxes(shape, lo - offset, hi - offset) if hi > lo else []


def range_regions(
    shape: tuple[int, ...], mesh: Mesh, offset: int, total: int, members: frozenset[int] | None = None
) -> dict[Box, list[int]]:
    """Every non-empty box of a range rule and the ranks holding it; only the parts the tensor's slice of
    the flat space touches are visited (O(parts touched), not O(mesh size))."""
    out: dict[Box, list[int]] = {}
    parts, numel = len(mesh.ranks), math.prod(shape)
    size = -(-total // parts) if parts else 0
    if not numel or not size:
        return out
    for index in range(offset // size, min((offset + numel - 1) // size, parts - 1) + 1):
        rank = mesh.ranks[index]
        if members is not None and rank not in members:
            continue
        for box in range_part(shape, offset, total, parts, index):
            holders = out.setdefault(box, [])
            if rank not in holders:
                holders.append(rank)
    return out


def rule_boxes(shape: tuple[int, ...], rule: Sequence[Any], meshes: Sequence[Mesh], rank: int) -> list[Box]:
    """The boxes ``rank`` holds under ``rule`` (for checking a declared rule against the local data)."""
    kind = rule[0]
    if kind == "replica":
        return [Box.full(shape)] if math.prod(shape) else []
    if kind == "boxes":
        return [b if isinstance(b, Box) else Box(tuple(b[0]), tuple(b[1])) for b in rule[1]]
    mesh = meshes[rule[1]]
    out: list[Box] = []
    for flat in mesh.positions.get(rank, ()):
        if kind == "range":
            boxes = range_part(shape, rule[2], rule[3], len(mesh.ranks), flat)
        else:
            coord = np.unravel_index(flat, mesh.shape) if mesh.shape else ()
            box = mesh_box(shape, mesh, rule[2], [int(c) for c in coord])
            boxes = [box] if box.volume else []
        out.extend(b for b in boxes if b not in out)
    return out


def rule_visits(shape: Sequence[int], rule: Sequence[Any], meshes: Sequence[Mesh], ranks: int) -> int:
    """What expanding ``rule`` (JSON or tuple form, checked) for a group of ``ranks`` ranks into its regions and
    holders costs, in ranks visited: every rank of the group, plus every rank of a mesh rule's mesh, the parts
    of the flat space a range rule touches, or one per box and rank of a boxes rule. Readers bound the sum
    over a checkpoint's derived writers (a mesh rule of a few bytes can name millions of ranks); the planner
    counts the same and lists the writers past the bound."""
    kind = rule[0]
    if kind == "mesh":
        return ranks + len(meshes[rule[1]].ranks)
    if kind == "range":
        parts, numel = len(meshes[rule[1]].ranks), math.prod(shape)
        size = -(-rule[3] // parts) if parts else 0
        if not numel or not size:
            return ranks
        return ranks + min((rule[2] + numel - 1) // size, parts - 1) - rule[2] // size + 1
    if kind == "boxes":
        return ranks * max(len(rule[1]), 1)
    return ranks


def check_rule(shape: tuple[int, ...], rule: Sequence[Any], meshes: Sequence[Mesh]) -> None:
    """Refuse malformed rules (they come from other ranks and from checkpoints: validate before use); a mesh
    rule places every dimension of its mesh, no more, no fewer."""
    n_meshes = len(meshes)
    ok = isinstance(rule, list | tuple) and rule and rule[0] in ("replica", "mesh", "boxes", "range")
    if ok and rule[0] == "mesh":
        ok = (
            len(rule) == 3
            and isinstance(rule[1], int)
            and not isinstance(rule[1], bool)
            and 0 <= rule[1] < n_meshes
            and isinstance(rule[2], list | tuple)
            and len(rule[2]) == len(meshes[rule[1]].shape)
            and all(isinstance(d, int) and not isinstance(d, bool) and -1 <= d < len(shape) for d in rule[2])
        )
    if ok and rule[0] == "range":  # bounded before anything is expanded: the flat space holds the tensor
        ok = (
            len(rule) == 4
            and all(isinstance(x, int) and not isinstance(x, bool) for x in rule[1:])
            and 0 <= rule[1] < n_meshes
            and 0 <= rule[2]
            and rule[2] + math.prod(shape) <= rule[3] <= MAX_FLAT_ELEMENTS
        )
    if ok and rule[0] == "boxes":
        ok = (
            len(rule) == 2
            and isinstance(rule[1], list | tuple)
            and all(_box_form(b, len(shape)) for b in rule[1])
        )
    if ok and rule[0] == "replica":
        ok = len(rule) == 1
    if not ok:
        raise PlanError(f"malformed layout rule {rule!r} for a tensor of shape {shape}")


def _box_form(b: Any, ndim: int) -> bool:
    """Whether ``b`` is ``[offsets, lengths]`` (or a :class:`Box`) of ``ndim`` integers each."""
    if isinstance(b, Box):
        return b.ndim == ndim
    return (
        isinstance(b, list | tuple)
        and len(b) == 2
        and all(isinstance(v, list | tuple) and len(v) == ndim and all(_is_int(x) for x in v) for v in b)
    )


def _is_int(x: Any) -> bool:
    return isinstance(x, int | np.integer) and not isinstance(x, bool)


def digest(obj: Any) -> bytes:
    """A 16-byte digest of a JSON-able object (canonical separators)."""
    return hashlib.blake2b(json.dumps(obj, separators=(",", ":")).encode(), digest_size=16).digest()


def encode_ranks(ranks: Sequence[int]) -> list[list[int]]:
    """Sorted ranks as ``[start, stop, step]`` runs (a DP group or a whole world is one run)."""
    out: list[list[int]] = []
    i, n = 0, len(ranks)
    while i < n:
        if i + 1 < n:
            step = ranks[i + 1] - ranks[i]
            j = i + 1
            while j + 1 < n and ranks[j + 1] - ranks[j] == step:
                j += 1
            out.append([ranks[i], ranks[j] + 1, step])
            i = j + 1
        else:
            out.append([ranks[i], ranks[i] + 1, 1])
            i += 1
    return out


def decode_ranks(runs: Any, world_size: int) -> tuple[int, ...]:
    """Inverse of :func:`encode_ranks`; refuses ranks outside ``[0, world_size)`` and absurd runs."""
    if not isinstance(runs, list):
        raise PlanError("ranks must be a list of [start, stop, step] runs")
    out: list[int] = []
    for run in runs:
        if (
            not isinstance(run, list)
            or len(run) != 3
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in run)
            or run[2] < 1
            or not 0 <= run[0] < run[1] <= world_size
        ):
            raise PlanError(f"malformed rank run {run!r} (world size {world_size})")
        out.extend(range(*run))
        if len(out) > world_size:
            raise PlanError(f"rank runs list more than {world_size} ranks")
    return tuple(out)
