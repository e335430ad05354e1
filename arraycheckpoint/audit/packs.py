"""Format 5 packs: the packs holding the arrays read are laid out as a save writes them.

:func:`check_packs` checks that each pack is a regular file with exactly the members its arrays declare,
stored uncompressed and bounded; :func:`chunks_wanted` is the chunks of an array a load reads.
"""

from __future__ import annotations

import functools
import itertools
import math
import re
from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..checks.bounds import MAX_PACKED_JSON_BYTES
from ..checks.zipdir import _CD_ENTRY_BYTES, PackMember, _check_member
from ..errors import (
    CorruptCheckpointError,
    InconsistentCheckpointError,
)
from . import packdir  # packdir._pack_directory: looked up at call time (tests count its calls)
from .packdir import _chunk_grid, _longest_chunk_key, _pack_bound, _packed_chunk_bytes

#: ``<array>/c.<i>.<j>...`` (format 3) or ``<array>/c/<i>/<j>...`` (formats 1, 2): zarr v3 default chunk keys
#: (``<array>/c`` for a 0-d array), by separator.
_CHUNK_KEYS = {sep: re.compile(r"^(.+)/c(?:" + re.escape(sep) + r"\d+)*$") for sep in "./"}


def check_packs(
    storage: Any,
    root: str,
    meta: Any,
    names: Collection[str],
    directories: dict[str, list[Any]] | None = None,
) -> dict[str, int | None]:
    """The packs holding the arrays ``names`` (format 5, :mod:`arraycheckpoint.planning.packing`) are sound.

    A pack must be a regular file (no link on the way, never a FIFO, on local file systems) no larger than its
    declared arrays can be, laid out as a save writes it (:func:`_pack_directory`: the end record at the very
    end, the central directory right before it and no larger than its arrays' entries take, no member
    overlapping another). Every entry must be a member its arrays can have: a group ``zarr.json``, an
    array's ``zarr.json``, or a chunk key inside that array's grid; none twice. For each array read: its
    ``zarr.json`` (within :data:`MAX_PACKED_JSON_BYTES`) and every chunk of its grid are present, stored
    uncompressed, each chunk no larger than its uncompressed encoding, and, since tensorstore's ``zip`` driver
    takes a member's compression method and sizes from its *local* header, every local header of these
    members says the same as the central directory (stored, same sizes, same name, no data descriptor, no
    encryption). Nothing is inflated: no ZIP bomb. Only then does tensorstore read a member.

    ``directories``, when given, receives each checked pack's directory (``pack key -> [PackMember]``), so a
    reader of the members needs no second parse.

    Returns:
        ``pack key -> size`` of the packs checked.

    Raises:
        InconsistentCheckpointError: a pack or a member of an array read is missing.
        CorruptCheckpointError: a link, a FIFO, an oversized pack, a pack that is not a ZIP archive as a save
            writes it, a member no array of the pack has, or a compressed, duplicated or oversized member.
    """
    from ..format.metadata import chunk_key_separator
    from ..planning.packing import by_pack, group_keys

    if not names:
        return {}
    separator = chunk_key_separator(meta.format_version)
    members_of = by_pack({n: t.pack for n, t in meta.tensors.items() if t.pack is not None})
    base = root.rstrip("/")
    out: dict[str, int | None] = {}
    for key, reading in by_pack({n: meta.tensors[n].pack for n in names}).items():
        every = members_of[key]
        limits = {n: _packed_chunk_bytes(meta.tensors[n]) for n in every}
        grids = {n: _chunk_grid(meta.tensors[n]) for n in every}
        groups = group_keys(every)
        # the directory's size from the metadata alone (members counted, never enumerated)
        max_directory = sum(_CD_ENTRY_BYTES + len(g.encode()) for g in groups) + sum(
            (1 + math.prod(g)) * (_CD_ENTRY_BYTES + len(n.encode()) + 1 + max(9, _longest_chunk_key(g)))
            for n, g in grids.items()
        )
        check_members = functools.partial(
            _check_pack_members,
            meta,
            reading=reading,
            every=every,
            grids=grids,
            limits=limits,
            groups=set(groups),
            separator=separator,
            where=f"{base}/{key}",
        )
        try:
            entries, size = packdir._pack_directory(
                storage,
                base,
                key,
                _pack_bound(meta, every, limits),
                max_directory_bytes=max_directory,
                check_members=check_members,
            )
        except CorruptCheckpointError as e:  # name the tensors the pack was read for
            if str(e).startswith("tensor '"):
                raise
            named = ", ".join(repr(n) for n in reading[:3])
            more = f" (and {len(reading) - 3} more)" if len(reading) > 3 else ""
            raise type(e)(f"tensor{'s' if len(reading) > 1 else ''} {named}{more}: {e}") from None
        out[key] = size
        if directories is not None:
            directories[key] = entries
    return out


def chunks_wanted(t: Any, boxes: list[Any] | None) -> np.ndarray:
    """Flat (row-major) indices of the chunks of the array ``t`` that meet any region of ``boxes`` (every
    chunk when None), sorted."""
    grid = _chunk_grid(t)
    if boxes is None:
        return np.arange(math.prod(grid), dtype=np.int64)
    hit: set[int] = set()
    for b in boxes:
        if not math.prod(b.lengths):
            continue
        ranges = [range(o // c, -(-(o + n) // c)) for o, n, c in zip(b.offsets, b.lengths, t.chunk_shape)]
        for idx in itertools.product(*ranges):
            hit.add(int(np.ravel_multi_index(idx, grid)) if grid else 0)
    return np.asarray(sorted(hit), dtype=np.int64)


def _check_pack_members(
    meta: Any,
    entries: list[PackMember],
    reading: Collection[str],
    every: Collection[str],
    grids: Mapping[str, tuple[int, ...]],
    limits: Mapping[str, int],
    groups: Collection[str],
    separator: str,
    where: str,
) -> list[PackMember]:
    """Check the directory ``entries`` of the pack ``where`` holding the arrays ``every`` against the
    metadata (see :func:`check_packs`); return the entries of the arrays ``reading``, whose local headers the
    caller checks next."""
    members = set(every)
    reading = set(reading)
    seen: set[str] = set()
    docs: dict[str, PackMember] = {}
    chunks: dict[str, list[PackMember]] = {}
    for e in entries:
        if e.filename in seen:
            raise CorruptCheckpointError(
                f"{where} names the member {e.filename!r} twice; the pack is damaged"
            )
        seen.add(e.filename)
        if e.filename in groups:
            continue
        array, _, leaf = e.filename.rpartition("/")
        if array in members and leaf == "zarr.json":
            docs[array] = e
            continue
        owner = _chunk_owner(e.filename, members, grids, separator)
        if owner is not None:
            chunks.setdefault(owner, []).append(e)
            continue
        near = next((n for n in members if e.filename.startswith(n + "/")), None)
        about = f"tensor {near!r}: " if near is not None else ""
        raise CorruptCheckpointError(
            f"{about}{where} holds the member {e.filename!r}, which none of its arrays has (a chunk outside "
            "the grid, or a foreign file); the pack is damaged or hostile"
        )
    checked: list[PackMember] = []
    for name in sorted(reading):
        t = meta.tensors[name]
        doc = docs.get(name)
        if doc is None:
            raise InconsistentCheckpointError(
                f"tensor {name!r}: its pack {where} holds no {name}/zarr.json; the checkpoint is damaged"
            )
        found = chunks.get(name, [])
        expected = math.prod(grids[name])
        if len(found) != expected:  # unique and inside the grid: as many as the grid has means all of them
            raise InconsistentCheckpointError(
                f"tensor {name!r}: the metadata declares {expected} chunk(s) of {list(t.chunk_shape)}, but "
                f"its pack {where} holds {len(found)}; the metadata does not describe this checkpoint"
            )
        for e, limit in [(doc, MAX_PACKED_JSON_BYTES)] + [(c, limits[name]) for c in found]:
            _check_member(e, name, where, limit)
            checked.append(e)
    return checked


def _chunk_owner(
    filename: str, members: Collection[str], grids: Mapping[str, tuple[int, ...]], separator: str
) -> str | None:
    """The array of ``members`` whose grid has the chunk key ``filename`` (canonical decimal indices, one per
    dimension, each inside the grid), or None."""
    place = chunk_place(filename, members, grids, separator)
    return None if place is None else place[0]


def chunk_place(
    filename: str, members: Collection[str], grids: Mapping[str, tuple[int, ...]], separator: str
) -> tuple[str, int] | None:
    """``(array, flat row-major chunk index)`` of the chunk key ``filename`` of an array of ``members``
    (canonical decimal indices, one per dimension, each inside the array's grid ``grids[array]``), or None."""
    m = _CHUNK_KEYS[separator].match(filename)
    if m is None or m.group(1) not in members:
        return None
    array = m.group(1)
    rest = filename[len(array) + 2 :]  # after "<array>/c"
    parts = rest.split(separator)[1:] if rest else []
    grid = grids[array]
    if len(parts) != len(grid):
        return None
    flat = 0
    for p, g in zip(parts, grid):
        i = int(p)
        if p != str(i) or i >= g:
            return None
        flat = flat * g + i
    return array, flat
