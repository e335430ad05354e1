"""Reading helpers shared by the tools: open a checkpoint, read whole tensors or bounded row blocks.

Everything goes through the engine (:meth:`Engine.read_metadata` and :meth:`Engine.load`), so the tools see
exactly what :func:`arraycheckpoint.load` sees, checksums included.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._validate import explain_not_found
from ..codecs import numpy_dtype
from ..engine import engine
from ..errors import ArrayCheckpointError, CheckpointNotFoundError
from ..format.metadata import CheckpointMetadata, TensorMeta
from ..planning.items import LoadShard, LoadTensor
from ..planning.regions import Box
from ..storage import Storage

#: Rows of a tensor read at once by block-wise tools (diff), in bytes.
BLOCK_BYTES = 64 << 20


@dataclass(frozen=True)
class Checkpoint:
    """A committed checkpoint opened for reading: its storage backend, normalised root and metadata."""

    storage: Storage
    root: str
    meta: CheckpointMetadata


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open the committed checkpoint at ``path`` (raises :class:`CheckpointNotFoundError` otherwise, saying
    what is there instead: nothing, a file, a directory of checkpoints)."""
    try:
        storage, root, meta = engine().read_metadata(os.fspath(path))
    except CheckpointNotFoundError as e:
        raise explain_not_found(os.fspath(path), e) from None
    return Checkpoint(storage, root, meta)


def read_boxes(ckpt: Checkpoint, requests: Iterable[tuple[str, Box]]) -> dict[tuple[str, Box], np.ndarray]:
    """Read each ``(tensor name, region)`` concurrently; returns the arrays keyed by the request."""
    out: dict[tuple[str, Box], np.ndarray] = {}
    targets: dict[str, LoadTensor] = {}
    for name, box in requests:

        def sink(arr: np.ndarray, key: tuple[str, Box] = (name, box)) -> None:
            out[key] = arr

        targets.setdefault(name, LoadTensor(name)).shards.append(LoadShard(box, sink))
    engine().load(ckpt.storage, ckpt.root, ckpt.meta, list(targets.values()))
    return out


def read_tensors(ckpt: Checkpoint, names: Iterable[str]) -> dict[str, np.ndarray]:
    """Read whole tensors (global shape, stored dtype). Memory: the sum of their sizes."""
    names = list(names)
    got = read_boxes(ckpt, [(n, Box.full(ckpt.meta.tensors[n].shape)) for n in names])
    return {n: _shaped(got[(n, Box.full(ckpt.meta.tensors[n].shape))], ckpt.meta.tensors[n]) for n in names}


def _shaped(arr: np.ndarray, tm: TensorMeta) -> np.ndarray:
    arr = np.asarray(arr)
    if arr.dtype != numpy_dtype(tm.dtype):
        arr = arr.view(numpy_dtype(tm.dtype))
    return arr.reshape(tm.shape)


def row_blocks(tm: TensorMeta, block_bytes: int = BLOCK_BYTES) -> Iterator[Box]:
    """Split a tensor into boxes of whole rows (along dim 0) of at most ``block_bytes`` (one row at least)."""
    if len(tm.shape) == 0 or math.prod(tm.shape) == 0:
        yield Box.full(tm.shape)
        return
    row_bytes = max(1, math.prod(tm.shape[1:]) * numpy_dtype(tm.dtype).itemsize)
    rows = max(1, block_bytes // row_bytes)
    for start in range(0, tm.shape[0], rows):
        n = min(rows, tm.shape[0] - start)
        yield Box((start,) + (0,) * (len(tm.shape) - 1), (n,) + tuple(tm.shape[1:]))


def namespace(name: str) -> str:
    """The top-level namespace of an entry name (``model/layers.0.w`` -> ``model``)."""
    return name.split("/", 1)[0]


def human_bytes(n: float) -> str:
    """``1536`` -> ``1.5 KiB``."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 1 << 10,
    "MIB": 1 << 20,
    "GIB": 1 << 30,
    "TIB": 1 << 40,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
}


def parse_size(text: str) -> int:
    """Parse ``5GB`` / ``500MB`` / ``2GiB`` / ``1000`` into bytes (decimal units, as Hugging Face uses)."""
    s = text.strip().upper().replace(" ", "")
    num = s.rstrip("KMGTIB")
    unit = s[len(num) :]
    try:
        value = float(num)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count") from None
    if unit not in _SIZE_UNITS or not math.isfinite(value) or value * _SIZE_UNITS[unit] < 1:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    return int(value * _SIZE_UNITS[unit])


def jsonable(value: Any) -> Any:
    """Tuples to lists, recursively (for ``--json`` output)."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def refuse_inside(ckpt: Checkpoint, out: str, doing: str = "exported") -> None:
    """Refuse an output at or below the root of the (local) checkpoint read: its files would become part of
    a committed checkpoint (which ``save(..., overwrite=True)`` deletes whole), replace one of its files
    (a chunk, the commit marker), or replace the source files of a Hugging Face directory before they are
    read. ``doing`` says what is done to the checkpoint, for the message."""
    root = ckpt.root
    if "://" in root or not os.path.isdir(root):
        return
    real_root, real_out = os.path.realpath(root), os.path.realpath(out)
    if os.path.commonpath([real_root, real_out]) == real_root:
        raise ArrayCheckpointError(
            f"{out} is inside the checkpoint {root} being {doing}; write it outside (a checkpoint holds only "
            "what a save wrote)"
        )
