"""``arraycheckpoint export``: merge a checkpoint of any save layout into Hugging Face-style safetensors.

Output (``--format safetensors``): ``model-0000N-of-0000M.safetensors`` files of at most ``max_shard_size``
bytes each (a single tensor larger than the cap gets a file of its own) and ``model.safetensors.index.json``
with ``metadata.total_size`` and ``weight_map``. Tensors are read one output file at a time, so peak memory is
about one output file (twice that when casting), never the model size.

Key names: model tensors lose their ``model/`` namespace (``model/layers.0.w`` -> ``layers.0.w``), as
``model.state_dict()`` names them; with ``what="all"`` other tensors keep their full names
(``optimizer/layers.0.w/exp_avg``). Tied weights recorded in ``model/~aliases`` are written under every name.
``--format torch`` writes one ``torch.save`` file of the same dict (for small models: it is built in memory).
"""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codecs import ML_DTYPE_NAMES, SUPPORTED_DTYPES, numpy_dtype
from ..errors import ArrayCheckpointError
from .common import Checkpoint, read_tensors

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = frozenset(n for n in SUPPORTED_DTYPES if n in ML_DTYPE_NAMES or n.startswith("float"))


@dataclass(frozen=True)
class ExportEntry:
    """One output key: the stored tensor it comes from and its size in the output dtype."""

    stored: str
    key: str
    dtype: str
    nbytes: int


@dataclass
class ExportResult:
    """What :func:`export_safetensors` / :func:`export_torch` wrote."""

    files: list[str] = field(default_factory=list)
    index: str | None = None
    total_size: int = 0
    tensors: int = 0


def select(
    ckpt: Checkpoint, what: str = "model", dtype: str | None = None, rename: Mapping[str, str] | None = None
) -> list[ExportEntry]:
    """The output keys of an export, in name order; raises on clashes after renaming.

    Args:
        what: ``"model"`` (the ``model/`` namespace) or ``"all"`` (every tensor, optimizer included).
        dtype: cast floating-point tensors to this dtype name (``bfloat16``, ``float16``, ``float32``, ...).
        rename: output key -> new output key (keys not in it keep their names).
    """
    if what not in ("model", "all"):
        raise ArrayCheckpointError(f"--what must be 'model' or 'all', not {what!r}")
    if dtype is not None:
        numpy_dtype(dtype)  # raises naming the dtype when unsupported
    meta = ckpt.meta
    pairs: list[tuple[str, str]] = []
    for name in sorted(meta.tensors):
        if name.startswith("model/"):
            pairs.append((name, name[len("model/") :]))
        elif what == "all":
            pairs.append((name, name))
    aliases = meta.objects.get("model/~aliases")
    if aliases is not None and isinstance(aliases.value, dict):
        for alias, target in sorted(aliases.value.items()):
            if f"model/{target}" in meta.tensors:
                pairs.append((f"model/{target}", str(alias)))
    if not pairs:
        raise ArrayCheckpointError(
            f"checkpoint {ckpt.root} has no tensors to export with --what {what} (namespaces: "
            f"{sorted({n.split('/', 1)[0] for n in meta.tensors}) or 'none'}); try --what all"
        )
    rename = dict(rename or {})
    unknown = sorted(set(rename) - {k for _s, k in pairs})
    if unknown:
        raise ArrayCheckpointError(f"rename map names keys that are not exported: {unknown[:10]}")
    entries = []
    seen: dict[str, str] = {}
    for stored, key in pairs:
        key = rename.get(key, key)
        if key in seen:
            raise ArrayCheckpointError(
                f"export key {key!r} would come from both {seen[key]!r} and {stored!r}; fix the rename map"
            )
        seen[key] = stored
        tm = meta.tensors[stored]
        out = dtype if dtype is not None and tm.dtype in FLOAT_DTYPES else tm.dtype
        entries.append(
            ExportEntry(
                stored, key, out, tm.nbytes // numpy_dtype(tm.dtype).itemsize * numpy_dtype(out).itemsize
            )
        )
    return entries


def plan_files(entries: list[ExportEntry], max_shard_size: int) -> list[list[ExportEntry]]:
    """Group entries, in order, into files of at most ``max_shard_size`` bytes (an oversized tensor alone)."""
    files: list[list[ExportEntry]] = []
    current: list[ExportEntry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > max_shard_size:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        files.append(current)
    return files


def _materialize(ckpt: Checkpoint, group: list[ExportEntry]) -> dict[str, np.ndarray]:
    arrays = read_tensors(ckpt, sorted({e.stored for e in group}))
    out = {}
    for e in group:
        arr = arrays[e.stored]
        target = numpy_dtype(e.dtype)
        if arr.dtype != target:
            arr = arr.astype(target)
        # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
        out[e.key] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    return out


def export_safetensors(
    ckpt: Checkpoint,
    out_dir: str | os.PathLike[str],
    entries: list[ExportEntry],
    max_shard_size: int,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write ``entries`` as sharded safetensors plus the index into ``out_dir`` (created if needed).

    Raises :class:`ArrayCheckpointError` when ``out_dir`` already holds safetensors files, unless
    ``overwrite`` (then they are removed first).
    """
    from safetensors.numpy import save_file

    out_dir = os.fspath(out_dir)
    os.makedirs(out_dir, exist_ok=True)
    stale = sorted(glob.glob(os.path.join(out_dir, "*.safetensors")))
    if os.path.exists(os.path.join(out_dir, INDEX_FILE)):
        stale.append(os.path.join(out_dir, INDEX_FILE))
    if stale and not overwrite:
        raise ArrayCheckpointError(
            f"{out_dir} already holds safetensors files ({os.path.basename(stale[0])}, ...); export into an empty "
            "directory or pass --overwrite to replace them"
        )
    for f in stale:  # a previous export with another file count would leave files the new index does not list
        os.unlink(f)
    groups = plan_files(entries, max_shard_size)
    result = ExportResult()
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups, start=1):
        fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        arrays = _materialize(ckpt, group)
        tmp = os.path.join(out_dir, f".{fname}.tmp")
        save_file(arrays, tmp, metadata={"format": "pt"})
        os.replace(tmp, os.path.join(out_dir, fname))
        for e in group:
            weight_map[e.key] = fname
        size = sum(a.nbytes for a in arrays.values())
        result.total_size += size
        result.tensors += len(arrays)
        result.files.append(fname)
        del arrays
        if progress is not None:
            progress(size)
    index = {
        "metadata": {
            "total_size": result.total_size,
            "format": "arraycheckpoint",
            "source": ckpt.root,
            "step": ckpt.meta.step,
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    result.index = os.path.join(out_dir, INDEX_FILE)
    with open(result.index, "w") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
    return result


def export_torch(
    ckpt: Checkpoint,
    out: str | os.PathLike[str],
    entries: list[ExportEntry],
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write ``entries`` as one ``torch.save`` dict ``{key: tensor}`` at ``out`` (built in memory)."""
    import torch

    from ..adapters.torch.tensors import as_torch

    out = os.fspath(out)
    if os.path.isdir(out):
        out = os.path.join(out, "model.pt")
    if os.path.exists(out) and not overwrite:
        raise ArrayCheckpointError(f"{out} exists; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    state: dict[str, Any] = {}
    result = ExportResult()
    for e in entries:
        arr = _materialize(ckpt, [e])[e.key]
        state[e.key] = as_torch(arr).clone()
        result.total_size += arr.nbytes
        if progress is not None:
            progress(arr.nbytes)
    tmp = out + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, out)
    result.files.append(out)
    result.tensors = len(state)
    return result
