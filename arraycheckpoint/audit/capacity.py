"""The capacity of a rank's packs, counted before a reader builds a key per chunk (format 6).

A 40-byte change of shape in the metadata can declare 2^26 chunks that no pack holds: before a reader lists
a rank's members one by one, :func:`check_capacity` and :func:`rank_capacity` check that its packs can hold
them (a local checkpoint: the packs' sizes; an object store: their directories' entries, above
:data:`REMOTE_CAPACITY_FREE` members, read ahead and kept for the walk that checks them next,
:class:`arraycheckpoint.audit.rankpacks.RankPacks`). Errors name the arrays concerned (:func:`_naming`).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Collection, Iterator, Mapping
from typing import Any, TypeVar

from ..checks.bounds import MAX_OBJECT_BYTES, MAX_PACKED_JSON_BYTES
from ..checks.zipdir import _CD_ENTRY_BYTES
from ..errors import InconsistentCheckpointError
from ..format.writers import rank_counts
from . import packdir  # packdir._pack_directory: looked up at call time (tests count its calls)
from .ahead import EndReads, Job
from .packcount import PackCounts
from .packdir import _chunk_grid, _longest_chunk_key, _packed_chunk_bytes
from .predict import predicted_fill as _predicted_fill


def _rank_members(meta: Any) -> dict[int, tuple[list[str], dict[str, int]]]:
    """Format 6: what each rank's packs hold: ``rank -> (arrays whose zarr.json it holds, array -> number of
    its chunks)`` over every packed array of ``meta``."""
    out: dict[int, tuple[list[str], dict[str, int]]] = {}
    for name, t in meta.tensors.items():
        creator = t.pack_rank
        if creator is None:
            continue
        out.setdefault(creator, ([], {}))[0].append(name)
        writers = t.writers
        if not writers:
            continue
        if len(writers) == 1:  # one chunk (every small array): no counting per rank
            out.setdefault(writers[0], ([], {}))[1][name] = 1
            continue
        for r, n in rank_counts(writers).items():
            out.setdefault(r, ([], {}))[1][name] = n
    return out


#: Packed members of a rank whose packs are not looked at before its members are listed one by one.
CAPACITY_FREE = 1 << 12


def rank_capacity_problem(root: str, rank: int, chunks: Mapping[str, int]) -> str | None:
    """Why ``rank``'s packs under the local checkpoint ``root`` cannot hold ``chunks`` (array -> number of
    its chunks that rank wrote), or None. Every member takes at least a ZIP local header and directory record
    and its name twice; the packs' sizes (``<rank>.0.zip``, ``<rank>.1.zip``, ... up to the first absent) must
    add up to that before a reader lists the members one by one: a 40-byte change of shape in the metadata
    declares 2^26 chunks (gigabytes of keys) that no pack holds. Only above :data:`CAPACITY_FREE` members."""
    import os

    from ..planning.packing import PACK_DIR, pack_key

    members = sum(chunks.values())
    if members <= CAPACITY_FREE:
        return None
    need = sum(k * (30 + 46 + 2 * (len(n.encode()) + 4)) for n, k in chunks.items())
    have = 0
    for k in range(members + 1):
        try:
            have += os.lstat(os.path.join(root, *pack_key(rank, k).split("/"))).st_size
        except OSError:  # absent (or unreadable: the pack checks name it)
            break
        if have >= need:
            return None
    return (
        f"rank {rank}'s packs ({root}/{PACK_DIR}/{rank}.<k>.zip) are {have} bytes in all, but the metadata "
        f"puts {members} chunks in them, which take at least {need}; the checkpoint is damaged or hostile"
    )


def _rank_bounds(
    meta: Any,
    docs: Collection[str],
    chunks: Mapping[str, int],
    per_layout: dict[Any, tuple[int, tuple[int, ...], int]] | None = None,
) -> tuple[dict[str, int], dict[str, tuple[int, ...]], int, int, int]:
    """For a rank holding the documents of ``docs`` and ``chunks`` (array -> its chunks there): each array's
    largest member, its grid, the most directory bytes of one of its packs, its members, the largest pack.
    ``per_layout`` caches (chunk file bytes, grid, longest chunk key) per distinct layout across calls."""
    from ..planning.packing import MEMBER_OVERHEAD, TRAILER_BYTES

    per_layout = {} if per_layout is None else per_layout
    limits: dict[str, int] = {}
    grids: dict[str, tuple[int, ...]] = {}
    entries_bound = bound = 0
    for n in docs:
        nb = len(n.encode())
        entries_bound += _CD_ENTRY_BYTES + nb + 10
        bound += MAX_PACKED_JSON_BYTES + MEMBER_OVERHEAD + 2 * (nb + 10)
    for n in set(docs) | set(chunks):
        t = meta.tensors[n]
        lay = (t.dtype, t.shape, t.chunk_shape, t.inner_chunk_shape)
        known = per_layout.get(lay)
        if known is None:
            grid = _chunk_grid(t)
            known = per_layout[lay] = (_packed_chunk_bytes(t), grid, _longest_chunk_key(grid))
        limits[n], grids[n] = known[0], known[1]
        k = chunks.get(n, 0)
        if k:
            nb = len(n.encode())
            entries_bound += k * (_CD_ENTRY_BYTES + nb + 1 + max(9, known[2]))
            bound += k * (known[0] + MEMBER_OVERHEAD + 2 * (nb + 1 + known[2]))
    members = len(docs) + sum(chunks.values())
    bound = min(TRAILER_BYTES * (members + 1) + bound, MAX_OBJECT_BYTES * 4)
    return limits, grids, entries_bound, members, bound


#: Packed members of a rank whose packs' directories an object-store reader counts before listing them.
REMOTE_CAPACITY_FREE = 1 << 16


def _remote_capacity_problem(
    storage: Any,
    base: str,
    meta: Any,
    rank: int,
    holds: Any,
    wanted: int,
    parsed: dict[Any, Any] | None = None,
    ahead: EndReads | None = None,
    written: int | None = None,
) -> str | None:
    """Object stores (no sizes without reads): the entries of ``rank``'s pack directories, counted (each read
    with its bounds) until they reach ``wanted``; why they do not, or None. Each directory read is kept in
    ``parsed`` for the walk that checks it next (:class:`~arraycheckpoint.audit.rankpacks.RankPacks`): read once, not once to count and once
    to check. ``ahead``: the directories read ahead (:func:`_count_ranks`); ``written``: the packs the rank's
    save wrote, when known, all counted (those read ahead are then all kept, none read for nothing)."""
    from ..planning.packing import pack_key

    docs, chunks = holds.get(rank, ([], {}))
    _limits, _grids, entries_bound, members, bound = _rank_bounds(meta, docs, chunks)
    found = 0
    for k in range(members + 1):
        entries, size = packdir._pack_directory(
            storage,
            base,
            pack_key(rank, k),
            bound,
            max_directory_bytes=entries_bound,
            missing_ok=True,
            parsed=parsed,
            ahead=ahead,
        )
        if size is None and not entries:
            break
        found += len(entries)
        if found >= wanted and (written is None or k + 1 >= written):
            return None
    if found >= wanted:
        return None
    return (
        f"rank {rank}'s packs ({base}/.acp/packs/{rank}.<k>.zip) hold {found} members in all, but the metadata "
        f"puts {wanted} chunks in them; the checkpoint is damaged or hostile"
    )


def _fill_target(meta: Any) -> int:
    """The fill target the metadata records for every rank's packs (0: none, or not one for all)."""
    from ..planning.packing import packs_target

    packs = {t.pack for t in meta.tensors.values() if t.pack_rank is not None}  # a few distinct entries
    targets = {packs_target(pack) for pack in packs}
    return targets.pop() if len(targets) == 1 else 0


def _count_ranks(
    storage: Any,
    base: str,
    meta: Any,
    holds: Any,
    per_rank: Mapping[int, Mapping[str, int]],
    parsed: dict[Any, Any] | None,
    counts: PackCounts | None = None,
) -> None:
    """:func:`rank_capacity` of each rank of ``per_rank`` (rank -> its chunks of arrays of several chunks).
    On object stores the directories the counts read (ranks above :data:`REMOTE_CAPACITY_FREE` members) are
    read ahead (:class:`~arraycheckpoint.audit.ahead.EndReads`), every pack each such rank's save wrote
    (from the metadata's fill target, else ``counts``' listing; neither: one after another, as before)."""
    from ..planning.packing import pack_key

    ahead: EndReads | None = None
    written: dict[int, int | None] = {}
    if getattr(storage, "commit_strategy", "") != "rename":
        jobs: list[Job] = []
        target = 0
        for rank, chunks in per_rank.items():
            if sum(chunks.values()) <= REMOTE_CAPACITY_FREE:
                continue
            target = target or _fill_target(meta)
            docs, held = holds.get(rank, ([], {}))
            n = _predicted_fill(meta, rank, {}, docs, held, target)[1]
            n = written[rank] = n if n is not None or counts is None else counts.written(rank)
            _l, _g, entries_bound, members, bound = _rank_bounds(meta, docs, held)
            want = min(bound + 1, packdir._PACK_TAIL_BYTES)
            keys = (pack_key(rank, k) for k in range(min(n or 0, members + 1)))
            jobs += [
                (key, want, entries_bound)
                for key in keys
                if (key, bound, entries_bound) not in (parsed or {})
            ]
        ahead = EndReads(storage, base, jobs) if jobs else None
    try:
        for rank, chunks in per_rank.items():
            rank_capacity(storage, base, meta, rank, chunks, holds, parsed, ahead, written.get(rank))
    finally:
        if ahead is not None:
            ahead.close()


#: inside :func:`counted_once`: the directories an object store's capacity counts read, kept for the checks
#: that read them next (each is then read once, whichever call counts and whichever checks)
_counted: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar("acp_counted", default=None)


@contextlib.contextmanager
def counted_once() -> Iterator[None]:
    """Inside, a pack directory an object store's capacity count read (:func:`check_capacity`) is checked by
    a later :func:`~arraycheckpoint.audit.rankpacks.check_rank_packs` (a load's) without being read again: ``verify`` counts before it builds
    a key per chunk, then reads the data through the load, which counted and read every big directory again
    (9 MB read twice for one rank of 70,000 chunks). What a check takes is dropped; the rest when it ends. A
    checkpoint recording no fill target has its packs listed once inside (:func:`pack_counts`)."""
    token = _counted.set({})
    listed = _listings.set({})
    try:
        yield
    finally:
        _listings.reset(listed)
        _counted.reset(token)


#: inside :func:`counted_once`: the listings of packs made (:class:`PackCounts`), by checkpoint
_listings: contextvars.ContextVar[dict[str, PackCounts] | None] = contextvars.ContextVar(
    "acp_listings", default=None
)


def pack_counts(storage: Any, base: str) -> PackCounts:
    """The :class:`~arraycheckpoint.audit.packcount.PackCounts` of the checkpoint ``base``: inside
    :func:`counted_once`, one for every reader of it (one listing of its packs in all, where one is made)."""
    shared = _listings.get()
    if shared is None:
        return PackCounts(storage, base)
    return shared.setdefault(base.rstrip("/"), PackCounts(storage, base))


def check_capacity(
    storage: Any,
    base: str,
    meta: Any,
    names: Collection[str],
    parsed: dict[Any, Any] | None = None,
    counts: PackCounts | None = None,
) -> Any:
    """:func:`rank_capacity` for every rank writing chunks of the arrays ``names`` (the chunks per rank
    counted from the writers at once, not listed; ``parsed``: see :func:`rank_capacity`, by default the
    directories kept by :func:`counted_once`; object stores: read ahead, :func:`_count_ranks`). Returns what
    every rank holds (:func:`_rank_members`)."""
    if parsed is None:
        parsed = _counted.get()
    holds = _rank_members(meta)
    per_rank: dict[int, dict[str, int]] = {}
    for name in names:
        writers = meta.tensors[name].writers
        if len(writers) <= 1:
            continue  # one chunk (every small array): listing it costs what counting would
        for r, n in rank_counts(writers).items():
            per_rank.setdefault(r, {})[name] = n
    _count_ranks(
        storage, base, meta, holds, per_rank, parsed, pack_counts(storage, base) if counts is None else counts
    )
    return holds


def rank_capacity(
    storage: Any,
    base: str,
    meta: Any,
    rank: int,
    chunks: Mapping[str, int],
    holds: Any,
    parsed: dict[Any, Any] | None = None,
    ahead: EndReads | None = None,
    written: int | None = None,
) -> None:
    """Before a key is built per chunk: ``rank``'s packs can hold ``chunks`` (array -> its chunks there, of
    arrays of more than one chunk): on a local file system their sizes (:func:`rank_capacity_problem`), on
    object stores the entries of their directories, counted above :data:`REMOTE_CAPACITY_FREE` members
    (:func:`_remote_capacity_problem`); ``holds`` is :func:`_rank_members`. ``parsed``: where the directories
    counted are kept for the walk that checks them (:class:`~arraycheckpoint.audit.rankpacks.RankPacks` ``parsed``), so that each is read once.

    Raises:
        InconsistentCheckpointError: naming the arrays of ``chunks``.
    """
    wanted = sum(chunks.values())
    if getattr(storage, "commit_strategy", "") == "rename":
        problem = rank_capacity_problem(base, rank, chunks)
    elif wanted > REMOTE_CAPACITY_FREE:
        problem = _remote_capacity_problem(storage, base, meta, rank, holds, wanted, parsed, ahead, written)
    else:
        problem = None
    if problem is not None:
        raise _naming(InconsistentCheckpointError, [f"{n}/c" for n in chunks], problem)


#: an error type :func:`_naming` builds
E = TypeVar("E", bound=Exception)


def _naming(kind: type[E], members: Collection[str], detail: str) -> E:
    """An error of ``kind`` about the arrays of the pack members ``members``: its message names them
    (:func:`_tensors_named`); its ``tensors`` attribute maps every one of them to what is wrong (``detail``),
    so a tool reports each array without checking them one by one (``arraycheckpoint verify``)."""
    err = kind(f"{_tensors_named(members)}: {detail}")
    err.tensors = dict.fromkeys(sorted({m.rpartition("/")[0] for m in members}), detail)  # type: ignore[attr-defined]
    return err


def _tensors_named(members: Collection[str]) -> str:
    """``tensor 'a'`` / ``tensors 'a', 'b', 'c' (and 4 more)``: the arrays of the pack members ``members``."""
    names = sorted({m.rpartition("/")[0] for m in members})
    more = f" (and {len(names) - 3} more)" if len(names) > 3 else ""
    return f"tensor{'s' if len(names) > 1 else ''} {', '.join(repr(n) for n in names[:3])}{more}"
