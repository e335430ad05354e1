"""Format 6 packs: every chunk of a packed array lies in its writer's packs, found by key.

:func:`check_rank_packs` reads each rank's pack directories once (not once per array), checks every member
of the arrays read against the metadata, and names the arrays concerned when one is wrong; the number and
sizes of a rank's packs must be those its save could have produced.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import itertools
import math
from collections.abc import Callable, Collection, Iterator, Mapping
from typing import Any, TypeVar

import numpy as np

from ..checks.bounds import MAX_OBJECT_BYTES, MAX_PACKED_JSON_BYTES
from ..checks.zipdir import _CD_ENTRY_BYTES, PackMember, _check_member
from ..errors import (
    CorruptCheckpointError,
    InconsistentCheckpointError,
)
from ..format.writers import rank_counts
from . import packdir  # packdir._pack_directory: looked up at call time (tests count its calls)
from .ahead import EndReads
from .packdir import _chunk_grid, _longest_chunk_key, _packed_chunk_bytes
from .packs import chunk_place, chunks_wanted
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
) -> str | None:
    """Object stores (no sizes without reads): the entries of ``rank``'s pack directories, counted (each read
    with its bounds) until they reach ``wanted``; why they do not, or None. Each directory read is kept in
    ``parsed`` for the walk that checks it next (:class:`RankPacks`): read once, not once to count and once
    to check."""
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
        )
        if size is None and not entries:
            break
        found += len(entries)
        if found >= wanted:
            return None
    return (
        f"rank {rank}'s packs ({base}/.acp/packs/{rank}.<k>.zip) hold {found} members in all, but the metadata "
        f"puts {wanted} chunks in them; the checkpoint is damaged or hostile"
    )


#: inside :func:`counted_once`: the directories an object store's capacity counts read, kept for the checks
#: that read them next (each is then read once, whichever call counts and whichever checks)
_counted: contextvars.ContextVar[dict[Any, Any] | None] = contextvars.ContextVar("acp_counted", default=None)


@contextlib.contextmanager
def counted_once() -> Iterator[None]:
    """Inside, a pack directory an object store's capacity count read (:func:`check_capacity`) is checked by
    a later :func:`check_rank_packs` (a load's) without being read again: ``verify`` counts before it builds
    a key per chunk, then reads the data through the load, which counted and read every big directory again
    (9 MB read twice for one rank of 70,000 chunks). What a check takes is dropped; the rest when it ends."""
    token = _counted.set({})
    try:
        yield
    finally:
        _counted.reset(token)


def check_capacity(
    storage: Any, base: str, meta: Any, names: Collection[str], parsed: dict[Any, Any] | None = None
) -> Any:
    """:func:`rank_capacity` for every rank writing chunks of the arrays ``names`` (the chunks per rank
    counted from the writers at once, not listed; ``parsed``: see :func:`rank_capacity`, by default the
    directories kept by :func:`counted_once`). Returns what every rank holds (:func:`_rank_members`)."""
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
    for rank, chunks in per_rank.items():
        rank_capacity(storage, base, meta, rank, chunks, holds, parsed)
    return holds


def rank_capacity(
    storage: Any,
    base: str,
    meta: Any,
    rank: int,
    chunks: Mapping[str, int],
    holds: Any,
    parsed: dict[Any, Any] | None = None,
) -> None:
    """Before a key is built per chunk: ``rank``'s packs can hold ``chunks`` (array -> its chunks there, of
    arrays of more than one chunk): on a local file system their sizes (:func:`rank_capacity_problem`), on
    object stores the entries of their directories, counted above :data:`REMOTE_CAPACITY_FREE` members
    (:func:`_remote_capacity_problem`); ``holds`` is :func:`_rank_members`. ``parsed``: where the directories
    counted are kept for the walk that checks them (:class:`RankPacks` ``parsed``), so that each is read once.

    Raises:
        InconsistentCheckpointError: naming the arrays of ``chunks``.
    """
    wanted = sum(chunks.values())
    if getattr(storage, "commit_strategy", "") == "rename":
        problem = rank_capacity_problem(base, rank, chunks)
    elif wanted > REMOTE_CAPACITY_FREE:
        problem = _remote_capacity_problem(storage, base, meta, rank, holds, wanted, parsed)
    else:
        problem = None
    if problem is not None:
        raise _naming(InconsistentCheckpointError, [f"{n}/c" for n in chunks], problem)


def check_rank_packs(
    storage: Any,
    root: str,
    meta: Any,
    names: Collection[str],
    regions: Mapping[str, list[Any] | None] | None = None,
    directories: dict[str, list[Any]] | None = None,
    deferred: dict[str, dict[str, int]] | None = None,
) -> dict[str, int | None]:
    """The packs holding what is read of the format-6 packed arrays ``names`` are sound
    (:mod:`arraycheckpoint.planning.packing`: chunk ``i`` of an array is in a pack of ``writers[i]``, its
    ``zarr.json`` in a pack of its creator).

    For every rank whose packs hold a member read (the chunks meeting ``regions[name]``, every chunk when
    absent, and the ``zarr.json``), the packs ``<rank>.<k>.zip`` holding them are read (:class:`RankPacks`),
    each with the checks of :func:`check_packs`: a regular file (no link, no FIFO), no
    larger than what that rank's packed members can take, a ZIP archive as a save writes it, every entry a
    member that rank holds (an array's ``zarr.json`` it created, a chunk key inside the grid of an array whose
    chunk it wrote; none twice across its packs), stored uncompressed, bounded, and, for each member read,
    a local header that agrees with the central directory. Every member read must be present.

    ``directories``, when given, receives each checked pack's directory. With ``deferred``, the local headers
    of the members read are not read here: ``deferred[pack key]`` receives ``member -> where the next member
    (or the directory) starts`` for each of them, and the reader checks each local header on the bytes it
    reads with the member (:func:`arraycheckpoint.checks.zipdir.check_local_header`, before it uses them):
    every member is read once.

    Returns:
        ``pack key -> size`` of the packs checked.

    Raises:
        InconsistentCheckpointError: a member read is in no pack of its rank.
        CorruptCheckpointError: what :func:`check_packs` refuses, for the packs of a format-6 checkpoint.
    """
    from ..format.metadata import chunk_key_separator

    if not names:
        return {}
    separator = chunk_key_separator(meta.format_version)
    base = root.rstrip("/")
    # the directories counted, checked by the walk below without a second read (and any counted before,
    # inside counted_once)
    parsed = _counted.get()
    if parsed is None:
        parsed = {}
    holds = check_capacity(storage, base, meta, names, parsed)  # before a key is built per chunk
    needed: dict[int, dict[str, tuple[str, int]]] = {}  # rank -> member read -> (array, chunk or -1)
    first_keys: dict[int, str] = {}  # ndim -> the key of chunk 0 under an array
    for name in names:
        t = meta.tensors[name]
        needed.setdefault(t.pack_rank, {})[f"{name}/zarr.json"] = (name, -1)
        writers = t.writers
        boxes = None if regions is None else regions.get(name)
        if len(writers) == 1:  # one chunk (every small array): read unless every region read is empty
            if boxes is None or any(math.prod(b.lengths) for b in boxes):
                ndim = len(t.shape)
                first = first_keys.get(ndim)
                if first is None:
                    first = first_keys[ndim] = separator.join(["c", *("0" * ndim)])
                needed.setdefault(writers[0], {})[f"{name}/{first}"] = (name, 0)
            continue
        grid = _chunk_grid(t)
        for flat in chunks_wanted(t, boxes).tolist():
            idx = np.unravel_index(flat, grid) if grid else ()
            key = f"{name}/" + separator.join(["c", *(str(int(i)) for i in idx)])
            needed.setdefault(writers[flat], {})[key] = (name, flat)
    out: dict[str, int | None] = {}
    walk = RankPacks(storage, base, meta, holds, parsed)
    if getattr(storage, "commit_strategy", "") != "rename":  # object stores: the packs' ends read ahead
        walk.ahead = EndReads(storage, base, [j for r in sorted(needed) for j in walk.ends(r, needed[r])])
    try:
        for rank in sorted(needed):
            out.update(walk.check(rank, needed[rank], directories, deferred))
    finally:
        if walk.ahead is not None:
            walk.ahead.close()
    return out


class RankPacks:
    """The one enumeration of a rank's packs, shared by every reader of a format-6 checkpoint (the load,
    ``verify`` and the tools through :func:`check_rank_packs`, and ``checkpoint_store``), so that they accept
    and refuse the same checkpoints.

    :meth:`check` reads the packs of a rank that hold the members read (those the metadata predicts first,
    then every pack in order up to the first absent one while a member read is not found), each directory
    with the checks of :func:`_check_rank_pack_members`; when every member the rank holds is read (``verify``,
    a whole load, the zarr store), every pack its save wrote is read (how many follows from the metadata:
    :func:`arraycheckpoint.audit.predict.predicted_fill`; without a recorded fill target, every pack up to the
    first absent one), so that a member a second time or a foreign member in any of them is refused by each of
    them alike, and a pack past the last one is opened by none.
    ``storage`` is a :class:`~arraycheckpoint.storage.Storage` or any object that
    :func:`arraycheckpoint.audit.packdir._pack_directory` reads packs through (``pack_ranges``). ``parsed``
    holds the directories an object store's capacity count read (:func:`rank_capacity`), which :meth:`check`
    checks without reading them again."""

    def __init__(
        self, storage: Any, base: str, meta: Any, holds: Any, parsed: dict[Any, Any] | None = None
    ) -> None:
        from ..format.metadata import chunk_key_separator
        from ..planning.packing import packs_target

        self.storage, self.base, self.meta, self.holds = storage, base, meta, holds
        self.parsed: dict[Any, Any] = {} if parsed is None else parsed
        self.separator = chunk_key_separator(meta.format_version)
        packs = {t.pack for t in meta.tensors.values() if t.pack_rank is not None}  # a few distinct entries
        targets = {packs_target(pack) for pack in packs}
        self.target = targets.pop() if len(targets) == 1 else 0
        # chunk file bytes, grid, longest chunk key per distinct layout
        self.per_layout: dict[Any, tuple[int, tuple[int, ...], int]] = {}
        self.held_bytes = 0  # pack bytes kept for a load's reader (packdir.PackDirectory)
        self.ahead: EndReads | None = None  # the packs' ends read ahead (object stores)
        self._fills: dict[int, tuple[Any, tuple[dict[str, int], int | None]]] = {}  # rank -> (reading, fill)

    def ends(self, rank: int, reading: Mapping[str, tuple[str, int]]) -> list[tuple[str, int, int | None]]:
        """The reads of packs' ends (:class:`~arraycheckpoint.audit.ahead.EndReads` jobs) that :meth:`check`
        of ``reading`` makes on a sound checkpoint, in its order: the packs predicted to hold ``reading``,
        then, when it is every member of the rank, the other packs its save wrote."""
        from ..planning.packing import pack_key

        docs, chunks = self.holds.get(rank, ([], {}))
        _l, _g, entries_bound, members, bound = _rank_bounds(self.meta, docs, chunks, self.per_layout)
        fill = self._fills[rank] = (
            reading,
            _predicted_fill(self.meta, rank, reading, docs, chunks, self.target),
        )
        where_of, written = fill[1]
        at = sorted(set(where_of.values()))
        if len(reading) >= members and written is not None:
            at += [k for k in range(min(written, members + 1)) if k not in set(at)]
        want = min(bound + 1, packdir._PACK_TAIL_BYTES)
        keys = (pack_key(rank, k) for k in at)
        return [(key, want, entries_bound) for key in keys if (key, bound, entries_bound) not in self.parsed]

    def whole_rank(self, rank: int, chunks_of: Callable[[str], np.ndarray]) -> dict[str, tuple[str, int]]:
        """Every member of ``rank``'s packs (``member -> (array, chunk or -1 for its zarr.json)``), after its
        packs' capacity is checked (:func:`rank_capacity`); ``chunks_of(array)``: the chunks (flat indices)
        of the array that ``rank`` wrote."""
        self.capacity(rank)
        docs, counts = self.holds.get(rank, ([], {}))
        out = {f"{n}/zarr.json": (n, -1) for n in docs}
        for name in counts:
            grid = _chunk_grid(self.meta.tensors[name])
            for flat in chunks_of(name).tolist():
                idx = np.unravel_index(flat, grid) if grid else ()
                out[f"{name}/" + self.separator.join(["c", *(str(int(i)) for i in idx)])] = (name, flat)
        return out

    def capacity(self, rank: int) -> None:
        """:func:`rank_capacity` of ``rank`` for every chunk its packs hold (of arrays of several chunks)."""
        counts = self.holds.get(rank, ([], {}))[1]
        multi = {n: k for n, k in counts.items() if len(self.meta.tensors[n].writers) > 1}
        rank_capacity(self.storage, self.base, self.meta, rank, multi, self.holds, self.parsed)

    def check(
        self,
        rank: int,
        reading: Mapping[str, tuple[str, int]],
        directories: dict[str, list[Any]] | None = None,
        deferred: dict[str, dict[str, int]] | None = None,
        *,
        seen: set[str] | None = None,
        opened: set[int] | None = None,
        to_end: bool = False,
    ) -> dict[str, int | None]:
        """Read and check ``rank``'s packs holding the members ``reading`` (see the class docstring and
        :func:`check_rank_packs` for ``directories`` and ``deferred``); ``pack key -> size`` of those read.

        A reader checking a rank pack by pack over several calls (the zarr store) passes the same ``seen``
        (members found in the packs read so far: none twice across them) and ``opened`` (the indices of those
        packs, not read again) to each, and ``to_end`` with the last: the rank's other packs are read too (those
        its save wrote), as when every member is read at once."""
        from ..planning.packing import pack_key

        meta, base = self.meta, self.base
        docs, chunks = self.holds.get(rank, ([], {}))
        limits, grids, entries_bound, members, bound = _rank_bounds(meta, docs, chunks, self.per_layout)
        seen = set() if seen is None else seen
        wanted = set(reading)
        # every member the rank holds: every pack it wrote
        whole = to_end or len(wanted) >= members
        check = functools.partial(
            _check_rank_pack_members,
            meta,
            rank=rank,
            docs=set(docs),
            grids=grids,
            limits=limits,
            reading=wanted,
            seen=seen,
            separator=self.separator,
        )
        # the packs the metadata says hold what is read (packing.PackFill) first; every pack of the rank, in
        # order, only when a member read is not there, or every member is read: then up to the last one its
        # save wrote (``written``, from the metadata), or, where the metadata records no fill target, up to the
        # first absent one (one missing-object read per rank). A pack past the last one a save wrote is no
        # part of the checkpoint: no reader opens it (all share this walk), as none opens any other file there.
        fill = self._fills.pop(rank, None)  # predicted by ends() for this reading
        where_of, written = (
            fill[1]
            if fill is not None and fill[0] is reading
            else _predicted_fill(meta, rank, reading, docs, chunks, self.target)
        )
        probe = itertools.chain(  # lazily: the rank may hold millions of members of arrays not read
            ((k, False) for k in sorted(set(where_of.values()))), ((k, True) for k in range(members + 1))
        )
        out: dict[str, int | None] = {}
        opened = set() if opened is None else opened
        for k, probing in probe:
            if k in opened:
                continue
            if probing and not wanted - seen and (not whole or (written is not None and k >= written)):
                break
            opened.add(k)
            key = pack_key(rank, k)
            try:
                entries, size = packdir._pack_directory(
                    self.storage,
                    base,
                    key,
                    bound,
                    max_directory_bytes=entries_bound,
                    check_members=functools.partial(check, where=f"{base}/{key}"),
                    missing_ok=True,
                    deferred=None if deferred is None else deferred.setdefault(key, {}),
                    parsed=self.parsed,
                    ahead=self.ahead,
                )
            except CorruptCheckpointError as e:  # name the tensors the pack was read for
                if str(e).startswith("tensor '"):
                    raise
                # the members this pack was opened for (all not found yet when probing past the predicted ones)
                concerned = wanted - seen if probing else {m for m, at in where_of.items() if at == k}
                raise _naming(type(e), concerned or wanted, str(e)) from None
            if size is None and not entries:
                if probing:
                    break
                continue  # reported below as missing members
            if k == members:
                raise _naming(
                    CorruptCheckpointError,
                    wanted,
                    f"{base}/{key} exists, but rank {rank}'s {members} packed member(s) fill at most "
                    f"{members} pack(s); the checkpoint is damaged or hostile",
                )
            out[key] = size
            if directories is not None:
                if isinstance(entries, packdir.PackDirectory):  # a load keeps what its budget allows
                    self.held_bytes += len(entries.held)
                    if self.held_bytes > packdir.KEEP_HELD_BYTES:
                        entries.held = b""
                directories[key] = entries
        missing = sorted(wanted - seen)
        if missing:
            at = where_of.get(missing[0])
            expected = f", expected in {base}/{pack_key(rank, at)}" if at is not None else ""
            more = f" (and {len(missing) - 1} more members)" if len(missing) > 1 else ""
            err = _naming(
                InconsistentCheckpointError,
                missing,
                f"{missing[0]} is missing: in none of rank {rank}'s packs ({base}/.acp/packs/{rank}.<k>.zip"
                f"{expected}){more}; the checkpoint is damaged (a pack lost or cut short)",
            )
            for member in reversed(missing):  # each array's own first missing member
                err.tensors[member.rpartition("/")[0]] = (  # type: ignore[attr-defined]
                    f"{member} is missing: in none of rank {rank}'s packs ({base}/.acp/packs/{rank}.<k>.zip); "
                    "the checkpoint is damaged (a pack lost or cut short)"
                )
            raise err
        return out


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


def _check_rank_pack_members(
    meta: Any,
    entries: list[PackMember],
    rank: int,
    docs: Collection[str],
    grids: Mapping[str, tuple[int, ...]],
    limits: Mapping[str, int],
    reading: Collection[str],
    seen: set[str],
    separator: str,
    where: str,
) -> list[PackMember]:
    """Check the directory ``entries`` of one of ``rank``'s packs (``where``) against the metadata (see
    :func:`check_rank_packs`); ``seen`` collects the member names over all of that rank's packs. Returns the
    entries read, whose local headers the caller checks next."""
    checked: list[PackMember] = []
    tensors = meta.tensors
    # the chunk key of a one-chunk array (every small tensor), per grid: its only member besides zarr.json,
    # recognised without parsing (what chunk_place would find: the array, chunk 0)
    only_key: dict[tuple[int, ...], str | None] = {}
    for e in entries:
        name = e.filename
        if name in seen:
            raise _naming(
                CorruptCheckpointError,
                [name],
                f"{where} holds the member {name!r} a second time (in this or another of rank {rank}'s "
                "packs); the pack is damaged or hostile",
            )
        seen.add(name)
        array, _, leaf = name.rpartition("/")
        grid = grids.get(array) if separator != "/" else None
        key = None
        if grid is not None:
            key = only_key.get(grid, "")
            if key == "":
                key = only_key[grid] = (
                    separator.join(["c", *("0" * len(grid))]) if not any(g != 1 for g in grid) else None
                )
        if leaf == "zarr.json" and array in docs:
            limit = MAX_PACKED_JSON_BYTES
        elif grid is not None and leaf == key and tensors[array].writers[0] == rank:
            limit = limits[array]
        else:
            place = chunk_place(name, grids, grids, separator)
            if place is None or tensors[place[0]].writers[place[1]] != rank:
                near = next((n for n in grids if name.startswith(n + "/")), None)
                about = f"no chunk of tensor {near!r} that " if near is not None else ""
                # the pack is refused for every array read from it: the error names the pack, and the caller
                # the arrays it was read for (never only the tensor whose name the foreign member borrows)
                raise CorruptCheckpointError(
                    f"{where} holds the member {name!r}, which none of its arrays has ({about}rank {rank} "
                    "wrote: outside the grid, of another writer, or a foreign file); the pack is damaged or "
                    "hostile"
                )
            limit = limits[place[0]]
        if name in reading:
            if e.compress_type or e.compress_size != e.file_size or e.file_size > limit:
                try:
                    _check_member(e, array, where, limit)  # raises, saying which
                except CorruptCheckpointError as err:  # the damage is this array's, not the pack's others'
                    err.tensors = {array: str(err)}  # type: ignore[attr-defined]
                    raise
            checked.append(e)
        # a member not read is never inflated nor sized from: a damaged entry of it (compressed, oversized)
        # concerns its own array alone, as damaged bytes of it would; readers of every member refuse it
    return checked
