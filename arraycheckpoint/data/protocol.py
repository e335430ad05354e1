"""The dataloader checkpoint protocol: a replicated part, sharded parts, and resharding on load.

A loader's state splits into

* a **replicated** part, identical on every rank (data source paths, sampling ratios, number of reader
  workers, sequence length): saved once, by rank 0, as the global object ``dataloader``;
* **sharded** parts, one per ``(dp_rank, worker)`` (token buffers of samples read but not yet consumed, read
  offsets per source): JSON in the per-rank index object ``dataloader/~shards`` and arrays stored as their own
  entries ``dataloader/shard_<dp>_<worker>/<array>``.

On load every rank sees the whole saved layout (:class:`SavedLoaderState`: the replicated part and every
shard's JSON); the loader names the shards whose arrays it needs (:meth:`ReshardableLoader.shards_to_load`),
only those arrays are read, and the loader rebuilds its own state from them
(:meth:`ReshardableLoader.load_checkpoint_state`). When the DP size (or worker count) changed, the loader
merges or splits the saved shards so that no sample is lost and none is seen twice;
:mod:`arraycheckpoint.data.reshard` has helpers for the usual cases.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import numpy as np

ShardKey = tuple[int, int]
"""``(dp_rank, worker)`` of one sharded part."""


@dataclass
class ShardState:
    """One sharded part: JSON-able ``meta`` (offsets, counters) and named 1-D or N-D ``arrays`` (buffers)."""

    meta: dict[str, Any] = field(default_factory=dict)
    arrays: dict[str, np.ndarray] = field(default_factory=dict)


@dataclass
class LoaderState:
    """What one rank's loader contributes to a checkpoint.

    ``shards`` holds only this rank's parts (keys ``(dp_rank, worker)`` with this rank's ``dp_rank``). Ranks
    that share a DP rank (tensor or pipeline parallel peers) must return identical shards; they are written once.
    """

    replicated: dict[str, Any]
    dp_rank: int
    dp_size: int
    num_workers: int
    shards: dict[ShardKey, ShardState]
    step: int | None = None


@dataclass
class SavedLoaderState:
    """The saved layout as one rank sees it on load.

    ``shards`` has every saved shard's ``meta``; its ``arrays`` are filled only for the keys the loader asked
    for in :meth:`ReshardableLoader.shards_to_load`. ``array_shapes`` gives every saved array's shape (so a
    loader can plan by sizes without reading bytes).
    """

    replicated: dict[str, Any]
    dp_size: int
    num_workers: int
    shards: dict[ShardKey, ShardState]
    array_shapes: dict[ShardKey, dict[str, tuple[int, ...]]]
    step: int | None = None

    def flat_index(self, key: ShardKey) -> int:
        """``dp_rank * num_workers + worker``: the shard's position in the saved global order."""
        return key[0] * self.num_workers + key[1]

    def ordered_keys(self) -> list[ShardKey]:
        """Every saved shard key in global order (DP rank major, then worker)."""
        return sorted(self.shards, key=self.flat_index)


@runtime_checkable
class ReshardableLoader(Protocol):
    """A dataloader whose position can be checkpointed and resumed under another DP size.

    Put the loader itself in the state: ``acp.save(path, {"model": m, "dataloader": loader})``; on load the
    same call shape restores it in place.
    """

    def checkpoint_state(self, step: int | None = None) -> LoaderState:
        """This rank's state after the batches consumed so far (``step``: the step being saved, if known)."""
        ...

    def shards_to_load(self, saved: SavedLoaderState) -> Iterable[ShardKey]:
        """The saved shards whose arrays this rank needs to rebuild its state (under its current layout)."""
        ...

    def load_checkpoint_state(self, saved: SavedLoaderState) -> None:
        """Rebuild this rank's state from ``saved`` (arrays present for the keys :meth:`shards_to_load` named).

        Across all ranks of the new layout, the union of the rebuilt states must cover every sample the saved
        shards had not yet consumed, exactly once.
        """
        ...


@runtime_checkable
class PrefetchingLoader(ReshardableLoader, Protocol):
    """A loader that can prepare its checkpoint state ahead of the save.

    After ``prepare_checkpoint(step)`` the loader captures its state at the boundary where ``step`` batches have
    been consumed (from its reader thread, off the training thread), so :meth:`checkpoint_state` at that step
    only polls a queue.
    """

    def prepare_checkpoint(self, step: int) -> None:
        """Capture the state at the moment ``step`` batches have been consumed."""
        ...
