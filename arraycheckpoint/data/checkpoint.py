"""How a :class:`~arraycheckpoint.data.ReshardableLoader` becomes checkpoint entries, and back.

Entries under namespace ``ns`` (usually ``dataloader``):

* ``<ns>`` (global object, rank 0's value): ``{"__acp_state__": "dataloader", "replicated": ..., "dp_size": D,
  "num_workers": W, "step": S}``;
* ``<ns>/~shards`` (per-rank object): the index of every sharded part, in one of two forms.

  - **Template** (format 4, :mod:`arraycheckpoint.format.rankdoc`): each rank's index in a rank-independent shape,
    ``{"dp_rank": d, "workers": {"<w>": {"meta": ..., "arrays": [name, ...], "rows": {name: stacked}}}}``
    (the per-DP-shard array names ``<ns>/shard_<d>_<w>/<name>`` derived, not listed), split into one template
    and rows of its numbers (``dp_rank``, the numbers in the loader's ``meta``: positions, epochs, seeds) as
    stacked arrays ``<ns>/~shards/~int`` and ``~float``. When every rank's template agrees (same workers,
    arrays, meta keys and strings) the commit carries no per-rank index and the metadata holds one template,
    whatever the number of ranks. A loader reads every rank's rows while planning (it names the shards it
    needs from every saved shard's meta).
  - **Per rank** (formats 1-3, and every rank's fallback when any template differs):
    ``{"dp_rank": d, "shards": {"<d>_<w>": {"meta": ..., "arrays": {name: entry}, "rows": {name: stacked}}}}``
    per rank, in the global metadata;
* the sharded parts' arrays (token buffers, positions): when every rank's arrays of worker ``w`` agree in shape
  and dtype, ONE stacked array ``<ns>/~rows/<w>/<array>`` of shape ``[world, *shape]`` whose row ``r`` is
  rank ``r``'s (:mod:`arraycheckpoint.format.perrank`; ranks sharing a DP rank each store their identical row);
  otherwise ``<ns>/shard_<d>_<w>/<array>`` per DP shard (ranks sharing a DP rank declare identical arrays,
  which the planner writes once). The index names both; the loader reads whichever is stored.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..adapters.base import Expected, LoadJob
from ..errors import ArrayCheckpointError, InconsistentCheckpointError
from ..format import perrank, rankdoc
from ..format.metadata import CheckpointMetadata, check_name
from ..planning.items import ArraySource, LoadShard, LoadTensor, SaveObject, SaveShard, SaveTensor
from ..planning.regions import Box
from .protocol import LoaderState, ReshardableLoader, SavedLoaderState, ShardKey, ShardState

MARKER = "dataloader"


def is_loader(value: Any) -> bool:
    """Whether ``value`` implements the dataloader checkpoint protocol."""
    return isinstance(value, ReshardableLoader) and not isinstance(value, type)


def is_saved_loader(meta: CheckpointMetadata, ns: str) -> bool:
    """Whether ``ns`` in ``meta`` holds a dataloader saved through this module."""
    obj = meta.objects.get(ns)
    return obj is not None and isinstance(obj.value, dict) and obj.value.get("__acp_state__") == MARKER


def save_items(
    ns: str, loader: ReshardableLoader, step: int | None, rank: int | None = None, world: int = 1
) -> tuple[list[SaveTensor], list[SaveObject]]:
    """This rank's entries for ``loader`` (collects its state: a queue poll when it was prepared).

    With ``rank`` given, each shard array is offered as row ``rank`` of a stacked array
    ``<ns>/~rows/<worker>/<array>`` of shape ``[world, *shape]`` (:mod:`arraycheckpoint.format.perrank`): saved so
    when every rank's arrays agree in shape and dtype, else as ``<ns>/shard_<d>_<w>/<array>``. The index
    names both; a loader reads whichever the checkpoint holds.
    """
    state: LoaderState = loader.checkpoint_state(step)
    tensors: list[SaveTensor] = []
    index: dict[str, Any] = {}  # the per-rank form
    workers: dict[str, Any] = {}  # the rank-independent form (the template's source)
    for (d, w), shard in sorted(state.shards.items()):
        if d != state.dp_rank:
            raise ArrayCheckpointError(
                f"dataloader {ns!r}: rank with dp_rank {state.dp_rank} returned a shard of dp rank {d}; "
                "each rank returns only its own DP rank's shards"
            )
        arrays, rows = {}, {}
        for name, arr in sorted(shard.arrays.items()):
            full = check_name(shard_array(ns, d, w, name))
            a = np.ascontiguousarray(arr)
            t = SaveTensor(full, tuple(a.shape), a.dtype, [SaveShard(Box.full(a.shape), ArraySource(a))])
            if rank is not None:
                t = perrank.stack(t, check_name(f"{ns}/{perrank.ROWS}/{w}/{name}"), rank, world)
                if t.fallback is not None:
                    rows[name] = t.name
            tensors.append(t)
            arrays[name] = full
        extra = {"rows": rows} if rows else {}
        index[f"{d}_{w}"] = {"meta": shard.meta, "arrays": arrays, **extra}
        workers[str(w)] = {"meta": shard.meta, "arrays": sorted(arrays), **extra}
    head = {
        "__acp_state__": MARKER,
        "replicated": state.replicated,
        "dp_size": state.dp_size,
        "num_workers": state.num_workers,
        "step": state.step if state.step is not None else step,
    }
    plain = SaveObject(f"{ns}/~shards", {"dp_rank": state.dp_rank, "shards": index}, scope="rank")
    compact = {"dp_rank": state.dp_rank, "workers": workers}
    # per rank without a world to stack rows in, or for meta that split would misread (rankdoc.ambiguous)
    if rank is None or rankdoc.ambiguous(compact):
        return tensors, [SaveObject(ns, head), plain]
    # one template and rows of numbers when every rank's index agrees, else ``plain`` (arraycheckpoint.format.rankdoc)
    template, *leaf_rows = rankdoc.templated(
        SaveObject(plain.name, compact, scope="rank"), {}, rank, world, fallback=plain
    )
    return [*tensors, *leaf_rows], [SaveObject(ns, head), template]


def shard_array(ns: str, dp_rank: int, worker: int, name: str) -> str:
    """The entry name of DP shard ``(dp_rank, worker)``'s array ``name`` when stored per DP shard."""
    return f"{ns}/shard_{dp_rank}_{worker}/{name}"


def saved_state(
    meta: CheckpointMetadata, ns: str, read: Callable[[list[LoadTensor]], Any] | None = None
) -> SavedLoaderState:
    """The saved layout of ``ns``: replicated part and every shard's JSON (arrays not yet read). ``read``
    (targets -> None, reading them at once) reads a template index's rows; without it such an index is refused."""
    return _saved(meta, ns, _documents(meta, ns, read)[0])[0]


@dataclass(frozen=True)
class _Stored:
    """Where one indexed shard array is: a stored name and region (``tm`` None: the checkpoint lacks it)."""

    name: str
    tm: Any = None
    box: Box | None = None
    row: bool = False  # a row [1, *shape] of a stacked array (its leading dimension is the saving rank)

    @property
    def shape(self) -> tuple[int, ...]:
        """The array's own shape (a stacked array's row without its leading rank dimension)."""
        assert self.box is not None
        return self.box.lengths[1:] if self.row else self.box.lengths


def _where(meta: CheckpointMetadata, name: str, entry: dict[str, Any], rank: int) -> _Stored:
    """Where shard array ``name`` (indexed by saved rank ``rank``) is stored: its own array, or that rank's
    row of the stacked array the index names (:mod:`arraycheckpoint.format.perrank`)."""
    full = entry["arrays"][name]
    tm = meta.tensors.get(full)
    if tm is not None:
        return _Stored(full, tm, Box.full(tm.shape))
    rows = entry.get("rows")
    stacked = rows.get(name) if isinstance(rows, dict) else None
    found = perrank.row(meta, stacked, rank) if isinstance(stacked, str) else None
    return _Stored(full) if found is None else _Stored(stacked, *found, row=True)


def _documents(
    meta: CheckpointMetadata, ns: str, read: Callable[[list[LoadTensor]], Any] | None
) -> tuple[dict[int, Any], dict[str, Expected]]:
    """Every saved rank's shard index (either form), and the expectations of the rows read for it."""
    idx = meta.objects.get(f"{ns}/~shards")
    if idx is None or idx.scope != "rank":
        raise ArrayCheckpointError(f"dataloader {ns!r}: the checkpoint has no shard index {ns}/~shards")
    if idx.rows is None:
        return rankdoc.documents(idx, {}, meta.world_size), {}
    if read is None:
        raise ArrayCheckpointError(f"dataloader {ns!r}: its shard index is a template; read its rows to plan")
    try:
        targets, rows, stored = rankdoc.read_rows(idx, meta)
    except ValueError as e:
        raise ArrayCheckpointError(f"dataloader {ns!r}: {e}") from None
    read(targets)
    expected = {n: Expected(tm.shape, tm.dtype) for n, tm in stored.items()}
    return rankdoc.documents(idx, rows, meta.world_size), expected


def _entries(ns: str, doc: dict[str, Any]) -> dict[ShardKey, dict[str, Any]]:
    """One saved rank's index entries by shard key, from either form (module docstring)."""
    if "workers" not in doc:
        return {_key(k.split("_", 1)): e for k, e in doc["shards"].items()}
    d = _count(doc["dp_rank"], "dp_rank")
    return {
        (d, _count(w, "worker")): {**e, "arrays": {a: shard_array(ns, d, int(w), a) for a in e["arrays"]}}
        for w, e in doc["workers"].items()
    }


def _count(v: Any, what: str, least: int = 0) -> int:
    """An index or count of the index, at least ``least``: an ``int`` (not a bool) or its canonical decimal
    text."""
    if isinstance(v, str) and v.isascii() and v.isdigit() and str(int(v)) == v:
        v = int(v)
    if not isinstance(v, int) or isinstance(v, bool) or not least <= v < 1 << 31:
        raise ValueError(f"{what} {v!r} is not a count")
    return v


def _key(parts: list[str]) -> ShardKey:
    if len(parts) != 2:
        raise ValueError(f"shard key {'_'.join(parts)!r} is not <dp rank>_<worker>")
    return _count(parts[0], "dp rank"), _count(parts[1], "worker")


def _saved(
    meta: CheckpointMetadata, ns: str, docs: dict[int, Any]
) -> tuple[SavedLoaderState, dict[ShardKey, dict[str, _Stored]]]:
    """The saved layout and where each shard's arrays are. The index is untrusted: anything in it of the
    wrong shape is an :class:`InconsistentCheckpointError` naming ``ns`` (not a bare ``KeyError``)."""
    try:
        return _saved_unchecked(meta, ns, docs)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        why = f"{e.args[0]!r} is missing" if isinstance(e, KeyError) and e.args else str(e)
        raise InconsistentCheckpointError(
            f"dataloader {ns!r}: its saved state ({ns}, {ns}/~shards) is damaged: {why}"
        ) from None


def _saved_unchecked(
    meta: CheckpointMetadata, ns: str, docs: dict[int, Any]
) -> tuple[SavedLoaderState, dict[ShardKey, dict[str, _Stored]]]:
    head = meta.objects[ns].value
    shards: dict[ShardKey, ShardState] = {}
    shapes: dict[ShardKey, dict[str, tuple[int, ...]]] = {}
    names: dict[ShardKey, dict[str, _Stored]] = {}
    for rank, doc in sorted(docs.items()):
        for key, entry in _entries(ns, doc).items():
            if key in shards:
                continue  # a TP/PP peer of the same DP rank saved the same shard
            shards[key] = ShardState(meta=_mapping(entry["meta"], f"shard {key}'s meta"), arrays={})
            names[key] = {a: _where(meta, a, entry, rank) for a in entry["arrays"]}
            shapes[key] = {a: x.shape for a, x in names[key].items() if x.tm is not None}
    saved = SavedLoaderState(
        _mapping(head["replicated"], "replicated"),
        _count(head["dp_size"], "dp_size", least=1),
        _count(head["num_workers"], "num_workers"),
        shards,
        shapes,
        head.get("step"),
    )
    return saved, names


def _mapping(v: Any, what: str) -> dict[str, Any]:
    if not isinstance(v, dict):
        raise TypeError(f"{what} is a {type(v).__name__}, not an object")
    return v


def load_job(
    ns: str,
    loader: ReshardableLoader,
    meta: CheckpointMetadata,
    read: Callable[[list[LoadTensor]], Any] | None = None,
) -> LoadJob:
    """Read only the arrays of the shards ``loader`` asks for, then let it rebuild its state. ``read`` (targets
    -> None, reading them at once) reads a template index's rows first (:func:`saved_state`)."""
    from ..codecs import numpy_dtype

    expected: dict[str, Expected] = {ns: Expected()}
    if ns not in meta.objects:
        return LoadJob([], expected, {ns}, lambda: loader)
    docs, index_rows = _documents(meta, ns, read)
    expected.update(index_rows)
    saved, names = _saved(meta, ns, docs)
    targets: list[LoadTensor] = []
    for key in loader.shards_to_load(saved):
        key = (int(key[0]), int(key[1]))
        if key not in saved.shards:
            raise ArrayCheckpointError(
                f"dataloader {ns!r}: the loader asked for shard {key}, which was not saved "
                f"(saved: {saved.ordered_keys()})"
            )
        for arr_name, x in names[key].items():
            if x.tm is None or x.box is None:
                raise ArrayCheckpointError(f"dataloader {ns!r}: array {x.name!r} is indexed but not stored")
            buf = np.empty(x.shape, dtype=numpy_dtype(x.tm.dtype))
            saved.shards[key].arrays[arr_name] = buf
            expected[x.name] = Expected(x.tm.shape, x.tm.dtype)
            if buf.size:
                targets.append(LoadTensor(x.name, [LoadShard(x.box, perrank.fill(buf))]))

    def finish() -> ReshardableLoader:
        loader.load_checkpoint_state(saved)
        return loader

    return LoadJob(targets, expected, {ns}, finish)
