"""arraycheckpoint: sharded, reshardable training checkpoints stored as open Zarr v3 arrays.

Public API::

    import arraycheckpoint as acp
    acp.save(path, {"model": model, "optimizer": opt, "extra_state": {...}})
    fut = acp.save_async(path, state); fut.staged.result(); ...; fut.result()
    acp.load(path, state)

Importing this package imports neither torch nor jax; adapters load lazily.

The top-level modules are the public API layer (``api``, ``manager``, ``stateful``, ``rng``, ``prepare``,
``roles``, ``_validate``, and the user-facing ``dcp`` and ``zarr``) and its errors (``errors``, the lowest
layer); everything below is a subpackage per layer: ``checks``, ``planning``, ``format``, ``runtime``,
``adapters``, ``storage``, ``audit``, ``sources``, ``engine``, ``interop`` (docs/architecture.md;
tests/test_layers.py keeps imports going down).
"""

from __future__ import annotations

from typing import Any

from .api import load, load_jax, read_metadata, save, save_async
from .errors import (
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
from .format.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from .format.perrank import PerRank
from .format.version import __version__
from .manager import CheckpointManager
from .planning.plan import PlanOptions
from .prepare import prepare
from .runtime.future import CheckpointFuture
from .stateful import list_roles


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
