"""Who writes each chunk (pure): one of the ranks that already hold it, by worst fit on bytes.

Chunk grids nest in the saved regions (:mod:`arraycheckpoint.planning.chunking`), so every chunk lies inside one
region and the candidates to write it are that region's holders: one rank for a sharded region (FSDP2,
Megatron TP, JAX; no choice), every replica for a replicated one (DDP, data-parallel replicas, replicated
JAX or DTensor placements). Replicated chunks are placed largest first on the least-loaded holder (the
lowest rank among equals), after every forced chunk is counted: replicas are written once and the bytes
each rank writes stay within ``write_balance`` of the mean wherever the regions allow it (the planner caps
replicated chunks for that: :func:`replica_caps`). No chunk is ever written by a rank that lacks its bytes,
so no tensor byte travels.

The one exception, a chunk of a flat-run grid over flat ranges (FSDP1), is written by a holder of its largest
piece; each piece it lacks comes from :func:`fragment_source`.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence

import numpy as np


def fragment_source(holders: Sequence[int], owner: int) -> int:
    """The holder that sends a region's fragment to ``owner`` (which does not hold it): ``holders[owner mod
    len(holders)]`` (``holders`` sorted), so replicas take turns over the owners."""
    return int(holders[owner % len(holders)])


def replica_caps(
    regions: Iterable[tuple[int, Sequence[int]]], min_bytes: int, balance: float, max_bytes: int
) -> dict[tuple[int, ...], int]:
    """The largest chunk of a region replicated on each holder set: ``(balance - 1)`` of the bytes a holder
    of the set writes on average from it (at least ``min_bytes``, at most ``max_bytes``).

    ``regions`` lists (bytes, sorted holders) of every distinct replicated region of the save. A worst fit
    that places chunks largest first leaves no rank more than its last (smallest) chunk above the mean, so
    chunks of at most ``(balance - 1) x`` a rank's share keep every holder within ``balance`` of it.
    """
    total: dict[tuple[int, ...], int] = {}
    for nbytes, holders in regions:
        key = tuple(holders)
        total[key] = total.get(key, 0) + nbytes
    return {
        key: min(max_bytes, max(min_bytes, int((balance - 1) * b / len(key)))) for key, b in total.items()
    }


class WorstFit:
    """Worst-fit placement of replicated chunks over ``load`` (bytes each rank already writes: the forced
    chunks). Feed the chunks largest first (ties in a deterministic order) with :meth:`pick`."""

    def __init__(self, load: np.ndarray) -> None:
        self.load = load.astype(np.int64, copy=True)
        self._heap = [(int(x), r) for r, x in enumerate(self.load.tolist())]  # refreshed lazily
        heapq.heapify(self._heap)

    def _least(self) -> int:
        while True:
            load, r = self._heap[0]
            if load == self.load[r]:
                return r
            heapq.heapreplace(self._heap, (int(self.load[r]), r))

    def pick(self, nbytes: int, holders: np.ndarray) -> int:
        """The writer of a chunk of ``nbytes`` held by the sorted ``holders``: the least loaded of them (the
        lowest rank among equals). Records its load."""
        if len(holders) == len(self.load):  # held everywhere: the heap answers without a scan
            r = self._least()
        elif len(holders) == 1:
            r = int(holders[0])
        else:
            r = int(holders[np.argmin(self.load[holders])])
        self.load[r] += nbytes  # its heap entry is now stale: _least refreshes it when it reaches the top
        return r
