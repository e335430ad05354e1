"""Per-rank arrays stored as one stacked array per slot, with a leading rank dimension.

A ``PerRank`` array (an RNG state, a counter tensor) exists once per rank. Stored as one array per rank
(``<ns>/~r<rank>/<i>/<path>``) that is N arrays, 2N+ files and N declarations at N ranks. When every rank's
array of a slot has the same shape and dtype (the common case) it is stored instead as ONE array
``<ns>/~rows/<i>/<path>`` of shape ``[N, *shape]`` where rank ``r`` holds row ``r``:

* on save each rank declares the stacked array with the mesh rule ``("mesh", Mesh((N,), 0..N-1), (0,))``:
  identical on every rank, so it adds O(1) declarations and the planner packs rows into bounded chunk files
  through the fragment exchange (:mod:`arraycheckpoint.planning.groupplan`);
* whether the ranks agree is decided by one digest of every stacked slot's (name, shape, dtype) folded into
  the save's fixed-size agreement (:meth:`arraycheckpoint.engine.coordinate.Coordinator.agree`); when any rank
  differs, every rank falls back to the per-rank arrays (:func:`fall_back`), so nothing hangs;
* ``.metadata.json`` marks the stacked array (``"rank_rows": true``: the leading dimension is the saving rank,
  of extent ``world_size``). Per-rank documents stored per rank (format 3, and the fallback of format 4) keep
  naming ``<ns>/~r<rank>/...``, and a loader resolves a name absent from the checkpoint to its row of the
  stacked array; a format-4 template (:mod:`arraycheckpoint.format.rankdoc`) names ``<ns>/~rows/...``, resolved to
  the saved rank's row, or to its own array ``<ns>/~r<rank>/...`` when the arrays fell back (:func:`resolve`).
  A reader that does not know the stacked form finds the per-rank name missing and refuses to load: it cannot
  silently misread it.

Pure: no I/O, no communication.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..planning.items import SaveShard, SaveTensor
from ..planning.regions import Box
from ..planning.rules import Mesh, digest


@dataclass
class PerRank:
    """A value that differs per rank (an RNG stream, a per-rank counter) inside saved state.

    ``{"extra_state": {"step": 10, "rng": acp.PerRank(rng.capture())}}``: every rank's value is saved; on load
    each rank's ``PerRank.value`` is replaced following the per-rank rule (module docstring). ``derive``
    (``(value, rank, source_rank) -> value``) overrides how a rank with no saved counterpart derives its value.
    """

    value: Any = None
    derive: Callable[[Any, int, int], Any] | None = None


ROWS = "~rows"


def per_rank_prefix(ns: str, rank: int) -> str:
    """The name prefix of rank ``rank``'s per-rank arrays under namespace ``ns``."""
    return f"{ns}/~r{rank}/"


def stacked_name(ns: str, rank: int, name: str) -> str | None:
    """The stacked array holding per-rank array ``name`` (saved by ``rank``), or None if not a per-rank name."""
    prefix = per_rank_prefix(ns, rank)
    return f"{ns}/{ROWS}/{name[len(prefix) :]}" if name.startswith(prefix) else None


@functools.lru_cache(maxsize=8)
def world_mesh(world: int) -> Mesh:
    """The 1-D mesh of every rank (one shared instance per world size: declarations compare it by identity)."""
    return Mesh((world,), tuple(range(world)))


@dataclass
class _RowSource:
    """A source of shape ``s`` seen as the one row ``[1, *s]`` of a stacked array."""

    inner: Any

    def copy_into(self, out: np.ndarray) -> Any:
        return self.inner.copy_into(out[0])  # a view of the one row, whatever the strides

    def stable_view(self) -> np.ndarray | None:
        return self._view("stable_view")

    def borrowed_view(self) -> np.ndarray | None:
        return self._view("borrowed_view")

    def _view(self, kind: str) -> np.ndarray | None:
        fn = getattr(self.inner, kind, None)
        view = fn() if fn is not None else None
        return None if view is None else view.reshape((1, *view.shape))


def stack_per_rank(t: SaveTensor, ns: str, rank: int, world: int) -> SaveTensor:
    """Rank ``rank``'s row of the stacked array for ``PerRank`` tensor ``t`` (``<ns>/~r<rank>/...``), or ``t``
    itself when it cannot be stacked (see :func:`stack`)."""
    name = stacked_name(ns, rank, t.name)
    return t if name is None else stack(t, name, rank, world)


def stack(t: SaveTensor, name: str, rank: int, world: int) -> SaveTensor:
    """Rank ``rank``'s row ``[1, *shape]`` of stacked array ``name`` (shape ``[world, *shape]``) holding ``t``,
    with ``t`` as its fallback; ``t`` itself when it is not a whole local array (a DTensor's shard) or empty."""
    whole = len(t.shards) == 1 and t.shards[0].box == Box.full(t.shape) and t.rule is None
    if not whole or not int(np.prod(t.shape)):
        return t
    row = Box((rank,) + (0,) * len(t.shape), (1, *t.shape))
    return SaveTensor(
        name,
        (world, *t.shape),
        t.dtype,
        [SaveShard(row, _RowSource(t.shards[0].source))],
        rule=("mesh", world_mesh(world), (0,)),
        fallback=t,
    )


def stack_digest(tensors: list[SaveTensor]) -> bytes:
    """16 bytes equal on ranks whose stacked slots agree (same names, shapes and dtypes, in order)."""
    return digest([[t.name, list(t.shape), np.dtype(t.dtype).str] for t in tensors if t.fallback is not None])


def fall_back(tensors: list[SaveTensor]) -> list[SaveTensor]:
    """The request's tensors with every stacked row replaced by its per-rank array (ranks disagreed)."""
    return [t.fallback if t.fallback is not None else t for t in tensors]


def row(meta: Any, stacked: str, source: int) -> tuple[Any, Box] | None:
    """``(TensorMeta, row box)`` of saved rank ``source``'s row in stacked array ``stacked``, or None when the
    checkpoint holds no such marked array (or no row for ``source``)."""
    tm = meta.tensors.get(stacked)
    if tm is None or not getattr(tm, "rank_rows", False) or not 0 <= source < tm.shape[0]:
        return None
    return tm, Box((source,) + (0,) * (len(tm.shape) - 1), (1, *tm.shape[1:]))


def row_of(meta: Any, ns: str, source: int, name: str) -> tuple[str, Any, Box] | None:
    """Where ``PerRank`` array ``name`` of saved rank ``source`` is when not stored by that name:
    ``(stacked name, TensorMeta, row box)``, else None."""
    stacked = stacked_name(ns, source, name)
    found = row(meta, stacked, source) if stacked is not None else None
    return None if found is None else (stacked, *found)


def resolve(meta: Any, ns: str, source: int, name: str) -> tuple[str, Any, Box | None] | None:
    """Where array reference ``name`` of saved rank ``source``'s per-rank document is stored: ``(stored
    name, TensorMeta, box)`` (box None: the whole array), or None when nowhere.

    A stored stacked array gives its row ``source``; another stored array itself; a per-rank name
    ``<ns>/~r<source>/x`` not stored its row of ``<ns>/~rows/x``; a stacked name ``<ns>/~rows/x`` not stored
    (a template whose arrays fell back) rank ``source``'s own array ``<ns>/~r<source>/x``.
    """
    tm = meta.tensors.get(name)
    if tm is not None:
        if not getattr(tm, "rank_rows", False):
            return name, tm, None
        found = row(meta, name, source)
        return None if found is None else (name, *found)
    found = row_of(meta, ns, source, name)
    if found is not None:
        return found
    rows = f"{ns}/{ROWS}/"
    own = per_rank_prefix(ns, source) + name[len(rows) :] if name.startswith(rows) else None
    tm = meta.tensors.get(own) if own is not None else None
    return None if tm is None else (own, tm, None)


def fill(buf: np.ndarray) -> Callable[[np.ndarray], None]:
    """A load sink copying what it receives into ``buf`` (a stacked array's row arrives as ``[1, *shape]``)."""

    def sink(arr: np.ndarray) -> None:
        buf[...] = arr.reshape(buf.shape)

    return sink
