"""Special state values: per-rank extra state, objects with ``state_dict``, dataloaders, and roles.

:func:`arraycheckpoint.save` / :func:`~arraycheckpoint.load` hand the namespaces this module recognises to it
(:func:`split`) instead of to the framework adapter, and merge the result with the adapter's:

* a namespace containing :class:`PerRank` values (anywhere inside nested dicts/lists), or objects with
  ``state_dict()`` / ``load_state_dict()`` (LR schedulers, ...), is stored as one global JSON document (rank 0's,
  ``<ns>``) in which each ``PerRank`` is a placeholder, plus one per-rank object ``<ns>/~per_rank`` holding every
  rank's own values: one template and rows of numeric leaves when the ranks' documents share one structure,
  else every rank's document (:mod:`arraycheckpoint.format.rankdoc`); arrays become tensors (``<ns>/...`` global; per
  rank, one stacked array ``<ns>/~rows/<i>/...`` with a leading rank dimension when every rank's array of slot
  ``i`` has the same shape and dtype, else ``<ns>/~r<rank>/<i>/...`` per rank: :mod:`arraycheckpoint.format.perrank`);
* a dataloader implementing :class:`~arraycheckpoint.data.ReshardableLoader` (see :mod:`arraycheckpoint.data`).

**Per-rank rule on load.** Global values load on every rank. Rank ``r`` of the loading world takes the value
saved by rank ``r`` when that rank existed; otherwise it takes saved rank ``r % saved_world`` 's value passed
through ``derive(value, r, source_rank)``: the target ``PerRank``'s own ``derive`` when given, else
:func:`default_derive` (RNG states captured by :func:`arraycheckpoint.rng.capture` are reseeded
deterministically from the source state and ``r``, so no two ranks share a stream; other values are copied).
Saved ranks beyond the new world are dropped.

**Roles** (:mod:`arraycheckpoint.roles`). ``role="actor"`` saves to and loads from ``<root>/actor``: a complete
committed checkpoint of its own, so roles are saved, loaded and resharded independently; :func:`list_roles` lists
a root's committed roles.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .adapters.base import AdapterOptions, Expected, LoadJob
from .errors import ArrayCheckpointError, InconsistentCheckpointError
from .format import extras, perrank, rankdoc
from .format.metadata import CheckpointMetadata
from .format.perrank import PerRank
from .planning.items import ArraySource, LoadShard, LoadTensor, SaveObject, SaveRequest, SaveShard, SaveTensor
from .planning.regions import Box
from .roles import list_roles, role_path  # noqa: F401 - re-exported (public names of this module)
from .runtime.collectives import Communicator

__all__ = ["PerRank", "default_derive", "list_roles", "role_path", "source_rank", "split"]

MARKER = "extra"
_PR = "__acp_per_rank__"
PER_RANK_SUFFIX = "~per_rank"


# ------------------------------------------------------------------------------------------- recognise
def _is_framework_object(v: Any) -> bool:
    """Modules, optimizers and megatron objects: the framework adapters' business, never ours."""
    if type(v).__module__.startswith(("megatron.", "torch.distributed.")):
        return True
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(v, (torch.nn.Module, torch.optim.Optimizer))


def is_stateful(v: Any) -> bool:
    """An object restored through ``load_state_dict`` (LR schedulers, custom trackers); not modules/optimizers."""
    return (
        not isinstance(v, type)
        and not _is_framework_object(v)
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
        and not _is_array(v)
    )


def _contains_special(v: Any) -> bool:
    if _is_array(
        v
    ):  # a leaf that is never special (checked first: a state of 100,000 tensors asks 100,000 times)
        return False
    if _is_framework_object(v):
        return False
    if isinstance(v, PerRank) or is_stateful(v):
        return True
    if isinstance(v, Mapping):
        return any(_contains_special(x) for x in v.values())
    if isinstance(v, (list, tuple)):
        return any(_contains_special(x) for x in v)
    return False


def _is_loader(v: Any) -> bool:
    from .data.checkpoint import is_loader

    return is_loader(v)


def split(
    state: Mapping[str, Any], meta: CheckpointMetadata | None = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(special, rest)``: namespaces this module handles, and those for the framework adapter.

    On load, ``meta`` also routes namespaces that were *saved* through this module (so a plain dict target
    receives per-rank values saved with :class:`PerRank`).
    """
    special: dict[str, Any] = {}
    rest: dict[str, Any] = {}
    for ns, value in state.items():
        saved_here = meta is not None and _saved_marker(meta, ns) is not None
        if _is_framework_object(value):
            rest[ns] = value
        elif _is_loader(value) or _contains_special(value) or saved_here:
            special[ns] = value
        else:
            rest[ns] = value
    return special, rest


def _saved_marker(meta: CheckpointMetadata, ns: str) -> str | None:
    obj = meta.objects.get(ns)
    if obj is None or obj.scope != "global" or not isinstance(obj.value, dict):
        return None
    kind = obj.value.get("__acp_state__")
    return kind if kind in (MARKER, "dataloader") else None


# ------------------------------------------------------------------------------------------------ save
def _is_array(v: Any) -> bool:
    if isinstance(v, np.ndarray):
        return True
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(v, torch.Tensor):
        return True
    jax = sys.modules.get("jax")
    return jax is not None and isinstance(v, jax.Array)


def _kind(v: Any) -> str:
    if isinstance(v, np.ndarray):
        return "numpy"
    torch = sys.modules.get("torch")
    return "torch" if torch is not None and isinstance(v, torch.Tensor) else "jax"


def _tensor(name: str, v: Any) -> SaveTensor:
    kind = _kind(v)
    if kind == "torch":  # a DTensor contributes its local box, as in the torch adapter
        from .adapters.torch.common import tensor_item

        return tensor_item(name, v.detach())
    a = np.array(v, copy=True) if kind == "jax" else v
    return SaveTensor(name, tuple(a.shape), a.dtype, [SaveShard(Box.full(tuple(a.shape)), ArraySource(a))])


def _plain(v: Any, per_rank: list[Any] | None, where: str) -> Any:
    """``v`` with stateful objects replaced by their state dicts and PerRank values by placeholders."""
    if isinstance(v, PerRank):
        if per_rank is None:
            raise ArrayCheckpointError(
                f"{where}: a PerRank value inside another PerRank; nest plain values only"
            )
        per_rank.append(_plain(v.value, None, where))
        return {_PR: len(per_rank) - 1}
    if is_stateful(v) and not _is_array(v):
        return _plain(v.state_dict(), per_rank, where)
    if isinstance(v, dict):
        return {k: _plain(x, per_rank, f"{where}/{k}") for k, x in v.items()}
    if isinstance(v, list):
        return [_plain(x, per_rank, f"{where}/{i}") for i, x in enumerate(v)]
    if isinstance(v, tuple) and not hasattr(v, "_fields"):
        return tuple(_plain(x, per_rank, f"{where}/{i}") for i, x in enumerate(v))
    return v


def save_items(
    ns: str, value: Any, comm: Communicator, options: AdapterOptions
) -> tuple[list[SaveTensor], list[SaveObject]]:
    """This rank's tensors and objects for one special namespace."""
    if _is_loader(value):
        from .data.checkpoint import save_items as loader_items

        return loader_items(ns, value, options.step, comm.rank, comm.world_size)
    per_rank: list[Any] = []
    plain = _plain(value, per_rank, ns)
    doc, arrays = extras.encode(plain, ns, _is_array, options.allow_pickle)
    tensors = [_tensor(name, a) for name, a in arrays.items()]
    objects = [
        SaveObject(
            ns, {"__acp_state__": MARKER, "doc": doc, "arrays": {n: _kind(a) for n, a in arrays.items()}}
        )
    ]
    if per_rank:
        docs, kinds, stacked = [], {}, {}
        for i, v in enumerate(per_rank):
            d, arrs = extras.encode(v, f"{ns}/~r{comm.rank}/{i}", _is_array, options.allow_pickle)
            docs.append(d)
            kinds.update({n: _kind(a) for n, a in arrs.items()})
            stacked.update({n: perrank.stacked_name(ns, comm.rank, n) or n for n in arrs})
            # one stacked array per slot when the ranks agree (the engine decides; see arraycheckpoint.format.perrank)
            tensors.extend(
                perrank.stack_per_rank(_tensor(name, a), ns, comm.rank, comm.world_size)
                for name, a in arrs.items()
            )
        plain = SaveObject(f"{ns}/{PER_RANK_SUFFIX}", {"values": docs, "arrays": kinds}, scope="rank")
        # one template and rows of numeric leaves when the ranks' documents agree (arraycheckpoint.format.rankdoc)
        template, *rows = rankdoc.templated(plain, stacked, comm.rank, comm.world_size)
        objects.append(template)
        tensors.extend(rows)
    return tensors, objects


#: Levels of ``.acp/metadata.json`` around an object's value (the document, ``objects``, its record, a
#: per-rank object's ranks and template): a value may nest this much less than the load's JSON limit.
METADATA_WRAPPING = 6


def check_json_depth(objects: Sequence[SaveObject]) -> None:
    """Refuse, before anything is written, an object whose value nests so deep that the metadata holding it
    would pass :data:`~arraycheckpoint.checks.bounds.MAX_JSON_DEPTH` (every load refuses such metadata as
    hostile: the save committed a checkpoint that could not load). Iterative, so no ``RecursionError``."""
    from .checks.bounds import MAX_JSON_DEPTH

    limit = MAX_JSON_DEPTH - METADATA_WRAPPING
    for obj in objects:
        deepest, stack = 0, [(obj.value, 0)]
        while stack and deepest <= limit:
            v, level = stack.pop()
            if isinstance(v, Mapping):
                stack.extend((x, level + 1) for x in v.values())
            elif isinstance(v, list | tuple):
                stack.extend((x, level + 1) for x in v)
            else:
                continue
            deepest = max(deepest, level + 1)
        if deepest > limit:
            raise ArrayCheckpointError(
                f"{obj.name}: its value nests more than {limit} levels of dicts and lists (as stored); a "
                "checkpoint's metadata may nest at most "
                f"{MAX_JSON_DEPTH} and every load refuses deeper metadata: flatten it, or store it as an array"
            )


def extend_request(
    request: SaveRequest,
    special: Mapping[str, Any],
    comm: Communicator,
    options: AdapterOptions,
    role: str | None = None,
) -> SaveRequest:
    """Add the special namespaces' items (and the role) to the adapter's ``request``."""
    for ns, value in special.items():
        tensors, objects = save_items(ns, value, comm, options)
        request.tensors.extend(tensors)
        request.objects.extend(objects)
    if role is not None:
        request.roles = (role,)
    check_json_depth(request.objects)
    return request


# ------------------------------------------------------------------------------------------------ load
def source_rank(rank: int, saved_ranks: Sequence[int]) -> int:
    """The saved rank whose per-rank value ``rank`` loads: itself if saved, else ``saved_ranks[rank % n]``
    (in order; a range stays a range)."""
    if not saved_ranks:
        raise ArrayCheckpointError(f"rank {rank}: the checkpoint holds no per-rank values")
    ordered = saved_ranks if isinstance(saved_ranks, range) else sorted(saved_ranks)
    return rank if rank in saved_ranks else ordered[rank % len(ordered)]


def default_derive(value: Any, rank: int, source: int) -> Any:
    """A value for ``rank`` from saved rank ``source``'s: RNG states are reseeded, other values copied."""
    from . import rng

    if rng.is_rng_state(value):
        return rng.derive(value, rank)
    return value


@dataclass
class _Loaded:
    value: Any
    source: int


def _as_kind(buf: np.ndarray, kind: str) -> Any:
    if kind == "torch":
        from .adapters.torch.tensors import as_torch

        return as_torch(buf).clone()
    if kind == "jax":
        import jax.numpy as jnp

        return jnp.asarray(buf)
    return buf


def _restore(placeholders: Any, per_rank: list[Any], source: int) -> Any:
    if isinstance(placeholders, dict):
        if len(placeholders) == 1 and _PR in placeholders and isinstance(placeholders[_PR], int):
            return _Loaded(per_rank[placeholders[_PR]], source)
        return {k: _restore(x, per_rank, source) for k, x in placeholders.items()}
    if isinstance(placeholders, list):
        return [_restore(x, per_rank, source) for x in placeholders]
    if isinstance(placeholders, tuple):
        return tuple(_restore(x, per_rank, source) for x in placeholders)
    return placeholders


def _apply(target: Any, loaded: Any, rank: int) -> Any:
    """Put ``loaded`` into ``target`` in place where possible; returns the value to store."""
    if isinstance(loaded, _Loaded):
        pr = target if isinstance(target, PerRank) else PerRank()
        value = loaded.value
        if loaded.source != rank:
            value = (pr.derive or default_derive)(value, rank, loaded.source)
        pr.value = _apply(pr.value, value, rank) if pr.value is not None else value
        return pr
    if isinstance(target, PerRank):  # saved as a global value: every rank takes it
        target.value = _apply(target.value, loaded, rank)
        return target
    if is_stateful(target) and not _is_array(target):
        if not isinstance(loaded, Mapping):  # a state dict is a dict; the object's own code would fail on it
            raise InconsistentCheckpointError(
                f"the saved state of {type(target).__name__} is a {type(loaded).__name__}, not a state dict"
            )
        target.load_state_dict(loaded)
        return target
    if isinstance(loaded, dict):
        if isinstance(target, dict):
            for k, v in loaded.items():
                target[k] = _apply(target.get(k), v, rank)
            return target
        return {k: _apply(None, v, rank) for k, v in loaded.items()}
    if isinstance(loaded, (list, tuple)) and not isinstance(target, (list, tuple)):
        return type(loaded)(_apply(None, v, rank) for v in loaded)  # no target: PerRank values still resolve
    return loaded


def load_job(
    ns: str,
    value: Any,
    meta: CheckpointMetadata,
    comm: Callable[[], Communicator],
    options: AdapterOptions,
    result: dict[str, Any],
    read: Callable[[list[LoadTensor]], Any] | None = None,
) -> LoadJob:
    """Plan reading special namespace ``ns`` into ``value``; ``finish`` stores the outcome in ``result[ns]``.

    ``read`` reads targets at once: a dataloader whose shard index is a template reads its rows while planning
    (it names the shards it needs from every saved shard's state)."""
    if _is_loader(value):
        from .data.checkpoint import load_job as loader_job

        job = loader_job(ns, value, meta, read)
        inner = job.finish

        def finish_loader() -> None:
            result[ns] = inner()

        job.finish = finish_loader
        return job
    expected: dict[str, Expected] = {ns: Expected()}
    obj = meta.objects.get(ns)
    if obj is None:
        return LoadJob([], expected, {ns}, lambda: None)
    with _damaged(ns):
        return _plan_load(ns, value, obj.value, meta, comm, options, result, expected)


@contextlib.contextmanager
def _damaged(ns: str) -> Iterator[None]:
    """Anything of the wrong shape in ``ns``'s stored documents (they are untrusted) is an
    :class:`InconsistentCheckpointError` naming ``ns``, not a bare ``KeyError`` or ``IndexError``."""
    try:
        yield
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        why = f"{e.args[0]!r} is missing" if isinstance(e, KeyError) and e.args else str(e)
        raise InconsistentCheckpointError(f"{ns}: its saved state is damaged: {why}") from None
    except InconsistentCheckpointError as e:
        raise InconsistentCheckpointError(f"{ns}: {e}") from None


def _plan_load(
    ns: str,
    value: Any,
    head: Any,
    meta: CheckpointMetadata,
    comm: Callable[[], Communicator],
    options: AdapterOptions,
    result: dict[str, Any],
    expected: dict[str, Expected],
) -> LoadJob:
    """:func:`load_job` of a namespace of plain values, PerRank values and state_dict objects."""
    if _saved_marker(meta, ns) == MARKER:
        doc, kinds = head["doc"], dict(head.get("arrays", {}))
    else:  # saved by the framework adapter as plain extra state (numpy arrays listed in <ns>/~arrays)
        types = meta.objects.get(f"{ns}/~arrays")
        doc, kinds = head, dict(types.value) if types is not None and isinstance(types.value, dict) else {}
    from .codecs import numpy_dtype

    docs: list[Any] = []
    src = -1
    rank = 0
    bufs: dict[str, np.ndarray] = {}
    leaves: dict[
        str, np.ndarray
    ] = {}  # this rank's numeric leaves of a template (arraycheckpoint.format.rankdoc)
    targets: list[LoadTensor] = []
    pr = meta.objects.get(f"{ns}/{PER_RANK_SUFFIX}")
    if pr is not None:
        expected[pr.name] = Expected()
        rank = comm().rank
        src = source_rank(rank, rankdoc.saved_ranks(pr, meta.world_size))
        saved = pr.template if pr.rows is not None else pr.per_rank[src]
        docs = saved["values"]
        kinds.update(saved.get("arrays", {}))
        try:
            reads, leaves, stored = rankdoc.read_rows(pr, meta, src)
        except ValueError as e:
            raise ArrayCheckpointError(f"{ns}: {e} (rank {rank})") from None
        targets.extend(reads)
        expected.update({n: Expected(tm.shape, tm.dtype) for n, tm in stored.items()})
    for ref in extras.array_refs(doc, where=ns) + extras.array_refs(docs, where=ns):
        # a per-rank array may be a row of a stacked array, or stored per rank (arraycheckpoint.format.perrank)
        found = perrank.resolve(meta, ns, src, ref)
        if found is None:
            raise ArrayCheckpointError(f"{ns}: array {ref!r} is referenced but not stored (rank {rank})")
        stored, tm, box = found
        buf = np.empty(box.lengths[1:] if box else tm.shape, dtype=numpy_dtype(tm.dtype))
        bufs[ref] = buf
        expected[stored] = Expected(tm.shape, tm.dtype)
        if buf.size:
            box = box or Box.full(tm.shape)
            targets.append(LoadTensor(stored, [LoadShard(box, perrank.fill(buf))]))

    def finish() -> None:
        default = "torch" if "torch" in sys.modules else "numpy"
        arrays = {n: _as_kind(b, kinds.get(n, default)) for n, b in bufs.items()}
        values = rankdoc.join(docs, leaves.get("int", ()), leaves.get("float", ())) if leaves else docs
        with _damaged(ns):
            per_rank = [extras.decode(d, arrays, options.allow_pickle, where=ns) for d in values]
            loaded = _restore(extras.decode(doc, arrays, options.allow_pickle, where=ns), per_rank, src)
        try:
            result[ns] = _apply(value, loaded, rank)
        except InconsistentCheckpointError as e:
            raise InconsistentCheckpointError(f"{ns}: {e}") from None

    return LoadJob(targets, expected, {ns}, finish)


def merge_load(
    job: LoadJob,
    special: Mapping[str, Any],
    meta: CheckpointMetadata,
    comm: Callable[[], Communicator],
    options: AdapterOptions,
    read: Callable[[list[LoadTensor]], Any] | None = None,
) -> LoadJob:
    """The adapter's ``job`` plus the special namespaces' reads; ``finish`` returns the combined state.
    ``read`` reads targets at once (see :func:`load_job`)."""
    if not special:
        return job
    extra: dict[str, Any] = {}
    jobs = [load_job(ns, v, meta, comm, options, extra, read) for ns, v in special.items()]
    for j in jobs:
        job.targets.extend(j.targets)
        job.expected.update(j.expected)
        job.namespaces |= j.namespaces
        job.optional |= j.optional
    inner = job.finish

    def finish() -> dict[str, Any]:
        out = inner()
        out = dict(out) if isinstance(out, Mapping) else {}
        for j in jobs:
            j.finish()
        out.update(extra)
        return out

    job.finish = finish  # the same job object: check_expected's ``dropped`` reaches the adapter's finishers
    return job
