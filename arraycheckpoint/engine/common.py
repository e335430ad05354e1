"""Helpers the save and load pipelines share: tensorstore specs, error translation, sidecar files, the host
layout from the launcher's environment."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import traceback
from typing import Any

import numpy as np

from ..codecs import array_metadata, numpy_dtype
from ..errors import CorruptCheckpointError, StorageError
from ..planning.plan import PlanOptions
from ..planning.regions import Box
from ..runtime.descriptors import descriptor_share
from ..storage import Storage

log = logging.getLogger("arraycheckpoint")

DEFAULT_INFLIGHT_BYTES = 1 << 30

#: Packs a save or a load keeps open at once (a descriptor each on a local file system), at most: a load
#: reading from the packs of thousands of saving ranks, a save filling thousands of small packs, would
#: otherwise hold more descriptors than a process may (1,024 by default on many systems). Fewer where the
#: process's limit asks for it (:func:`open_packs_allowed`); more than a load's reads cycle through would
#: have it open a pack again for every chunk (a resharded load reads each array from every saving rank).
MAX_OPEN_PACKS = 1024


def open_packs_allowed() -> int:
    """:data:`MAX_OPEN_PACKS`, or an eighth of the descriptors this process may open where that is fewer
    (at least 2): the rest stay for the storage library, the process group's sockets and the user's files."""
    return descriptor_share(MAX_OPEN_PACKS)


def write_sidecar(storage: Storage, root: str, key: str, doc: dict[str, Any]) -> None:
    """Best-effort JSON sidecar (metrics): never fails a save or a load."""
    try:
        storage.write(root, key, json.dumps(doc).encode())
    except Exception:  # noqa: BLE001 - metrics never fail a save or a load (read-only storage, ...)
        log.warning("could not write %s/%s", root, key, exc_info=True)


def array_spec(storage: Storage, root: str, layout: Any, separator: str = ".") -> dict[str, Any]:
    """The tensorstore zarr3 spec of ``layout``'s array under ``root``, its metadata given (never read).

    ``separator``: the chunk key separator of the checkpoint's format (``"."`` for what is written now).
    """
    return {
        "driver": "zarr3",
        "kvstore": storage.kvstore_spec(f"{root.rstrip('/')}/{layout.name}"),
        "metadata": array_metadata(
            layout.shape,
            numpy_dtype(layout.dtype),
            layout.chunk_shape,
            layout.inner_chunk_shape,
            layout.compression,
            name=layout.name,  # dimension_names (xarray needs them)
            separator=separator,
        ),
        # every chunk gets its file, also an all-zero one: a missing file on load then means damage
        "store_data_equal_to_fill_value": True,
    }


def array_kvstore_spec(storage: Storage, root: str, tensor: Any) -> dict[str, Any]:
    """The kvstore spec of a stored array (a :class:`~arraycheckpoint.format.metadata.TensorMeta`): its directory
    ``<root>/<name>/``, or, for a packed array (format 5), its keys inside the pack's ZIP file."""
    pack = getattr(tensor, "pack", None)
    if pack is None:
        return storage.kvstore_spec(f"{root.rstrip('/')}/{tensor.name}")
    return {"driver": "zip", "base": storage.object_kvstore_spec(root, pack), "path": f"{tensor.name}/"}


def wait_write(fut: Any, name: str) -> None:
    try:
        fut.result()
    except Exception as e:  # noqa: BLE001
        raise StorageError(f"tensor {name!r}: write failed: {e}") from e


# tensorstore reports checksum failures as DATA_LOSS "Digest mismatch"; truncation as decode errors.
_CORRUPTION_WORDS = (
    "data_loss",
    "digest",
    "checksum",
    "crc",
    "decod",
    "corrupt",
    "invalid",
    "truncat",
    "is missing",
)


def read_result(fut: Any, name: str, box: Box, root: str) -> np.ndarray:
    try:
        return fut.result()
    except Exception as e:  # noqa: BLE001
        msg = str(e)
        kind = CorruptCheckpointError if any(w in msg.lower() for w in _CORRUPTION_WORDS) else StorageError
        raise kind(f"tensor {name!r}: reading region {box} from {root} failed: {msg}") from e


def describe(e: BaseException, rank: int) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {tb[-1].filename.rsplit('/', 1)[-1]}:{tb[-1].lineno}" if tb else ""
    return f"rank {rank}: {type(e).__name__}: {e}{where}"


def local_ranks_per_host(rank: int, world: int) -> int:
    """Ranks per host from the launcher's environment (torchrun's ``LOCAL_WORLD_SIZE``), 0 when unknown or when
    this rank's ``LOCAL_RANK`` does not place hosts as contiguous blocks of that many ranks."""
    try:
        size = int(os.environ.get("LOCAL_WORLD_SIZE", "0"))
        local = int(os.environ.get("LOCAL_RANK", str(rank % size) if size > 0 else "-1"))
    except ValueError:
        return 0
    if size < 1 or world % size or local != rank % size:
        return 0
    return size


def plan_options(options: PlanOptions, ranks_per_host: int) -> PlanOptions:
    """``options`` with the agreed host map filled in (options that name their own host map keep it)."""
    if options.ranks_per_host or options.host_of or ranks_per_host < 1:
        return options
    return dataclasses.replace(options, ranks_per_host=ranks_per_host)
