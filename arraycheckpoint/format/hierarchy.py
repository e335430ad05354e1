"""The zarr documents a checkpoint's coordinator writes beside the arrays (pure: builds bytes, no I/O).

At commit, the coordinator stores the metadata and makes the checkpoint a valid zarr v3 hierarchy: a group
``zarr.json`` in the root (attributes: format version, framework, step, topology, and ``packed_arrays``, a hint
for plain-path readers, when arrays are packed) and in every directory
between the root and an entry, and the control node ``.acp/zarr.json``. The control node is an empty
zarr v3 *array* (shape ``[0]``, ``uint8``): readers that list a group (zarr-python's ``members()``/``tree()``,
xarray's ``open_datatree``) see one harmless empty array and never list inside it, so the control files
beside it (:data:`~arraycheckpoint.format.metadata.CONTROL`) raise no "not a zarr node" warning.
"""

from __future__ import annotations

import json
from collections.abc import Container
from typing import Any

from .metadata import CONTROL, CONTROL_DIR, LEGACY_CONTROL, CheckpointMetadata, chunk_key_separator

#: The dimension name of the control node (entries' dimensions are ``<name>.dim<axis>``: no clash).
CONTROL_DIMENSION = "acp"


def control_node() -> dict[str, Any]:
    """The zarr v3 metadata of the control node ``.acp``: an empty array describing the files it holds."""
    return {
        "zarr_format": 3,
        "node_type": "array",
        "shape": [0],
        "data_type": "uint8",
        "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1]}},
        "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
        "fill_value": 0,
        "codecs": [{"name": "bytes"}],
        "dimension_names": [CONTROL_DIMENSION],
        "attributes": {
            "arraycheckpoint": {
                "description": (
                    "arraycheckpoint control files; this empty array holds no data. The tensors are the "
                    "other arrays of this hierarchy."
                ),
                "files": {
                    _base(
                        CONTROL.metadata
                    ): "metadata: every tensor's shape, dtype, chunks and saved regions",
                    _base(CONTROL.committed): "commit marker: a checkpoint without it is not committed",
                    _base(CONTROL.metrics): "per-rank phase timings of the save (optional)",
                    _base(
                        CONTROL.load_metrics
                    ): "per-rank phase timings of the last recorded load (optional)",
                },
            }
        },
    }


def packed_hint(count: int) -> str:
    """The root attribute telling a plain-path reader (xarray shows root attributes) where packed arrays are."""
    return (
        f"{count} small arrays of this checkpoint are stored in pack files ({CONTROL_DIR}/packs/, ZIP archives of "
        "their zarr chunk files): opened by its plain path, their groups look empty. Read the whole checkpoint "
        "through arraycheckpoint.zarr.checkpoint_store(path): zarr.open_group(checkpoint_store(path), mode='r') "
        "or xarray.open_zarr(checkpoint_store(path), group='model')"
    )


def _base(key: str) -> str:
    return key[len(CONTROL_DIR) + 1 :]


def hierarchy_documents(meta: CheckpointMetadata) -> dict[str, bytes]:
    """Every document the coordinator writes at commit, key (relative to the root) -> bytes: the metadata,
    the control node and a group ``zarr.json`` for the root and each directory above an entry."""
    return {CONTROL.metadata: meta.to_json().encode(), **node_documents(meta)}


def node_documents(meta: CheckpointMetadata) -> dict[str, bytes]:
    """The zarr documents of :func:`hierarchy_documents` that are not the metadata: the control node and
    every group's ``zarr.json`` (what ``checkpoint_store`` serves in place of the stored ones)."""
    groups = group_paths(meta)
    attrs = {
        "format_version": meta.format_version,
        "framework": meta.framework,
        "step": meta.step,
        "world_size": meta.world_size,
        "topology": dict(meta.topology),
        "roles": list(meta.roles),
    }
    packed = sum(1 for t in meta.tensors.values() if t.pack is not None)
    if packed:
        attrs["packed_arrays"] = packed_hint(packed)
    assert CONTROL.node is not None
    docs = {CONTROL.node: json.dumps(control_node()).encode()}
    for g in sorted(groups):
        doc = {"zarr_format": 3, "node_type": "group", "attributes": attrs if g == "" else {}}
        docs[f"{g}/zarr.json" if g else "zarr.json"] = json.dumps(doc).encode()
    return docs


def group_paths(meta: CheckpointMetadata) -> set[str]:
    """Every group of the hierarchy: the root (``""``) and each directory above an entry."""
    groups = {""}
    for names in (meta.tensors, meta.objects):
        for name in names:
            head = name.rpartition("/")[0]
            while head not in groups:  # every directory above the entry, up to one already known
                groups.add(head)
                head = head.rpartition("/")[0]
    # An object kept beside an array of the same name (a top-level numpy array ``w`` has the object ``w/~arrays``)
    # lies in no zarr node: ``w`` is the array, not a group.
    groups.difference_update(meta.tensors)
    return groups


def chunk_flat(leaf: str, shape: tuple[int, ...], chunk_shape: tuple[int, ...], separator: str) -> int | None:
    """The flat (row-major) index of the chunk key ``leaf`` (``c.1.0``) in the grid, None when ``leaf`` is
    no canonical chunk key inside it."""
    grid = [-(-s // max(c, 1)) for s, c in zip(shape, chunk_shape)]
    parts = leaf.split(separator)
    if parts[0] != "c" or len(parts) != len(grid) + 1:
        return None
    flat = 0
    for p, g in zip(parts[1:], grid):
        if not p.isascii() or not p.isdigit() or p != str(int(p)) or int(p) >= g:
            return None
        flat = flat * g + int(p)
    return flat


def array_above(key: str, arrays: Container[str]) -> str | None:
    """The array of ``arrays`` whose key ``key`` is (``model/w/c.0`` -> ``model/w``), else None."""
    at = key.find("/")
    while at >= 0:
        if key[:at] in arrays:
            return key[:at]
        at = key.find("/", at + 1)
    return None


class NamedKeys:
    """Which keys of a checkpoint's directory its metadata names: the control files (``.acp/...``, or an
    older format's in the root), every group's ``zarr.json``, and each array's ``zarr.json`` and the chunk keys
    of its grid. Anything else (a planted ``model/evil`` array or group, a file beside the arrays) is a stray:
    no part of the checkpoint, never listed or served by ``checkpoint_store``, a warning of ``verify``."""

    def __init__(self, meta: CheckpointMetadata) -> None:
        self._tensors = meta.tensors
        self._groups = group_paths(meta)
        self._sep = chunk_key_separator(meta.format_version)
        legacy = LEGACY_CONTROL
        self._legacy = {legacy.metadata, legacy.committed, legacy.metrics, legacy.load_metrics}

    def _array_of(self, path: str) -> str | None:
        return array_above(path, self._tensors)

    def key(self, key: str) -> bool:
        """Whether the file ``key`` (relative to the root) is one the metadata names."""
        if key.startswith(CONTROL_DIR + "/") or key in self._legacy:
            return True
        head, _, leaf = key.rpartition("/")
        if leaf == "zarr.json" and (head in self._groups or head in self._tensors):
            return True
        name = self._array_of(key)
        if name is None:
            return False
        t = self._tensors[name]
        return chunk_flat(key[len(name) + 1 :], tuple(t.shape), tuple(t.chunk_shape), self._sep) is not None

    def directory(self, path: str) -> bool:
        """Whether the directory ``path`` is one the metadata names (a group, an array, the control node's,
        or a directory of chunk keys ``c/<i>/...`` of an older format)."""
        if path in self._groups or path in self._tensors or path == CONTROL_DIR:
            return True
        if path.startswith(CONTROL_DIR + "/"):
            return True
        name = self._array_of(path + "/")
        if name is None or name == path or self._sep != "/":
            return False
        rel = path[len(name) + 1 :]
        return rel == "c" or rel.startswith("c/")
