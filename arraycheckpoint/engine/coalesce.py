"""Coalesced ranged reads of packed members on an object store.

A load reads the members of a pack in the order of their offsets (:meth:`.packread.PackedReader.deliver_many`).
On a local file each is a ``pread``; on an object store each was one ranged GET, so a load of many small
tensors sent two requests per tensor (its ``zarr.json`` and its chunk), each costing a round trip. Here the
wanted byte ranges of a pack are merged into spans (:func:`spans`): two ranges merge when the hole between
them is under :data:`GAP` bytes and the span stays within :data:`SPAN_BYTES`; each span is one ranged GET,
issued ahead (tensorstore futures, several at once, across packs, in the order the load consumes them) up to
:data:`AHEAD_BYTES` and :data:`AHEAD_SPANS`; the members are views of the span's bytes (no copy: the bytes
are copied once, into their destination, as a member read alone is).

The numbers: a ranged GET costs a round trip (tens of ms to the first byte on S3) whatever its size, and
reading a hole costs its bytes at the connection's rate: a hole is worth reading instead of a new request
while it takes less time than one, about time-to-first-byte x bandwidth (the rule of Arrow's
``CacheOptions::MakeFromNetworkMetrics``): 1 MiB is 10 ms at 100 MiB/s, at or under one S3 round trip.
Spans stop at 16 MiB, AWS's recommended size of a byte-range GET (its S3 performance guidelines: "8 MB or 16
MB"): large enough that a request's latency is a few percent of its transfer, small enough that several run at
once and a retried request refetches little. At most 64 MiB (and 64 spans) are in flight or held: the memory
a load spends on this beyond what it reads into, whatever the pack's size.

The ranges come from a pack's ZIP central directory, which is untrusted: the load's checks already bound every
member by the pack's size (each member ends before the next one's header and the directory, the pack within
what its arrays can take: :func:`arraycheckpoint.checks.zipdir._parse_zip_directory`), and a span only covers
the ranges it merges and the holes between them, so it never reaches past the last member it serves nor past
``limit`` (the pack's end as the checks found it) nor over :data:`SPAN_BYTES` (a single member larger than that
is read alone, as before). A span read short (the pack changed since the checks) serves the members that lie
wholly inside the bytes that came back (each checked by its CRC as any member is), and only those: each member
reaching past them, and every member of a span refused (the object gone or a range past its end), is then read
alone, and checked as before.
"""

from __future__ import annotations

import bisect
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

import numpy as np

#: the largest hole between two wanted ranges that one span reads through (see the module docstring)
GAP = 1 << 20
#: the most bytes one merged request asks for
SPAN_BYTES = 16 << 20
#: the most bytes of spans issued and not yet consumed (at least one span is always issued)
AHEAD_BYTES = 64 << 20
#: the most spans issued and not yet consumed
AHEAD_SPANS = 64


def spans(
    ranges: Iterable[tuple[int, int]], limit: int | None = None, gap: int = GAP, cap: int = SPAN_BYTES
) -> list[tuple[int, int]]:
    """The ``(start, end)`` spans covering the byte ranges ``ranges`` (``(offset, length)``, in any order):
    ranges closer than ``gap`` bytes merge while the span stays within ``cap`` bytes. A range with a negative
    offset or length, or reaching past ``limit``, is left out (its member is read alone, and refused there);
    a range larger than ``cap`` is a span of its own."""
    out: list[tuple[int, int]] = []
    for offset, length in sorted(ranges):
        end = offset + length
        if offset < 0 or length < 0 or (limit is not None and end > limit):
            continue
        if out:
            start, last = out[-1]
            if offset - last < gap and max(end, last) - start <= cap:
                out[-1] = (start, max(end, last))
                continue
        out.append((offset, end))
    return out


class SpanReader:
    """Merged ranged reads of several objects of one key-value store (``kv``: tensorstore's), issued ahead in
    the order :meth:`read` will ask for them.

    ``plan`` lists, in consumption order, each object (``leaf``) with the byte ranges a load will read of it,
    the object's size as checked (``limit``, or None), and ``(offset, bytes)`` of it already read (or None):
    the ranges those bytes hold are served from them, without a request. :meth:`read` returns a view of the
    bytes of a range a span holds, or None when no span holds it (the caller reads it alone). Spans before the
    one asked for are dropped (the reads go forward), so at most :data:`AHEAD_BYTES` are held."""

    def __init__(
        self,
        kv: Any,
        plan: Sequence[tuple[str, Iterable[tuple[int, int]], int | None, tuple[int, Any] | None]],
        gap: int | None = None,
        cap: int | None = None,
        ahead_bytes: int | None = None,
        ahead_spans: int | None = None,
    ) -> None:
        gap = GAP if gap is None else gap  # the module's values when the load starts (a test may set them)
        cap = SPAN_BYTES if cap is None else cap
        self._kv = kv
        self._order: list[tuple[str, int, int]] = []  # every span, in consumption order
        #: leaf -> (its spans' starts, ends, indices in :attr:`_order`)
        self._index: dict[str, tuple[list[int], list[int], list[int]]] = {}
        #: leaf -> (offset, bytes) of the object already read (the end of a pack its checks fetched)
        self._held: dict[str, tuple[int, np.ndarray]] = {}
        for leaf, ranges, limit, held in plan:
            starts, ends, at = self._index.setdefault(leaf, ([], [], []))
            if held is not None and len(held[1]):
                base, data = self._held[leaf] = (held[0], np.frombuffer(held[1], dtype=np.uint8))
                ranges = [(o, n) for o, n in ranges if not base <= o <= o + n <= base + len(data)]
            for start, end in spans(ranges, limit, gap, cap):
                if starts and start < ends[-1]:  # a leaf planned twice: keep its first spans only
                    continue
                starts.append(start)
                ends.append(end)
                at.append(len(self._order))
                self._order.append((leaf, start, end))
        self._ahead_bytes = AHEAD_BYTES if ahead_bytes is None else ahead_bytes
        self._ahead_spans = AHEAD_SPANS if ahead_spans is None else ahead_spans
        self._next = 0  # the first span not yet issued
        self._live: deque[tuple[int, Any]] = deque()  # (span index, future, then its bytes) issued, in order
        self._live_bytes = 0
        #: GETs issued, and bytes they asked for (what a test or a benchmark reports)
        self.requests = 0
        self.requested_bytes = 0
        self._issue(0)

    def _issue(self, upto: int) -> None:
        """Issue spans in order while within the bounds, and at least up to span ``upto``."""
        order = self._order
        while self._next < len(order) and (
            self._next <= upto
            or (len(self._live) < self._ahead_spans and self._live_bytes < self._ahead_bytes)
        ):
            leaf, start, end = order[self._next]
            if self._live_bytes + end - start > self._ahead_bytes and self._next > upto and self._live:
                return
            self._live.append((self._next, self._kv.read(leaf, byte_range=slice(start, end))))
            self._live_bytes += end - start
            self.requests += 1
            self.requested_bytes += end - start
            self._next += 1

    def read(self, leaf: str, offset: int, nbytes: int) -> np.ndarray | None:
        """Bytes ``[offset, offset + nbytes)`` of ``leaf`` (a read-only view of a span's bytes), or None when
        no span still held or to come holds all of them, or the span was read short or refused."""
        if nbytes < 0 or offset < 0:
            return None
        kept = self._held.get(leaf)
        if kept is not None and kept[0] <= offset and offset + nbytes <= kept[0] + len(kept[1]):
            return kept[1][offset - kept[0] : offset - kept[0] + nbytes]
        found = self._index.get(leaf)
        if found is None:
            return None
        starts, ends, at = found
        k = bisect.bisect_right(starts, offset) - 1
        if k < 0 or offset + nbytes > ends[k]:
            return None
        index = at[k]
        if index < self._next and (not self._live or index < self._live[0][0]):
            return None  # dropped already (a read out of order): read alone
        while self._live and self._live[0][0] < index:  # consumed: reads go forward
            dropped, _ = self._live.popleft()
            self._live_bytes -= self._span_bytes(dropped)
        if not self._live:  # every span issued is behind this one: those between them are never read
            self._next = max(self._next, index)
        self._issue(index)
        _, held = self._live[0]
        if not isinstance(held, np.ndarray):
            try:
                held = self._settle(held)
            except BaseException:
                self.cancel()  # the load fails with this read: the reads issued after it are not wanted
                raise
            self._live[0] = (index, held)
        start = starts[k]
        if offset + nbytes - start > len(held):
            return None  # cut short: the pack is shorter than its checks found (read alone, refused there)
        return held[offset - start : offset - start + nbytes]

    def cancel(self) -> None:
        """Cancel the reads issued and not yet started, and drop every span held (the load failed: a stalled
        store is not left with reads nobody waits for)."""
        for _index, held in self._live:
            if not isinstance(held, np.ndarray):
                held.cancel()
        self._live.clear()
        self._live_bytes = 0
        self._next = len(self._order)

    def _span_bytes(self, index: int) -> int:
        _leaf, start, end = self._order[index]
        return end - start

    @staticmethod
    def _settle(future: Any) -> np.ndarray:
        """The bytes a span's read returned (empty when the object is gone or shorter than the range)."""
        try:
            result = future.result()
        except (
            ValueError
        ) as e:  # tensorstore's errors; a range past the end: the pack was cut since the checks
            if "OUT_OF_RANGE" not in str(e):
                raise
            return np.empty(0, np.uint8)
        if result.state != "value":
            return np.empty(0, np.uint8)
        return np.frombuffer(result.value, dtype=np.uint8)
