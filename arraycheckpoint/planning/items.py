"""What adapters hand the engine: framework-free descriptions of local data and load targets.

Adapters translate framework objects (modules, DTensors, FSDP flat shards, megatron ShardedTensors, jax.Arrays)
into these; the engine never imports a framework. A :class:`SaveShard` is one region of a global tensor that
this rank holds, with a :class:`HostSource` that copies it into a host buffer; a :class:`LoadShard` is one
region this rank wants, with a sink that receives the host array.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .regions import Box


class HostSource(Protocol):
    """Local data of one region. ``copy_into`` fills ``out`` (shape = region lengths, the tensor's dtype).

    A source may also offer ``stable_view() -> np.ndarray | None``: a host array that will not change until
    the save completes (immutable jax arrays on CPU), and ``borrowed_view() -> np.ndarray | None``: a host
    array valid while the caller waits for the commit (a blocking ``save()``). The engine then writes from
    it without a staging copy. ``region(shape, index) -> HostSource | None`` (optional): a source of the part
    ``index`` of the region seen with ``shape`` (the region's lengths), so a snapshot copies only the chunks
    this rank writes; without it (or when it returns None) the whole region is copied.
    """

    def copy_into(self, out: np.ndarray) -> Any:
        """Fill ``out``. Returns None when the bytes are in ``out``, or a fence whose ``wait()`` returns once
        they are (an asynchronous device copy); the engine waits on every fence before ``staged``."""
        ...


@dataclass
class ArraySource:
    """A :class:`HostSource` over anything numpy can view (numpy arrays, host jax shards)."""

    array: Any

    def copy_into(self, out: np.ndarray) -> None:
        np.copyto(out, np.asarray(self.array).reshape(out.shape), casting="no")

    def region(self, shape: tuple[int, ...], index: tuple[slice, ...]) -> ArraySource | None:
        """The part ``index`` of a numpy region seen with ``shape`` (other arrays: None, copied whole)."""
        a = self.array
        if type(a) is not np.ndarray or (a.shape != tuple(shape) and not a.flags.c_contiguous):
            return None
        return ArraySource(a.reshape(shape)[index])


@dataclass
class SaveShard:
    box: Box
    source: HostSource


@dataclass
class SaveTensor:
    """One global tensor and the regions of it this rank holds (replicas may appear on several ranks)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype
    shards: list[SaveShard] = field(default_factory=list)
    # optional layout rule valid on every rank that holds the tensor this way, e.g. a DTensor's
    # ``("mesh", rules.Mesh, placements)`` or an FSDP1 flat range's ``("range", rules.Mesh, offset, total)``;
    # the engine checks it against ``shards`` and falls back to boxes
    rule: tuple[Any, ...] | None = None
    # set on one row of a stacked per-rank array (:mod:`arraycheckpoint.format.perrank`): the per-rank tensor every
    # rank saves instead when the ranks' rows disagree in shape or dtype
    fallback: SaveTensor | None = None


@dataclass
class SaveObject:
    """A JSON-able value. ``scope="global"``: rank 0's value is stored; ``"rank"``: every rank's value is."""

    name: str
    value: Any
    scope: str = "global"
    # a per-rank object in template form (:mod:`arraycheckpoint.format.rankdoc`): ``value`` is the rank-independent
    # template (stored once, from the coordinator), ``rows`` names the stacked arrays of this rank's numeric
    # leaves by kind, ``fallback`` is the plain per-rank object every rank saves instead when templates differ
    rows: dict[str, str] | None = None
    fallback: SaveObject | None = None


@dataclass
class SaveRequest:
    """Everything one rank contributes to a save."""

    tensors: list[SaveTensor]
    objects: list[SaveObject]
    framework: str
    step: int | None = None
    topology: dict[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()


@dataclass
class LoadShard:
    """A region to read. With ``target`` (a writable host view of the destination, in the stored dtype) the
    engine reads straight into it; with ``staging`` (``(shape, dtype) -> host buffer``, e.g. pinned memory for a
    device destination) it reads into the buffer it returns and hands that to ``sink``; otherwise, or when
    dtypes differ, it reads an array and calls ``sink``."""

    box: Box
    sink: Callable[[np.ndarray], None]
    target: np.ndarray | None = None
    staging: Callable[[tuple[int, ...], np.dtype], np.ndarray] | None = None


@dataclass
class LoadTensor:
    """One stored tensor this rank reads, as regions delivered to sinks."""

    name: str
    shards: list[LoadShard] = field(default_factory=list)
