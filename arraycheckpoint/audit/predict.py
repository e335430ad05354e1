"""Format 6: which of a rank's packs holds a member, as a save fills its packs
(:class:`arraycheckpoint.planning.packing.PackFill`): what a reader opens first (the load's checks, the zarr
store), before it looks through the rank's packs in order."""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any

import numpy as np

from ..format.writers import rank_chunks
from .packdir import _packed_chunk_bytes


def predicted_packs(
    meta: Any,
    rank: int,
    reading: Mapping[str, tuple[str, int]],
    docs: Collection[str],
    chunks: Mapping[str, int],
    target: int,
) -> dict[str, int]:
    """Format 6: the index of the pack of ``rank`` holding each member of ``reading`` (``member -> (array,
    chunk or -1 for its zarr.json)``), as a save fills its packs (:class:`arraycheckpoint.planning.packing.PackFill`)
    from the arrays whose ``zarr.json`` the rank holds (``docs``) and its chunks of each (``chunks``); empty
    when the metadata records no fill target (``target`` 0: none, or not one for every array)."""
    return predicted_fill(meta, rank, reading, docs, chunks, target)[0]


def predicted_fill(
    meta: Any,
    rank: int,
    reading: Mapping[str, tuple[str, int]],
    docs: Collection[str],
    chunks: Mapping[str, int],
    target: int,
) -> tuple[dict[str, int], int | None]:
    """:func:`predicted_packs`, and how many packs ``rank``'s save wrote (the packs its members fill: a save
    writes no other), or None when the metadata records no fill target."""
    from ..planning.packing import DOC_BYTES, PackFill

    if not target:
        return {}, None
    fill = PackFill(target)
    by_array: dict[str, list[tuple[str, int]]] = {}
    for member, (name, flat) in reading.items():
        by_array.setdefault(name, []).append((member, flat))
    created_here = set(docs)
    out: dict[str, int] = {}
    for name in sorted(created_here | set(chunks)):  # by name: its document (where created), then its chunks
        count = chunks.get(name, 0)
        created = name in created_here
        if created and not count:  # the document alone
            for member, _flat in by_array.get(name, ()):
                out[member] = fill.where(0, DOC_BYTES)
            fill.add(1, DOC_BYTES)
            continue
        size = _packed_chunk_bytes(meta.tensors[name])
        first = (
            size + DOC_BYTES if created else size
        )  # the document counted with (and kept by) the first chunk
        reads = by_array.get(name)
        if reads:
            writers = meta.tensors[name].writers
            if len(writers) == 1:  # one chunk (every small tensor), written by this rank: the first
                at = fill.where(0, first)
                for member, _flat in reads:
                    out[member] = at
                fill.add(1, first)
                fill.add(count - 1, size)
                continue
            mine = rank_chunks(writers, rank)
            for member, flat in reads:
                j = int(np.searchsorted(mine, flat))  # this rank's chunks of the array before ``flat``
                out[member] = fill.where(0, first) if j == 0 else _after_first(fill, first, j - 1, size)
        fill.add(1, first)
        fill.add(count - 1, size)
    return out, fill.index + 1


def _after_first(fill: Any, first: int, j: int, size: int) -> int:
    """The pack of the ``j``-th member of a run of ``size`` bytes that follows one member of ``first``."""
    from ..planning.packing import PackFill

    probe = PackFill(fill.target)
    probe.index, probe.held = fill.index, fill.held
    probe.add(1, first)
    return probe.where(j, size)
