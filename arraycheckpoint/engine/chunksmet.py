"""Which chunks of an array the regions a load reads meet (each chunk once, with the regions it meets)."""

from __future__ import annotations

import itertools
from typing import Any

from . import chunkread


def first(read: tuple[Any, ...]) -> Any:
    """A tuple's first item (a sort key: a read's offset, a chunk's grid index)."""
    return read[0]


def chunks_met(
    dests: list[chunkread.Dest], chunk_shape: Any
) -> list[tuple[tuple[int, ...], list[chunkread.Dest]]]:
    """Grid indices of the chunks the (non-empty) regions of ``dests`` meet, in C order, each once, with the
    destinations each meets (in their order): one pass over the chunks of each region, not one over the
    regions per chunk (a region per chunk, as ``verify`` reads: 70,000 chunks made 4.9e9 intersections)."""
    if len(dests) == 1:
        box = dests[0][0]
        if box.volume == 0:
            return []
        ranges = [
            range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(box.offsets, box.lengths, chunk_shape)
        ]
        return [(idx, dests) for idx in itertools.product(*ranges)]
    met: dict[tuple[int, ...], list[chunkread.Dest]] = {}
    for dest in dests:
        box = dest[0]
        if box.volume == 0:
            continue
        ranges = [
            range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(box.offsets, box.lengths, chunk_shape)
        ]
        for idx in itertools.product(*ranges):
            near = met.get(idx)
            if near is None:
                met[idx] = [dest]
            else:
                near.append(dest)
    return sorted(met.items(), key=first)
