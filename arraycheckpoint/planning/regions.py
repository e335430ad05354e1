"""Pure N-D box arithmetic over global tensor coordinates.

A :class:`Box` is a half-open hyper-rectangle ``[offsets, offsets + lengths)``. Nothing here does I/O or knows
about frameworks; planners and adapters build on these functions.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Box:
    """A half-open region of a tensor in global coordinates."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.lengths):
            raise ValueError(f"box rank mismatch: offsets {self.offsets} vs lengths {self.lengths}")

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        """The box covering a whole tensor of ``shape``."""
        return Box((0,) * len(shape), tuple(map(int, shape)))

    @property
    def ndim(self) -> int:
        return len(self.offsets)

    @property
    def stops(self) -> tuple[int, ...]:
        return tuple(o + n for o, n in zip(self.offsets, self.lengths))

    @property
    def volume(self) -> int:
        return math.prod(self.lengths)

    def slices(self, relative_to: Box | None = None) -> tuple[slice, ...]:
        """Index slices of this box, optionally relative to the origin of an enclosing box."""
        base = relative_to.offsets if relative_to is not None else (0,) * self.ndim
        return tuple(slice(o - b, o - b + n) for o, n, b in zip(self.offsets, self.lengths, base))

    def contains(self, other: Box) -> bool:
        return all(
            so <= oo and oo + on <= so + sn
            for so, sn, oo, on in zip(self.offsets, self.lengths, other.offsets, other.lengths)
        )

    def within(self, shape: Sequence[int]) -> bool:
        """True when the box lies inside a tensor of ``shape``."""
        return len(shape) == self.ndim and all(
            o >= 0 and n >= 0 and o + n <= s for o, n, s in zip(self.offsets, self.lengths, shape)
        )

    def to_json(self) -> dict[str, list[int]]:
        return {"offsets": list(self.offsets), "lengths": list(self.lengths)}


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap (empty overlaps count as none)."""
    offsets, lengths = [], []
    for ao, an, bo, bn in zip(a.offsets, a.lengths, b.offsets, b.lengths):
        lo, hi = max(ao, bo), min(ao + an, bo + bn)
        if hi <= lo:
            return None
        offsets.append(lo)
        lengths.append(hi - lo)
    return Box(tuple(offsets), tuple(lengths))


def flat_range_to_boxes(shape: Sequence[int], start: int, stop: int) -> list[Box]:
    """Decompose the row-major flat element range ``[start, stop)`` of a tensor into regular boxes.

    An irregular shard (a 1-D slice of a flattened tensor, as FSDP1 and ZeRO produce) becomes at most
    ``2 * ndim - 1`` boxes: a partial head along the innermost dims, a block of full rows, and a partial tail,
    recursively. Boxes are returned in flat order, so their concatenated ``ravel()`` is the flat slice.

    >>> flat_range_to_boxes((3, 4), 2, 11)
    [Box(offsets=(0, 2), lengths=(1, 2)), Box(offsets=(1, 0), lengths=(1, 4)), Box(offsets=(2, 0), lengths=(1, 3))]
    """
    shape = tuple(int(s) for s in shape)
    total = math.prod(shape)
    if not 0 <= start <= stop <= total:
        raise ValueError(f"flat range [{start}, {stop}) outside a tensor of {total} elements")
    if start == stop:
        return []
    if len(shape) == 0:
        return [Box((), ())]
    return _flat_boxes(shape, (), start, stop)


def _flat_boxes(shape: tuple[int, ...], prefix: tuple[int, ...], start: int, stop: int) -> list[Box]:
    """Recursive helper: ``shape`` is the remaining trailing dims below the fixed leading ``prefix`` indices."""
    ones = (1,) * len(prefix)
    if len(shape) == 1:
        return [Box(prefix + (start,), ones + (stop - start,))]
    row = math.prod(shape[1:])
    first, last = start // row, (stop - 1) // row  # rows touched along shape[0]
    rest = shape[1:]
    zeros = (0,) * len(rest)
    if first == last:
        if start % row == 0 and stop - start == row:
            return [Box(prefix + (first,) + zeros, ones + (1,) + rest)]
        return _flat_boxes(rest, prefix + (first,), start - first * row, stop - first * row)
    boxes: list[Box] = []
    full_lo = first
    if start % row:
        boxes += _flat_boxes(rest, prefix + (first,), start % row, row)
        full_lo = first + 1
    full_hi = last + 1 if stop % row == 0 else last
    if full_hi > full_lo:
        boxes.append(Box(prefix + (full_lo,) + zeros, ones + (full_hi - full_lo,) + rest))
    if stop % row:
        boxes += _flat_boxes(rest, prefix + (last,), 0, stop % row)
    return boxes


def chunk_boxes(shape: Sequence[int], chunk_shape: Sequence[int]) -> Iterator[Box]:
    """Every chunk of a regular grid, clipped to the tensor bounds, in row-major order."""
    if any(s == 0 for s in shape):
        return
    counts = [math.ceil(s / c) for s, c in zip(shape, chunk_shape)]
    for index in itertools.product(*(range(n) for n in counts)):
        offsets = tuple(i * c for i, c in zip(index, chunk_shape))
        lengths = tuple(min(c, s - o) for o, c, s in zip(offsets, chunk_shape, shape))
        yield Box(offsets, lengths)


def chunks_overlapping(box: Box, shape: Sequence[int], chunk_shape: Sequence[int]) -> Iterator[Box]:
    """The grid chunks (clipped to ``shape``) that intersect ``box``."""
    if box.volume == 0:
        return
    ranges = [range(o // c, (o + n - 1) // c + 1) for o, n, c in zip(box.offsets, box.lengths, chunk_shape)]
    for index in itertools.product(*ranges):
        offsets = tuple(i * c for i, c in zip(index, chunk_shape))
        lengths = tuple(min(c, s - o) for o, c, s in zip(offsets, chunk_shape, shape))
        yield Box(offsets, lengths)
