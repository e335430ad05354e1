"""Format 6 packs: every chunk of a packed array lies in its writer's packs, found by key.

:func:`check_rank_packs` reads each rank's pack directories once (not once per array), checks every member
of the arrays read against the metadata, and names the arrays concerned when one is wrong; the number and
sizes of a rank's packs must be those its save could have produced.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any

import numpy as np

from ..checks.bounds import MAX_PACKED_JSON_BYTES
from ..checks.zipdir import PackMember, _check_member
from ..errors import (
    CorruptCheckpointError,
    InconsistentCheckpointError,
)
from . import packdir  # packdir._pack_directory: looked up at call time (tests count its calls)
from .ahead import EndReads, Job
from .capacity import REMOTE_CAPACITY_FREE as REMOTE_CAPACITY_FREE  # found here before capacity.py
from .capacity import (
    _count_ranks,
    _counted,
    _fill_target,
    _naming,
    _rank_bounds,
    check_capacity,
    pack_counts,
)
from .capacity import _rank_members as _rank_members
from .capacity import counted_once as counted_once
from .capacity import rank_capacity as rank_capacity
from .packcount import PackCounts
from .packdir import _chunk_grid
from .packs import chunk_place, chunks_wanted
from .predict import predicted_fill as _predicted_fill


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
    counts = pack_counts(storage, base)  # for a checkpoint recording no fill target: one listing, no probes
    holds = check_capacity(storage, base, meta, names, parsed, counts)  # before a key is built per chunk
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
    walk = RankPacks(storage, base, meta, holds, parsed, counts)
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
    :func:`arraycheckpoint.audit.predict.predicted_fill`; without a recorded fill target, on object stores
    from one listing of the packs, :class:`~arraycheckpoint.audit.packcount.PackCounts`, elsewhere or where
    the listing fails every pack up to the first absent one), so that a member a second time or a foreign member in any of them is refused by each of
    them alike, and a pack past the last one is opened by none.
    ``storage`` is a :class:`~arraycheckpoint.storage.Storage` or any object that
    :func:`arraycheckpoint.audit.packdir._pack_directory` reads packs through (``pack_ranges``). ``parsed``
    holds the directories an object store's capacity count read (:func:`~arraycheckpoint.audit.capacity.rank_capacity`), which :meth:`check`
    checks without reading them again."""

    def __init__(
        self,
        storage: Any,
        base: str,
        meta: Any,
        holds: Any,
        parsed: dict[Any, Any] | None = None,
        counts: PackCounts | None = None,
    ) -> None:
        from ..format.metadata import chunk_key_separator

        self.storage, self.base, self.meta, self.holds = storage, base, meta, holds
        self.parsed: dict[Any, Any] = {} if parsed is None else parsed
        # without a recorded fill target: how many packs each rank wrote, from one listing (object stores)
        self.counts = PackCounts(storage, base) if counts is None else counts
        self.separator = chunk_key_separator(meta.format_version)
        self.target = _fill_target(meta)
        # chunk file bytes, grid, longest chunk key per distinct layout
        self.per_layout: dict[Any, tuple[int, tuple[int, ...], int]] = {}
        self.held_bytes = 0  # pack bytes kept for a load's reader (packdir.PackDirectory)
        self.ahead: EndReads | None = None  # the packs' ends read ahead (object stores)
        # (rank, id(reading)) -> (reading, its fill), predicted by ends() for check()
        self._fills: dict[tuple[int, int], tuple[Any, tuple[dict[str, int], int | None]]] = {}

    def ends(
        self,
        rank: int,
        reading: Mapping[str, tuple[str, int]],
        *,
        to_end: bool = False,
        opened: set[int] | None = None,
    ) -> list[Job]:
        """The reads of packs' ends (:class:`~arraycheckpoint.audit.ahead.EndReads` jobs) that :meth:`check`
        of ``reading`` (with ``to_end`` and ``opened``: the packs read before, to which those planned here are
        added) makes on a sound checkpoint, in its order: the packs predicted to hold ``reading``, then, when
        it is every member of the rank, the other packs its save wrote (without a recorded fill target: as
        many as :attr:`counts` lists)."""
        from ..planning.packing import pack_key

        docs, chunks = self.holds.get(rank, ([], {}))
        _l, _g, entries_bound, members, bound = _rank_bounds(self.meta, docs, chunks, self.per_layout)
        fill = self._fills[rank, id(reading)] = (
            reading,
            _predicted_fill(self.meta, rank, reading, docs, chunks, self.target),
        )
        where_of, written = fill[1]
        at = sorted(set(where_of.values()))
        if to_end or len(reading) >= members:
            written = self._written(rank, written)
            if written is not None:
                at += [k for k in range(min(written, members + 1)) if k not in set(at)]
        want = min(bound + 1, packdir._PACK_TAIL_BYTES)
        if opened is not None:
            at = [k for k in at if k not in opened]
            opened.update(at)
        keys = (pack_key(rank, k) for k in at)
        return [(key, want, entries_bound) for key in keys if (key, bound, entries_bound) not in self.parsed]

    def _written(self, rank: int, predicted: int | None) -> int | None:
        """The packs ``rank``'s save wrote: ``predicted`` from the fill target, else :attr:`counts`' listing."""
        return predicted if predicted is not None else self.counts.written(rank)

    def whole_rank(
        self, rank: int, chunks_of: Callable[[str], np.ndarray], counted: bool = False
    ) -> dict[str, tuple[str, int]]:
        """Every member of ``rank``'s packs (``member -> (array, chunk or -1 for its zarr.json)``), after its
        packs' capacity is checked (:func:`~arraycheckpoint.audit.capacity.rank_capacity`; ``counted``: already); ``chunks_of(array)``: the
        chunks (flat indices) of the array that ``rank`` wrote."""
        if not counted:
            self.capacity(rank)
        docs, counts = self.holds.get(rank, ([], {}))
        out = {f"{n}/zarr.json": (n, -1) for n in docs}
        for name in counts:
            grid = _chunk_grid(self.meta.tensors[name])
            for flat in chunks_of(name).tolist():
                idx = np.unravel_index(flat, grid) if grid else ()
                out[f"{name}/" + self.separator.join(["c", *(str(int(i)) for i in idx)])] = (name, flat)
        return out

    def capacity(self, *ranks: int) -> None:
        """:func:`~arraycheckpoint.audit.capacity.rank_capacity` of each of ``ranks`` for every chunk its packs hold (of arrays of several
        chunks), the directories counted read ahead on object stores (:func:`~arraycheckpoint.audit.capacity._count_ranks`)."""
        per_rank = {}
        for rank in ranks:
            held = self.holds.get(rank, ([], {}))[1]
            per_rank[rank] = {n: k for n, k in held.items() if len(self.meta.tensors[n].writers) > 1}
        _count_ranks(self.storage, self.base, self.meta, self.holds, per_rank, self.parsed, self.counts)

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
        damaged: dict[str, CorruptCheckpointError] | None = None,
    ) -> dict[str, int | None]:
        """Read and check ``rank``'s packs holding the members ``reading`` (see the class docstring and
        :func:`check_rank_packs` for ``directories`` and ``deferred``); ``pack key -> size`` of those read.

        A reader checking a rank pack by pack over several calls (the zarr store) passes the same ``seen``
        (members found in the packs read so far: none twice across them) and ``opened`` (the indices of those
        packs, not read again) to each, and ``to_end`` with the last: the rank's other packs are read too (those
        its save wrote), as when every member is read at once. With ``damaged``, a member read whose own entry
        is damaged (compressed, oversized: :func:`_check_rank_pack_members`) is put there (member -> the error
        naming its array) and left out, and the pack's other members are still served: a reader of several
        arrays at once (the zarr store reads every member of a pack together) refuses an array for its own
        damage only, as the load of that array alone does."""
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
            damaged=damaged,
        )
        # the packs the metadata says hold what is read (packing.PackFill) first; every pack of the rank, in
        # order, only when a member read is not there, or every member is read: then up to the last one its
        # save wrote (``written``, from the metadata), or, where the metadata records no fill target, from one
        # listing of the packs (object stores: PackCounts), else up to the first absent one (one missing-object
        # read per rank). A pack past the last one a save wrote is no
        # part of the checkpoint: no reader opens it (all share this walk), as none opens any other file there.
        fill = self._fills.pop((rank, id(reading)), None)  # predicted by ends() for this reading
        where_of, written = (
            fill[1]
            if fill is not None and fill[0] is reading
            else _predicted_fill(meta, rank, reading, docs, chunks, self.target)
        )
        if whole:
            written = self._written(rank, written)
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
    damaged: dict[str, CorruptCheckpointError] | None = None,
) -> list[PackMember]:
    """Check the directory ``entries`` of one of ``rank``'s packs (``where``) against the metadata (see
    :func:`check_rank_packs`); ``seen`` collects the member names over all of that rank's packs. Returns the
    entries read, whose local headers the caller checks next. A member read whose entry is damaged
    (compressed, oversized) raises, naming its array, or with ``damaged`` is put there and left out."""
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
                    if damaged is None:
                        raise
                    damaged[name] = err
                    continue
            checked.append(e)
        # a member not read is never inflated nor sized from: a damaged entry of it (compressed, oversized)
        # concerns its own array alone, as damaged bytes of it would; readers of every member refuse it
    return checked
