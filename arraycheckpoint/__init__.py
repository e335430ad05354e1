"""arraycheckpoint: sharded, reshardable training checkpoints stored as open Zarr v3 arrays.

Public API::

    import arraycheckpoint as acp
    acp.save(path, {"model": model, "optimizer": opt, "extra_state": {...}})
    fut = acp.save_async(path, state); fut.staged.result(); ...; fut.result()
    acp.load(path, state)

Importing this package imports neither torch nor jax; adapters load lazily.
"""

from __future__ import annotations

__version__ = "0.1.0"

from typing import Any  # noqa: E402

from .api import load, load_jax, read_metadata, save, save_async  # noqa: E402
from .errors import (  # noqa: E402
    ArrayCheckpointError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CorruptCheckpointError,
    InconsistentCheckpointError,
    InvalidArgumentError,
    InvalidStateError,
    MetadataError,
    MetaDeviceError,
    PickleNotAllowedError,
    PlanError,
    SaveFailedError,
    StalledRankError,
    StateMismatchError,
    StorageError,
    UnpicklingError,
    UnsafeNameError,
    UnsupportedDTypeError,
)
from .future import CheckpointFuture  # noqa: E402
from .manager import CheckpointManager  # noqa: E402
from .metadata import CheckpointMetadata, ShardMeta, TensorMeta  # noqa: E402
from .plan import PlanOptions  # noqa: E402
from .prepare import prepare  # noqa: E402
from .stateful import PerRank, list_roles  # noqa: E402


def __getattr__(name: str) -> Any:  # lazy submodules that need torch: ``acp.dcp.Writer``
    if name == "dcp":
        import importlib

        return importlib.import_module(".dcp", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "ArrayCheckpointError",
    "CheckpointExistsError",
    "CheckpointFuture",
    "CheckpointManager",
    "CheckpointMetadata",
    "CheckpointNotFoundError",
    "CorruptCheckpointError",
    "InconsistentCheckpointError",
    "InvalidArgumentError",
    "InvalidStateError",
    "MetaDeviceError",
    "MetadataError",
    "PerRank",
    "PickleNotAllowedError",
    "PlanError",
    "PlanOptions",
    "SaveFailedError",
    "StalledRankError",
    "ShardMeta",
    "StateMismatchError",
    "StorageError",
    "TensorMeta",
    "UnpicklingError",
    "UnsafeNameError",
    "UnsupportedDTypeError",
    "__version__",
    "list_roles",
    "load",
    "load_jax",
    "prepare",
    "read_metadata",
    "save",
    "save_async",
]
