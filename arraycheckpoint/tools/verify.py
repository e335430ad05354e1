"""``arraycheckpoint verify``: is a checkpoint complete and undamaged?

Checks, in order: the commit marker and metadata (and, format 3, the control node ``.acp/zarr.json``); for
every tensor, that its saved regions (ShardMeta) cover
the whole global shape; that every stored chunk file of its chunk grid exists (a missing file would read back
as zeros); and that every chunk decodes with its checksums (each read goes through the engine, so a crc32c
mismatch in a shard index or an inner chunk raises). Every problem is reported with the tensor and chunk named.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field

from ..engine import engine
from ..errors import ArrayCheckpointError
from ..items import LoadShard, LoadTensor
from ..metadata import CONTROL_DIR, CheckpointMetadata, TensorMeta, chunk_key_separator
from ..regions import Box, chunk_boxes, intersect
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

    @property
    def ok(self) -> bool:
        return not self.problems


def uncovered(tm: TensorMeta) -> list[Box]:
    """The parts of ``tm``'s global shape that no saved region covers (empty when fully covered).

    Disjoint regions (what the planner records) are checked by volume plus a sweep for overlaps; otherwise
    coordinates are compressed to the region boundaries, so the cost depends on the number of regions, not on
    the tensor's size.
    """
    if any(s == 0 for s in tm.shape):
        return []
    if not tm.shape:
        return [] if tm.shards else [Box((), ())]
    boxes = sorted({s.box for s in tm.shards if s.box.volume})
    if sum(b.volume for b in boxes) == math.prod(tm.shape) and _disjoint(boxes):
        return []  # disjoint regions inside the shape whose volumes add up to it: fully covered
    cuts = []
    for d, size in enumerate(tm.shape):
        points = {0, size}
        for s in tm.shards:
            points.add(s.offsets[d])
            points.add(s.offsets[d] + s.lengths[d])
        cuts.append(sorted(p for p in points if 0 <= p <= size))
    holes = []
    for cell in itertools.product(*(range(len(c) - 1) for c in cuts)):
        offsets = tuple(cuts[d][i] for d, i in enumerate(cell))
        lengths = tuple(cuts[d][i + 1] - cuts[d][i] for d, i in enumerate(cell))
        box = Box(offsets, lengths)
        if not any(b.contains(box) for b in boxes):
            holes.append(box)
    return holes


def _disjoint(boxes: list[Box]) -> bool:
    """True when no two boxes overlap (sweep along dim 0: only boxes whose row ranges overlap are compared)."""
    active: list[Box] = []
    for b in sorted(boxes, key=lambda b: b.offsets[0]):
        active = [a for a in active if a.offsets[0] + a.lengths[0] > b.offsets[0]]
        if any(intersect(a, b) is not None for a in active):
            return False
        active.append(b)
    return True


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
    storage, root = storage_for(os.fspath(path))
    report = VerifyReport(root)
    files = storage.control_files(root)  # format 3's .acp/, or an older checkpoint's root
    raw = storage.read(root, files.metadata)
    committed = storage.exists(root, files.committed)
    if raw is None:
        if committed:
            report.problems.append(Problem("", None, f"committed but {files.metadata} is missing"))
            return report
        from ..errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(
            f"no checkpoint at {root}: neither {files.metadata} nor {files.committed}"
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
    ckpt = Checkpoint(storage, root, meta)
    for name, tm in sorted(meta.tensors.items()):
        report.tensors += 1
        for hole in uncovered(tm)[:5]:
            report.problems.append(
                Problem(
                    name,
                    None,
                    f"region {list(hole.offsets)}+{list(hole.lengths)} is covered by no saved shard",
                )
            )
        boxes = list(chunk_boxes(tm.shape, tm.chunk_shape)) if tm.shape else [Box((), ())]
        if tm.writers and len(tm.writers) != len(boxes):
            report.problems.append(
                Problem(name, None, f"metadata lists {len(tm.writers)} chunk writers for {len(boxes)} chunks")
            )
        present = _stored_chunks(storage, root, name)
        readable = []
        for box in boxes:
            idx = chunk_index(box, tm.chunk_shape)
            key = chunk_key(idx, chunk_key_separator(meta.format_version))
            if key not in present:
                writer = (
                    f" (written by rank {tm.writers[len(readable)]})" if len(tm.writers) == len(boxes) else ""
                )
                report.problems.append(Problem(name, idx, f"stored chunk file {key} is missing{writer}"))
            else:
                readable.append((idx, box))
        report.chunks += len(boxes)
        if read_data and readable:
            _read_chunks(ckpt, tm, readable, report)
        report.bytes += tm.nbytes
        if progress is not None:
            progress(tm.nbytes)
    return report


def _stored_chunks(storage: Storage, root: str, name: str) -> set[str]:
    try:
        keys = storage.list(f"{root.rstrip('/')}/{name}")
    except Exception:  # noqa: BLE001 - an unlistable array shows up as every chunk missing
        return set()
    return {k for k in keys if k == "c" or k.startswith(("c/", "c."))}


def _read_chunks(
    ckpt: Checkpoint, tm: TensorMeta, chunks: list[tuple[tuple[int, ...], Box]], report: VerifyReport
) -> None:
    """Read every chunk (discarding the data); on failure retry one by one to name each bad chunk."""

    def discard(_arr: object) -> None:
        return None

    try:
        engine().load(
            ckpt.storage,
            ckpt.root,
            ckpt.meta,
            [LoadTensor(tm.name, [LoadShard(box, discard) for _i, box in chunks])],
        )
        return
    except Exception:  # noqa: BLE001 - narrowed down below
        pass
    for idx, box in chunks:
        try:
            engine().load(
                ckpt.storage, ckpt.root, ckpt.meta, [LoadTensor(tm.name, [LoadShard(box, discard)])]
            )
        except Exception as e:  # noqa: BLE001
            report.problems.append(Problem(tm.name, idx, f"unreadable: {_short(e)}"))


def _short(e: BaseException) -> str:
    msg = str(e).splitlines()[0] if str(e) else type(e).__name__
    return msg if len(msg) < 300 else msg[:300] + "..."
