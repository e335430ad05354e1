"""Pure helpers for merging and splitting dataloader shards when the DP size or worker count changes.

The rule the reference loader follows (and a user's loader can reuse):

* **read offsets**: per source, every saved shard's not-yet-read index ranges are pooled in saved global order
  (DP rank major, then worker) and cut into ``K'`` contiguous pieces of (nearly) equal sample count, one per new
  shard (``K' = new_dp_size * new_num_workers``); the first ``remainder`` pieces get one extra sample;
* **buffers** (samples read but not consumed): saved shard ``k`` (global order) goes whole to new shard
  ``k % K'``; several buffers landing on one shard are concatenated in saved order.

Both are partitions, so every unread or buffered sample lands on exactly one new shard.
"""

from __future__ import annotations

from collections.abc import Sequence

Range = tuple[int, int]  # half-open [begin, end) sample indices of one source


def range_count(ranges: Sequence[Sequence[int]]) -> int:
    """Number of sample indices in half-open ``ranges``."""
    return sum(int(e) - int(b) for b, e in ranges)


def split_ranges(pooled: Sequence[Sequence[int]], parts: int) -> list[list[Range]]:
    """Cut ``pooled`` (ordered, disjoint ranges) into ``parts`` contiguous pieces of nearly equal count.

    Piece ``j`` holds the items ``[floor(j*n/parts), floor((j+1)*n/parts))`` of the concatenated ranges, so the
    sizes differ by at most one. Empty ranges are dropped.
    """
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    items = [(int(b), int(e)) for b, e in pooled if int(e) > int(b)]
    total = sum(e - b for b, e in items)
    bounds = [j * total // parts for j in range(parts + 1)]
    out: list[list[Range]] = [[] for _ in range(parts)]
    cursor = 0  # items consumed before the current range
    for b, e in items:
        n = e - b
        lo, hi = cursor, cursor + n
        for j in range(parts):
            s, t = max(lo, bounds[j]), min(hi, bounds[j + 1])
            if s < t:
                out[j].append((b + s - cursor, b + t - cursor))
        cursor = hi
    return out


def buffer_owner(saved_flat_index: int, new_parts: int) -> int:
    """The new shard that receives saved shard ``saved_flat_index``'s buffered samples."""
    return saved_flat_index % new_parts


def sources_of_new_shard(new_flat_index: int, saved_parts: int, new_parts: int) -> list[int]:
    """Saved shards (global order) whose buffers go to new shard ``new_flat_index``."""
    return [k for k in range(saved_parts) if buffer_owner(k, new_parts) == new_flat_index]
