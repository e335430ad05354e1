"""``arraycheckpoint verify``: is a checkpoint complete and undamaged?

Checks, in order: the commit marker and metadata (and, format 3, the control node ``.acp/zarr.json``); for
every tensor, that its saved regions (ShardMeta) cover the whole global shape; that every stored chunk of its
chunk grid exists (a missing file would read back as zeros): a file of the array's directory, or, for a
packed array (format 5), a member of its pack, whose ZIP directory is read once per pack with the checks of
:func:`arraycheckpoint.audit.packdir.read_pack_directory`; and that every chunk decodes with its checksums (each
read goes through the engine, tensorstore's ``zip`` driver for a packed array, so a crc32c mismatch in a
shard index or an inner chunk raises; the arrays of one pack are read in one load). Every problem is
reported with the tensor and chunk named, and the pack file for a packed array. Format 6 (an array's chunks
in the packs of the ranks that wrote them): every pack of those ranks is read once with the checks of the
load (:func:`arraycheckpoint.audit.rankpacks.check_rank_packs`), then the arrays are read through the engine.
"""

from __future__ import annotations

import itertools
import math
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ..audit import capacity, packdir, rankpacks
from ..checks import limits
from ..engine import engine
from ..errors import ArrayCheckpointError, CorruptCheckpointError, MetadataError
from ..format.hierarchy import NamedKeys
from ..format.metadata import CONTROL_DIR, CheckpointMetadata, TensorMeta, chunk_key_separator
from ..planning.items import LoadShard, LoadTensor
from ..planning.regions import Box, chunk_boxes, intersect
from ..storage import Storage, storage_for
from .common import Checkpoint


@dataclass
class Problem:
    """One defect: the tensor (or ``""`` for the checkpoint), the chunk (grid index) and what is wrong."""

    tensor: str
    chunk: tuple[int, ...] | None
    message: str

    def __str__(self) -> str:
        where = self.tensor or "checkpoint"
        if self.chunk is not None:
            where += f" chunk {'/'.join(map(str, self.chunk)) or '(scalar)'}"
        return f"{where}: {self.message}"


@dataclass
class VerifyReport:
    """The outcome of :func:`verify`: ``ok`` only when no problem was found."""

    path: str
    tensors: int = 0
    chunks: int = 0
    bytes: int = 0
    problems: list[Problem] = field(default_factory=list)
    #: what is not wrong with the checkpoint but worth saying (keys its metadata does not name: strays)
    warnings: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


#: Coverage of overlapping regions is checked by a sweep over the grid their boundaries cut the tensor into:
#: the last one or two dimensions are a count grid (at most ``_MAX_GRID_CELLS`` cells) that each region adds
#: itself to when the sweep enters it and leaves when the sweep passes it, keeping the number of uncovered
#: cells, so the work is the regions' areas on that grid, not the number of cells of the whole tensor. Region
#: lists needing more than ``MAX_COVER_WORK`` cell updates (or more than ``_MAX_SWEEPS`` sweep steps) are
#: reported, not checked: a save writes disjoint regions, or identical replicas, which take the fast path.
MAX_COVER_WORK = 1 << 31
_MAX_SWEEPS = 1 << 20
_MAX_GRID_CELLS = 1 << 22
#: holes :func:`uncovered` lists at most (runs of grid cells along the last dimension)
MAX_HOLES = 1024


def uncovered(tm: TensorMeta) -> list[Box]:
    """The parts of ``tm``'s global shape that no saved region covers (empty when fully covered; at most
    :data:`MAX_HOLES` boxes).

    Disjoint regions (what the planner records) are checked by volume plus a sweep for overlaps; otherwise
    coordinates are compressed to the region boundaries and the grid is swept slab by slab (the last two
    dimensions of each slab at once, by a 2-d prefix sum), so the cost depends on the number of regions, not
    on the tensor's size.

    Raises:
        MetadataError: the regions cut the tensor into more than :data:`MAX_COVER_CELLS` cells.
    """
    if any(s == 0 for s in tm.shape):
        return []
    if not tm.shape:
        return [] if tm.shards else [Box((), ())]
    if len(tm.shards) == 1 and tm.shards[0].box.lengths == tm.shape and not any(tm.shards[0].box.offsets):
        return []  # the one region is the whole tensor (every single-process save): nothing to sort
    boxes = sorted({s.box for s in tm.shards if s.box.volume})
    if sum(b.volume for b in boxes) == math.prod(tm.shape) and _disjoint(boxes):
        return []  # disjoint regions inside the shape whose volumes add up to it: fully covered
    return _swept_holes(tm.name, tm.shape, boxes)


def _swept_holes(name: str, shape: tuple[int, ...], boxes: list[Box]) -> list[Box]:
    """:func:`uncovered` for any regions: a sweep over the grid their boundaries cut ``shape`` into."""
    import numpy as np

    pad = len(shape) == 1  # a 1-d tensor is swept as [n, 1]
    shape = (*shape, 1) if pad else shape
    d = len(shape)
    lo_pts = np.array([(*b.offsets, 0) if pad else b.offsets for b in boxes], dtype=np.int64).reshape(-1, d)
    len_pts = np.array([(*b.lengths, 1) if pad else b.lengths for b in boxes], dtype=np.int64).reshape(-1, d)
    hi_pts = np.minimum(lo_pts + len_pts, np.array(shape, dtype=np.int64))
    cuts = [np.unique(np.concatenate([[0, n], lo_pts[:, k], hi_pts[:, k]])) for k, n in enumerate(shape)]
    cuts = [c[(c >= 0) & (c <= n)] for c, n in zip(cuts, shape)]
    sizes = [len(c) - 1 for c in cuts]
    lo = np.stack([np.searchsorted(cuts[k], lo_pts[:, k]) for k in range(d)], axis=1)
    hi = np.stack([np.searchsorted(cuts[k], hi_pts[:, k]) for k in range(d)], axis=1)
    sweep = d - 3 if d >= 3 else 0  # the dimension swept; before it: enumerated; after it: the count grid
    grid_shape = sizes[sweep + 1 :]
    outer = math.prod(sizes[:sweep])
    areas = np.prod(hi[:, sweep + 1 :] - lo[:, sweep + 1 :], axis=1)
    work = outer * (2 * int(areas.sum()) + sizes[sweep])
    if work > MAX_COVER_WORK or outer * sizes[sweep] > _MAX_SWEEPS or math.prod(grid_shape) > _MAX_GRID_CELLS:
        raise MetadataError(
            f"tensor {name!r}: its {len(boxes)} saved regions overlap so much that checking their coverage "
            f"takes {work} cell updates, more than the {MAX_COVER_WORK} a check does; a save writes disjoint "
            "regions (or identical replicas), so the metadata is damaged or hostile"
        )
    holes: list[Box] = []
    for cell in itertools.product(*(range(n) for n in sizes[:sweep])):
        live = np.flatnonzero(np.all((lo[:, :sweep] <= cell) & (hi[:, :sweep] > cell), axis=1))
        enter = live[np.argsort(lo[live, sweep], kind="stable")]
        leave = live[np.argsort(hi[live, sweep], kind="stable")]
        count = np.zeros(grid_shape, dtype=np.int32)
        empty = count.size  # cells of the grid no region covers at the current sweep position
        i_enter = i_leave = 0
        for pos in range(sizes[sweep]):
            while i_leave < len(leave) and hi[leave[i_leave], sweep] <= pos:
                part = count[_grid_slices(lo, hi, leave[i_leave], sweep)]
                part -= 1
                empty += int(np.count_nonzero(part == 0))
                i_leave += 1
            while i_enter < len(enter) and lo[enter[i_enter], sweep] <= pos:
                part = count[_grid_slices(lo, hi, enter[i_enter], sweep)]
                empty -= int(np.count_nonzero(part == 0))
                part += 1
                i_enter += 1
            if not empty:
                continue
            for run in _empty_runs(count == 0):
                idx = (*cell, pos, *run[:-1])  # grid index of the run's first cell; run[-1]: its end
                offsets = tuple(int(cuts[k][i]) for k, i in enumerate(idx))
                ends = tuple(int(cuts[k][i + 1]) for k, i in enumerate(idx[:-1])) + (int(cuts[-1][run[-1]]),)
                box = Box(offsets, tuple(e - o for e, o in zip(ends, offsets)))
                holes.append(Box(box.offsets[:1], box.lengths[:1]) if pad else box)
                if len(holes) >= MAX_HOLES:
                    return holes
    return holes


def _grid_slices(lo: Any, hi: Any, box: int, sweep: int) -> tuple[slice, ...]:
    """Where region ``box`` lies on the count grid (the dimensions after ``sweep``)."""
    return tuple(slice(int(a), int(b)) for a, b in zip(lo[box, sweep + 1 :], hi[box, sweep + 1 :]))


def _empty_runs(empty: Any) -> list[tuple[int, ...]]:
    """Runs of ``True`` along the last dimension of the 1-d or 2-d mask ``empty``: ``(i, start, end)`` (2-d)
    or ``(start, end)`` (1-d)."""
    import numpy as np

    rows = empty if empty.ndim == 2 else empty[None, :]
    runs: list[tuple[int, ...]] = []
    for i in np.flatnonzero(rows.any(axis=1)):
        edges = np.flatnonzero(np.diff(np.concatenate([[0], rows[i].astype(np.int8), [0]])))
        for start, end in zip(edges[::2], edges[1::2]):
            runs.append((int(i), int(start), int(end)) if empty.ndim == 2 else (int(start), int(end)))
    return runs


def _disjoint(boxes: list[Box]) -> bool:
    """True when no two boxes overlap; False when two do, or when telling costs more than a few comparisons
    per box (the caller then sweeps the grid of their boundaries, :func:`_swept_holes`, bounded by cells).

    A sweep along the dimension cut at the most offsets: only boxes whose extents along it overlap are
    compared (regions split by columns all start at row 0: swept by rows, every pair would be compared, 2 G
    comparisons at 64,000 ranks, from a mesh rule of a few hundred bytes)."""
    if not boxes:
        return True
    d = max(range(boxes[0].ndim), key=lambda k: len({b.offsets[k] for b in boxes}), default=0)
    budget = _DISJOINT_COMPARISONS_PER_BOX * len(boxes) + _DISJOINT_COMPARISONS_FREE
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offsets[d]):
        budget -= len(active) + 1
        if budget < 0:
            return False
        active = [a for a in active if a.offsets[d] + a.lengths[d] > b.offsets[d]]
        if any(intersect(a, b) is not None for a in active):
            return False
        active.append(b)
    return True


#: :func:`_disjoint` gives up after this many comparisons per box (plus a few free ones): a product grid of
#: regions (a 2-D mesh) compares each box with a slab of others; past this the exact sweep is cheaper.
_DISJOINT_COMPARISONS_PER_BOX = 16
_DISJOINT_COMPARISONS_FREE = 1 << 16


def chunk_index(box: Box, chunk_shape: tuple[int, ...]) -> tuple[int, ...]:
    """The grid index of a (clipped) chunk box."""
    return tuple(o // c for o, c in zip(box.offsets, chunk_shape))


def chunk_key(index: tuple[int, ...], separator: str = ".") -> str:
    """The stored key of a chunk under the array (zarr v3 default encoding; ``separator`` by format)."""
    return separator.join(["c", *map(str, index)])


def verify(
    path: str | os.PathLike[str],
    progress: Callable[[int], None] | None = None,
    read_data: bool = True,
) -> VerifyReport:
    """Check the checkpoint at ``path``; see the module docstring. ``progress(nbytes)`` is called per tensor.

    Raises :class:`CheckpointNotFoundError` when nothing (neither metadata nor marker) is at ``path``; every
    other defect is reported in the returned :class:`VerifyReport`.
    """
    with capacity.counted_once():  # the packs' capacity counted here, their directories read once
        return _verify(path, progress, read_data)


def _verify(
    path: str | os.PathLike[str], progress: Callable[[int], None] | None, read_data: bool
) -> VerifyReport:
    storage, root = storage_for(os.fspath(path))
    report = VerifyReport(root)
    files = storage.control_files(root)  # format 3's .acp/, or an older checkpoint's root
    raw = storage.read(root, files.metadata)
    committed = storage.exists(root, files.committed)
    if raw is None:
        if committed:
            report.problems.append(Problem("", None, f"committed but {files.metadata} is missing"))
            return report
        from .._validate import explain_not_found
        from ..errors import CheckpointNotFoundError
        from ..sources import foreign_kind

        kind = foreign_kind(storage, root)
        if kind is not None:
            raise CheckpointNotFoundError(
                f"{path} is a {'Hugging Face safetensors' if kind == 'safetensors' else 'torch DCP'} directory, "
                "not an arraycheckpoint checkpoint: verify checks this library's checkpoints (acp.load reads "
                "it as it is; `arraycheckpoint import` makes a checkpoint of it)"
            )
        raise explain_not_found(
            os.fspath(path),
            CheckpointNotFoundError(
                f"no checkpoint at {root}: neither {files.metadata} nor {files.committed}"
            ),
        )
    if not committed:
        report.problems.append(
            Problem(
                "",
                None,
                f"no commit marker {files.committed}: the save did not finish; the checkpoint does not load",
            )
        )
    try:
        meta = CheckpointMetadata.from_json(raw, what=f"{root}/{files.metadata}")
        # the bounds (chunks per array, chunk bytes) before anything is sized from the declared layouts
        limits.check_layouts(meta)
    except ArrayCheckpointError as e:
        report.problems.append(Problem("", None, str(e)))
        return report
    if files.node is not None and not storage.exists(root, files.node):
        report.problems.append(
            Problem(
                "",
                None,
                f"control node {files.node} is missing: the checkpoint loads, but zarr-python and xarray "
                f"listings warn about the files in {CONTROL_DIR}/ (re-save it, or restore the file)",
            )
        )
    report.warnings.extend(_strays(storage, root, meta))
    ckpt = Checkpoint(storage, root, meta)
    packs = _PackIndex(storage, root, meta)
    # format 6: reading the data checks every pack read (the load's own check_rank_packs, once); the packs are
    # checked here beforehand only without the data read, and after a failed read to name what is wrong
    packed = {n for n, t in meta.tensors.items() if t.pack_rank is not None}
    # before a key is built per chunk: the packs can hold the chunks the metadata puts in them (without the
    # data read, the checks of the packs counted them: counting again read a big directory a second time)
    by_rank = packed if read_data else _check_rank_packs(storage, root, meta, report, packed)
    try:
        if read_data:
            capacity.check_capacity(storage, root, meta, sorted(by_rank))
    except ArrayCheckpointError as e:
        named = getattr(e, "tensors", {})
        report.problems.extend(Problem(n, None, f"stored in packs: {named[n]}") for n in sorted(named))
        by_rank = set(by_rank) - set(named)
    jobs: dict[str, list[tuple[TensorMeta, list[tuple[tuple[int, ...], Box]]]]] = {}
    for name, tm in sorted(meta.tensors.items()):
        report.tensors += 1
        try:
            holes = uncovered(tm)[:5]
        except ArrayCheckpointError as e:  # regions too tangled to check: reported, not checked
            report.problems.append(Problem(name, None, str(e)))
            holes = []
        for hole in holes:
            report.problems.append(
                Problem(
                    name,
                    None,
                    f"region {list(hole.offsets)}+{list(hole.lengths)} is covered by no saved shard",
                )
            )
        if tm.pack_rank is not None and name not in by_rank:  # format 6: its packs were reported
            report.chunks += math.prod(-(-s // c) for s, c in zip(tm.shape, tm.chunk_shape))
            report.bytes += tm.nbytes
            if progress is not None:
                progress(tm.nbytes)
            continue
        boxes = list(chunk_boxes(tm.shape, tm.chunk_shape)) if tm.shape else [Box((), ())]
        if tm.writers and len(tm.writers) != len(boxes):
            report.problems.append(
                Problem(name, None, f"metadata lists {len(tm.writers)} chunk writers for {len(boxes)} chunks")
            )
        report.chunks += len(boxes)
        report.bytes += tm.nbytes
        if tm.pack is None:
            present = _stored_chunks(storage, root, name)
        elif tm.pack_rank is not None:  # format 6: its packs were checked whole (or read with the data)
            present = {
                chunk_key(chunk_index(b, tm.chunk_shape), chunk_key_separator(meta.format_version))
                for b in boxes
            }
        else:
            found = packs.chunks(tm, report)
            if found is None:  # the pack is unusable or lacks the array's zarr.json: nothing to read
                if progress is not None:
                    progress(tm.nbytes)
                continue
            present = found
        readable = []
        for box in boxes:
            idx = chunk_index(box, tm.chunk_shape)
            key = chunk_key(idx, chunk_key_separator(meta.format_version))
            if key not in present:
                writer = (
                    f" (written by rank {tm.writers[len(readable)]})" if len(tm.writers) == len(boxes) else ""
                )
                report.problems.append(Problem(name, idx, f"{_chunk_file(tm, key, root)} is missing{writer}"))
            else:
                readable.append((idx, box))
        if readable:
            # the arrays of one pack are read together: each load of a pack reads its ZIP directory once
            group = f"/{name}" if tm.pack is None else ("/packs" if tm.pack_rank is not None else tm.pack)
            jobs.setdefault(group, []).append((tm, readable))
    for key, group in jobs.items():
        if read_data and key == "/packs":
            _read_packed(ckpt, group, report)
        elif read_data:
            _read_group(ckpt, group, report)
        if progress is not None:
            progress(sum(tm.nbytes for tm, _ in group))
    return report


#: Checks of format-6 packs that narrowing a failure down may take (:func:`_check_rank_packs`).
MAX_PACK_CHECKS = 64


def _check_rank_packs(
    storage: Storage, root: str, meta: CheckpointMetadata, report: VerifyReport, names: set[str]
) -> set[str]:
    """Format 6: check the packs of the packed arrays ``names`` (:func:`arraycheckpoint.audit.rankpacks.check_rank_packs`)
    and return those whose packs passed; each array of a damaged pack is reported. A failure names every array
    a damaged pack concerns (the error's ``tensors``): those are reported and the rest checked again, one check
    per damaged pack, never one per array (each check reads the packs concerned); a failure naming none is
    narrowed down by bisection. At most :data:`MAX_PACK_CHECKS` checks in all: past them, a part still failing
    is reported with its error."""
    ok: set[str] = set()
    checks = 0  # checks made (each reads the packs concerned)

    def check(part: list[str]) -> str | None:
        nonlocal checks
        checks += 1
        try:
            rankpacks.check_rank_packs(storage, root, meta, part)
        except ArrayCheckpointError as e:
            return _short(e)
        ok.update(part)
        return None

    def narrow(part: list[str], error: str) -> None:
        if len(part) > 1 and checks < MAX_PACK_CHECKS:
            halves = [part[: len(part) // 2], part[len(part) // 2 :]]
            for half in halves:
                e = check(half)
                if e is not None:
                    narrow(half, e)
            return
        report.problems.extend(Problem(n, None, f"stored in packs: {error}") for n in part)

    left = sorted(names)
    while left and checks < MAX_PACK_CHECKS:
        try:
            checks += 1
            rankpacks.check_rank_packs(storage, root, meta, left)
            ok.update(left)
            return ok
        except ArrayCheckpointError as e:
            named = getattr(e, "tensors", {})  # every array the damage concerns -> what is wrong for it
            if not set(named) & set(left):
                narrow(left, _short(e))
                return ok
            report.problems.extend(
                Problem(n, None, f"stored in packs: {_short(Exception(named[n]))}")
                for n in left
                if n in named
            )
            left = [n for n in left if n not in named]
    report.problems.extend(
        Problem(n, None, "stored in packs: not checked (too many damaged packs)") for n in left
    )
    return ok


def _read_packed(
    ckpt: Checkpoint, group: list[tuple[TensorMeta, list[tuple[tuple[int, ...], Box]]]], report: VerifyReport
) -> None:
    """Format 6: read every chunk of the packed arrays of ``group`` in one load (which checks their packs, each
    read once); when it fails, check the packs to report the arrays whose packs are damaged, then narrow the
    read of the others down (:func:`_read_group`)."""
    targets = [LoadTensor(tm.name, [LoadShard(box, _discard) for _i, box in chunks]) for tm, chunks in group]
    try:
        engine().load(ckpt.storage, ckpt.root, ckpt.meta, targets)
        return
    except Exception:  # noqa: BLE001 - narrowed down below
        pass
    sound = _check_rank_packs(ckpt.storage, ckpt.root, ckpt.meta, report, {tm.name for tm, _ in group})
    rest = [job for job in group if job[0].name in sound]
    if rest:
        _read_group(ckpt, rest, report)


class _PackIndex:
    """The chunk members of every packed array, from one read of each pack's ZIP directory."""

    def __init__(self, storage: Storage, root: str, meta: CheckpointMetadata) -> None:
        self.storage, self.root, self.meta = storage, root.rstrip("/"), meta
        self._members: dict[str, set[str] | BaseException] = {}

    def path(self, pack: str) -> str:
        """Where the pack ``pack`` (a key relative to the root) is."""
        return f"{self.root}/{pack}"

    def chunks(self, tm: TensorMeta, report: VerifyReport) -> set[str] | None:
        """The chunk keys the pack of ``tm`` holds for it; None (and a problem reported) when the pack is
        missing or unreadable, or the array's ``zarr.json`` member is missing or duplicated."""
        assert tm.pack is not None
        got = self._members.get(tm.pack)
        if got is None:
            try:
                infos, _size = packdir.read_pack_directory(self.storage, self.root, self.meta, tm.pack)
                counts = Counter(i.filename for i in infos)
                got = set(counts)
                twice = sorted(n for n, c in counts.items() if c > 1)
                if twice:
                    got = CorruptCheckpointError(
                        f"{self.path(tm.pack)} names the member(s) {twice[:5]} twice; the pack is damaged"
                    )
            except ArrayCheckpointError as e:
                got = e
            self._members[tm.pack] = got
        if isinstance(got, BaseException):
            report.problems.append(Problem(tm.name, None, f"stored in the pack {tm.pack}: {_short(got)}"))
            return None
        if f"{tm.name}/zarr.json" not in got:
            report.problems.append(
                Problem(
                    tm.name, None, f"member {tm.name}/zarr.json of the pack {self.path(tm.pack)} is missing"
                )
            )
            return None
        prefix = f"{tm.name}/"
        return {k[len(prefix) :] for k in got if k.startswith(prefix) and _is_chunk_key(k[len(prefix) :])}


def _chunk_file(tm: TensorMeta, key: str, root: str) -> str:
    """How a report names the stored file of ``tm``'s chunk ``key``: a file of its directory, or a member of
    its pack."""
    if tm.pack is None:
        return f"stored chunk file {key}"
    if tm.pack_rank is not None:
        return f"member {tm.name}/{key} of a pack in {root.rstrip('/')}/{tm.pack.rpartition('/')[0]}"
    return f"member {tm.name}/{key} of the pack {root.rstrip('/')}/{tm.pack}"


def _is_chunk_key(key: str) -> bool:
    return key == "c" or key.startswith(("c/", "c."))


def _strays(storage: Storage, root: str, meta: CheckpointMetadata) -> list[str]:
    """A warning naming the keys of the checkpoint's directory its metadata does not name (a planted array
    or group, a foreign file): no part of the checkpoint, which the load and ``checkpoint_store`` ignore."""
    try:
        keys = storage.list(root)
    except Exception:  # noqa: BLE001 - an unlistable checkpoint shows up as its arrays' files missing
        return []
    names = NamedKeys(meta)
    strays = [k for k in keys if not names.key(k)]
    if not strays:
        return []
    more = f" (and {len(strays) - 10} more)" if len(strays) > 10 else ""
    return [
        f"{len(strays)} stray key(s) the metadata does not name, no part of the checkpoint (the load and "
        f"checkpoint_store ignore them; remove them): {', '.join(strays[:10])}{more}"
    ]


def _stored_chunks(storage: Storage, root: str, name: str) -> set[str]:
    try:
        keys = storage.list(f"{root.rstrip('/')}/{name}")
    except Exception:  # noqa: BLE001 - an unlistable array shows up as every chunk missing
        return set()
    return {k for k in keys if _is_chunk_key(k)}


def _discard(_arr: object) -> None:
    return None


def _read_group(
    ckpt: Checkpoint, group: list[tuple[TensorMeta, list[tuple[tuple[int, ...], Box]]]], report: VerifyReport
) -> None:
    """Read every chunk of the arrays of ``group`` (one array, or the arrays of one pack) in one load,
    discarding the data; on failure bisect the group (a pack of thousands of arrays with one bad member costs
    a few dozen loads, not thousands), then read the failing array chunk by chunk to name each bad chunk."""
    if len(group) == 1:
        _read_chunks(ckpt, group[0][0], group[0][1], report)
        return
    targets = [LoadTensor(tm.name, [LoadShard(box, _discard) for _i, box in chunks]) for tm, chunks in group]
    try:
        engine().load(ckpt.storage, ckpt.root, ckpt.meta, targets)
        return
    except Exception:  # noqa: BLE001 - narrowed down below
        pass
    half = len(group) // 2
    _read_group(ckpt, group[:half], report)
    _read_group(ckpt, group[half:], report)


def _read_chunks(
    ckpt: Checkpoint, tm: TensorMeta, chunks: list[tuple[tuple[int, ...], Box]], report: VerifyReport
) -> None:
    """Read every chunk (discarding the data); on failure retry one by one to name each bad chunk."""
    try:
        engine().load(
            ckpt.storage,
            ckpt.root,
            ckpt.meta,
            [LoadTensor(tm.name, [LoadShard(box, _discard) for _i, box in chunks])],
        )
        return
    except Exception:  # noqa: BLE001 - narrowed down below
        pass
    sep = chunk_key_separator(ckpt.meta.format_version)
    for idx, box in chunks:
        try:
            engine().load(
                ckpt.storage, ckpt.root, ckpt.meta, [LoadTensor(tm.name, [LoadShard(box, _discard)])]
            )
        except Exception as e:  # noqa: BLE001
            where = f" ({_chunk_file(tm, chunk_key(idx, sep), ckpt.root)})" if tm.pack is not None else ""
            report.problems.append(Problem(tm.name, idx, f"unreadable{where}: {_short(e)}"))


def _short(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg if len(msg) < 300 else msg[:300] + "..."
