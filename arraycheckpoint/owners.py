"""Who writes each chunk and who sends its fragments: the cost model of the fragment exchange (pure).

Three costs pull against each other: the bytes each rank writes (the save takes as long as the busiest
writer), the bytes that cross hosts in the exchange (network, where same-host copies are cheap) and the
number of files (bounded by the target file size, :mod:`arraycheckpoint.chunking`). The rules, shared by the
reference and the compact planner so both decide identically:

1. *Preferred hosts of a chunk*: the hosts holding most of its bytes (a replicated region counts for every
   host holding a replica). A chunk that one region holds entirely prefers every host of its holders.
2. *Owner*, in two passes. Locality: chunks are placed largest first (worst fit) on the least-loaded rank
   holding part of the chunk on a preferred host (every fragment it lacks then comes from its own host where
   any holder is there), unless its load would rise above ``write_balance x`` the mean load; then on the
   least-loaded rank of the preferred hosts where that one is loaded less (the chunk travels within those
   hosts; a Megatron stage's data-parallel replicas are all preferred for its chunks, so this pass balances
   a stage within itself). Relief: each rank still above the bound, busiest first, hands chunks on (the
   smallest that alone brings it within the bound, else the largest that fits) to the least-loaded rank of
   the chunk's preferred hosts with room, else to the least-loaded rank of the world with room, else (no
   room anywhere) to that rank if the pair's busier one then holds less than before. Balance is bought with
   bytes that travel, and only the excess of a group of ranks over the bound crosses hosts.
3. *Source of a fragment* the owner lacks: a holder on the owner's host, else a holder chosen by the owner's
   rank (``holders[owner mod n]``): replicas of a region then take turns over the whole save instead of the
   same replica sending for every tensor of a layout.

What it cannot change: a file of ``f`` bytes assembled from shards of ``s`` bytes on hosts of ``p`` ranks
draws on ``f / (s p)`` hosts, so FSDP-style shards smaller than ``f / p`` cross hosts whatever the owner:
keeping them on one host would mean files of at most ``s p`` bytes (more files); the planner keeps the file
target and reports the traffic. With no host map every rank is its own host.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

import numpy as np


class HostMap:
    """The host of every rank: contiguous blocks of ``ranks_per_host`` (torchrun's ``LOCAL_WORLD_SIZE``), or an
    explicit per-rank host id (irregular placements). ``ranks_per_host <= 1`` and no ids: a host per rank."""

    def __init__(self, world: int, ranks_per_host: int = 0, host_of: Sequence[int] = ()) -> None:
        self.world = world
        self.block = max(1, int(ranks_per_host)) if not host_of else 0
        if host_of:
            if len(host_of) != world:
                raise ValueError(f"host_of lists {len(host_of)} ranks for a world of {world}")
            self.ids = np.asarray(host_of, dtype=np.int64)
            order = np.argsort(self.ids, kind="stable")
            hosts, starts = np.unique(self.ids[order], return_index=True)
            ends = [*starts[1:].tolist(), world]
            self._members = {int(h): order[s:e] for h, s, e in zip(hosts, starts, ends)}

    def hosts(self, ranks: np.ndarray) -> np.ndarray:
        """Host id of each of ``ranks``."""
        return ranks // self.block if self.block else self.ids[ranks]

    def host(self, rank: int) -> int:
        return rank // self.block if self.block else int(self.ids[rank])

    def members(self, hosts: Sequence[int] | np.ndarray) -> np.ndarray:
        """Every rank on ``hosts`` (sorted)."""
        hosts = np.unique(np.asarray(hosts, dtype=np.int64))
        if not len(hosts):
            return np.zeros(0, dtype=np.int64)
        if self.block:
            ranks = (hosts[:, None] * self.block + np.arange(self.block, dtype=np.int64)).ravel()
            return ranks[ranks < self.world]  # hosts ascending: the ranks come out sorted
        return np.unique(np.concatenate([self._members[int(h)] for h in hosts]))


def chunk_candidates(
    hostmap: HostMap, whole: np.ndarray | None, pieces: Sequence[tuple[int, np.ndarray]]
) -> tuple[np.ndarray, np.ndarray]:
    """``(holders on the preferred hosts, every rank of those hosts)`` of one chunk, both sorted.

    ``whole``: sorted ranks holding the entire chunk (None when no region does); ``pieces``: (bytes, sorted
    holders) of each part of the chunk when no region holds it entirely.
    """
    if whole is not None:
        return whole, hostmap.members(hostmap.hosts(whole))
    sizes = np.fromiter((n for n, _h in pieces), dtype=np.int64, count=len(pieces))
    ranks = np.concatenate([h for _n, h in pieces])
    piece = np.repeat(np.arange(len(pieces), dtype=np.int64), [len(h) for _n, h in pieces])
    hosts, at = np.unique(hostmap.hosts(ranks), return_inverse=True)
    pairs = np.unique(at.ravel() * len(pieces) + piece)  # each (host, piece) once: a host counts a piece once
    weight = np.zeros(len(hosts), dtype=np.int64)
    np.add.at(weight, pairs // len(pieces), sizes[pairs % len(pieces)])
    best = hosts[weight == weight.max()]
    held = np.unique(ranks)
    return held[np.isin(hostmap.hosts(held), best)], hostmap.members(best)


def fragment_source(holders: Sequence[int], owner: int, hostmap: HostMap) -> int:
    """The holder that sends a region's fragment to ``owner`` (which does not hold it): one on the owner's
    host if any, else ``holders[owner mod len(holders)]``. ``holders`` is sorted."""
    if len(holders) == 1:
        return holders[0]
    host = hostmap.host(owner)
    if hostmap.block:
        lo = host * hostmap.block
        local = _between(holders, lo, lo + hostmap.block)
    else:
        local = [r for r in holders if int(hostmap.ids[r]) == host]
    pool = local or holders
    return pool[owner % len(pool)]


def _between(sorted_ranks: Sequence[int], lo: int, hi: int) -> list[int]:
    import bisect

    return list(sorted_ranks[bisect.bisect_left(sorted_ranks, lo) : bisect.bisect_left(sorted_ranks, hi)])


class OwnerPicker:
    """Worst-fit placement with the host preference and the ``write_balance`` bound (rules 1-2 above).

    ``mode`` is ``PlanOptions.straddle_writers``: ``"balanced"`` (the rules above), ``"holders"`` (only holders
    on the preferred hosts, whatever the load) or ``"any"`` (a chunk no region holds entirely goes to the
    least-loaded rank of the world). Feed chunks largest first with :meth:`pick`, then read every chunk's
    owner from :meth:`owners`.
    """

    def __init__(self, world: int, total_bytes: int, write_balance: float, mode: str) -> None:
        self.load = np.zeros(world, dtype=np.int64)
        self.cap = int(write_balance * total_bytes / max(world, 1))
        self.mode = mode
        self._heap = [(0, r) for r in range(world)]  # (load, rank) entries, refreshed lazily
        self._owner: list[int] = []
        self._sizes: list[int] = []
        self._near: list[np.ndarray] = []

    def _least(self) -> int:
        while True:
            load, r = self._heap[0]
            if load == self.load[r]:
                return r
            heapq.heapreplace(self._heap, (int(self.load[r]), r))

    def _least_of(self, ranks: np.ndarray) -> int:
        """The least-loaded of the sorted ``ranks`` (the lowest rank among equals)."""
        if len(ranks) == len(self.load):  # every rank (replicated data): the heap answers without a scan
            return self._least()
        return int(ranks[np.argmin(self.load[ranks])]) if len(ranks) > 1 else int(ranks[0])

    def pick(self, nbytes: int, cands: np.ndarray, near: np.ndarray, partial: bool) -> int:
        """The provisional owner of a chunk of ``nbytes`` (candidates from :func:`chunk_candidates`): the
        least-loaded candidate, or the least-loaded rank of the chunk's preferred hosts once that one would
        pass the bound (the chunk then travels within those hosts). Records its load."""
        load = self.load
        r = self._least_of(cands)
        if self.mode == "any" and partial:
            r = self._least()
        elif self.mode == "balanced" and load[r] + nbytes > self.cap:
            n = self._least_of(near)  # near holds cands: never loaded more than r
            r = n if load[n] < load[r] else r
        self.load[r] += nbytes  # its heap entry is now stale: _least refreshes it when it reaches the top
        self._owner.append(r)
        self._sizes.append(nbytes)
        self._near.append(near)
        return r

    def owners(self) -> np.ndarray:
        """Every picked chunk's owner, in pick order. In ``"balanced"`` mode the ranks left above the bound
        first hand chunks to ranks with room (:meth:`_relieve`): only the excess crosses hosts."""
        owner = np.asarray(self._owner, dtype=np.int64)
        if self.mode == "balanced":
            over = sorted(np.nonzero(self.load > self.cap)[0].tolist(), key=lambda r: (-self.load[r], r))
            if over:
                held: dict[int, list[int]] = {r: [] for r in over}
                for i in np.nonzero(np.isin(owner, over))[0].tolist():
                    held[int(owner[i])].append(i)
                for r in over:
                    self._relieve(r, held[r], owner)
        return owner

    def _relieve(self, r: int, chunks: list[int], owner: np.ndarray) -> None:
        """Move chunks of ``r`` (indices in pick order) until it is within the bound: first the smallest
        chunk that alone brings it there, else the largest that fits; each to the least-loaded rank of its
        preferred hosts if it has room, else to the least-loaded rank of the world if that one has room, else
        (no room anywhere) its smallest chunk to the least-loaded rank of the world if that rank then holds
        less than ``r`` did."""
        load, size = self.load, self._sizes
        while load[r] > self.cap and chunks:
            excess = int(load[r]) - self.cap
            g = self._least()
            order = sorted(
                chunks, key=lambda i: (size[i] < excess, size[i] if size[i] >= excess else -size[i], i)
            )
            move = None
            for i in order:
                n = self._least_of(self._near[i])
                dest = n if load[n] + size[i] <= self.cap else g
                if load[dest] + size[i] <= self.cap:
                    move = (i, dest)
                    break
            if move is None:
                i = min(chunks, key=lambda i: (size[i], i))
                if load[g] + size[i] >= load[r]:
                    return
                move = (i, g)
            i, dest = move
            chunks.remove(i)
            owner[i] = dest
            load[r] -= size[i]
            load[dest] += size[i]
            heapq.heappush(self._heap, (int(load[r]), r))  # r's load fell: a fresh entry for it
