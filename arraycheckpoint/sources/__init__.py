"""Load sources: checkpoints in other formats that :func:`arraycheckpoint.load` reads like its own.

A :class:`LoadSource` describes a foreign checkpoint as :class:`~arraycheckpoint.format.metadata.CheckpointMetadata`
(every tensor with its global shape and dtype, under our entry names) and reads the regions a load wants,
as byte ranges of the stored files. Adapters, strict checks, ``key_map``, ``allow_cast`` and the report then
work unchanged: the engine hands the read to the source instead of opening Zarr arrays.

Sources, detected from the files at the path when it holds no committed arraycheckpoint checkpoint:

* :class:`~arraycheckpoint.sources.safetensors.SafetensorsSource`: a Hugging Face model directory
  (``model.safetensors``, or ``model.safetensors.index.json`` and its shards);
* :class:`~arraycheckpoint.sources.dcp.DcpSource`: a torch.distributed.checkpoint directory (``.metadata``),
  only with ``allow_pickle=True`` (its metadata is a pickle).

Sources only read: they never write and never communicate. The safetensors source imports no framework; the
DCP source needs torch to unpickle DCP's metadata classes.

Layer ``sources``: above ``audit``, below ``engine`` (the engine hands a foreign checkpoint's reads to its
source). May import every layer below it; one lazy exception (the DCP helpers still in
:mod:`arraycheckpoint.dcp`) is listed in tests/test_layers.py.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..format.metadata import CheckpointMetadata
    from ..planning.items import LoadTensor
    from ..runtime.monitoring import PhaseRecorder
    from ..storage import Storage

__all__ = ["LoadSource", "local_dir", "open_source"]


class LoadSource(ABC):
    """A foreign checkpoint the engine reads regions from (see the module docstring).

    Call order: :func:`open_source` builds it (reading the format's index/headers), the engine takes
    :attr:`metadata`, then calls :meth:`read` once per load with the regions this rank wants.
    """

    #: short name of the format, e.g. ``"safetensors"``
    kind: str = ""

    def __init__(self, storage: Storage, root: str) -> None:
        self.storage = storage
        self.root = root

    @property
    @abstractmethod
    def metadata(self) -> CheckpointMetadata:
        """The checkpoint as arraycheckpoint metadata: entry names, global shapes, dtypes."""

    @abstractmethod
    def read(self, targets: list[LoadTensor], max_inflight_bytes: int, recorder: PhaseRecorder) -> None:
        """Read every region of ``targets`` and hand it to its sink (or target), in the calling thread.

        Records a ``read`` phase whose ``bytes`` are the bytes fetched from storage and ``wanted_bytes`` the
        bytes of the regions themselves.
        """


def local_dir(storage: Storage, root: str) -> str | None:
    """The directory of ``root`` when ``storage`` is a local file system (its files are then opened with
    the checks of :mod:`arraycheckpoint.checks.files`: no link, no FIFO, sizes known), else None."""
    spec = storage.kvstore_spec(root)
    return str(spec["path"]) if spec.get("driver") == "file" else None


def _has(storage: Storage, root: str, key: str) -> bool:
    """Whether ``root/key`` exists, without reading it: locally an ``lstat`` (a link or a FIFO exists, and
    the source's checks then refuse it, naming it), elsewhere the storage's own test."""
    import os

    local = local_dir(storage, root)
    if local is None:
        return storage.exists(root, key)
    return os.path.lexists(os.path.join(local, key))


def foreign_kind(storage: Storage, root: str) -> str | None:
    """``"safetensors"`` or ``"dcp"`` when ``root`` holds that format's index file (nothing is read), else None."""
    from .dcp import DCP_METADATA
    from .safetensors import INDEX_FILE, SINGLE_FILE

    if _has(storage, root, INDEX_FILE) or _has(storage, root, SINGLE_FILE):
        return "safetensors"
    return "dcp" if _has(storage, root, DCP_METADATA) else None


def open_source(storage: Storage, root: str, *, allow_pickle: bool = False) -> LoadSource | None:
    """The foreign checkpoint at ``root`` (a directory of ``storage``), or None when there is none.

    Raises:
        PickleNotAllowedError: ``root`` is a DCP checkpoint and ``allow_pickle`` is False.
        MetadataError: the format's index or headers are malformed.
    """
    kind = foreign_kind(storage, root)
    if kind == "safetensors":
        from .safetensors import SafetensorsSource

        return SafetensorsSource.open(storage, root)
    if kind == "dcp":
        from .dcp import DcpSource

        return DcpSource.open(storage, root, allow_pickle=allow_pickle)
    return None
