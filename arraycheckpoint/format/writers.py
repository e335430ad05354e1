"""The writers of a tensor's chunks (format 7: derived from its layout where the layout determines them).

A save plans one writer per chunk; where every chunk is written by the one rank holding the region that holds
most of it (sharded layouts, flat ranges), the metadata stores ``"writers": "held"`` instead of a list and a
reader derives them with the planner's own code (:func:`arraycheckpoint.planning.flatgrid.held_writers`), so
the metadata grows with ranks and tensors, not with chunks. Format 8: a tensor with many replicated chunks
stores ``"writers": ["cyclic", shift]``: each holder set's chunks go round its holders
(:func:`arraycheckpoint.planning.owners.cyclic_writers`). Other replicated chunks' writers (worst fit) are
listed.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

from ..errors import ArrayCheckpointError, MetadataError

#: The ``writers`` value of a tensor whose writers are derived from its layout (format 7).
HELD = "held"
#: The first item of ``["cyclic", shift]``, the ``writers`` of a tensor whose writers follow the cyclic rule
#: (format 8).
CYCLIC = "cyclic"


class Writers(Sequence):
    """The writer rank of every chunk of a tensor, row-major, held as an int64 array: from the plan of a save,
    or (format 7, ``"writers": "held"``) derived from the tensor's regions and chunk grid on first use
    (:func:`arraycheckpoint.planning.flatgrid.held_writers`, the code the planner ran). ``derived`` says the
    metadata stores no list for it."""

    def __init__(
        self,
        array: Any = None,
        derived: bool = False,
        length: int | None = None,
        derive: Any = None,
        shift: int | None = None,
    ):
        self._array, self.derived, self._derive = array, derived, derive
        self.shift = shift  # derived by the cyclic rule with this shift (format 8); None: "held"
        self._len = len(array) if array is not None else int(length or 0)
        # what the readers ask of every tensor of a layout (which share one Writers), computed once
        self._counts: dict[int, int] | None = None
        self._of_rank: dict[int, Any] = {}

    @property
    def json(self) -> Any:
        """The metadata's ``writers`` value: ``"held"``, ``["cyclic", shift]`` or the list."""
        if not self.derived:
            return list(self)
        return HELD if self.shift is None else [CYCLIC, self.shift]

    @staticmethod
    def derive(
        name: str,
        shape: tuple[int, ...],
        chunk: tuple[int, ...],
        regions: tuple,
        groups: tuple,
        nchunks: int,
        shift: int | None = None,
        cycles: dict[Any, Any] | None = None,
    ) -> Writers:
        """The derived writers of a format-7 tensor (``shift`` None: ``"held"``) or of a format-8 one under
        the cyclic rule (computed on first use; :class:`MetadataError` naming the tensor when its regions do
        not determine them). ``cycles`` keeps each layout's cyclic tables for its other shifts (one metadata's
        tensors of one layout differ only by their shift)."""

        def compute() -> Any:
            from ..planning.flatgrid import held_writers
            from ..planning.groupplan import TensorRule, _regions_of, _rule_tuple
            from ..planning.owners import cycle_of

            key = (shape, chunk, id(regions))  # parsed regions are kept by the parse: one object per value
            cycle = cycles.get(key) if cycles is not None and shift is not None else None
            if cycle is not None:
                return _frozen(cycle.writers(shift), name, nchunks)
            contribs = [
                (groups[g][0], groups[g][1], TensorRule(name, shape, "", 0, _rule_tuple(rule)))
                for g, rule in regions
            ]
            try:
                held = _regions_of(name, contribs)
                unique = sorted(held)  # held_writers checks that they cut the tensor exactly, in linear time
                holders = [sorted(held[b]) for b in unique]
                if shift is None:
                    out = held_writers(shape, chunk, unique, holders)
                else:
                    cycle = cycle_of(shape, chunk, unique, holders)
                    if cycles is not None:
                        cycles[key] = cycle
                    out = cycle.writers(shift)
            except (ArrayCheckpointError, ValueError) as e:
                raise MetadataError(
                    f"metadata: tensor {name!r}: its writers are derived from its regions, but {e}"
                ) from None
            return _frozen(out, name, nchunks)

        return Writers(None, True, nchunks, compute, shift)

    @property
    def array(self) -> Any:
        """Every writer as a read-only int64 numpy array."""
        if self._array is None:
            self._array = self._derive()
        return self._array

    def __len__(self) -> int:
        return self._len

    def counts(self) -> dict[int, int]:
        """``rank -> how many chunks it writes``, ranks ascending (computed once)."""
        if self._counts is None:
            self._counts = _counts(self.array)
        return self._counts

    def of_rank(self, rank: int) -> Any:
        """The chunks (flat indices, ascending, a read-only int array) ``rank`` writes (computed once)."""
        mine = self._of_rank.get(rank)
        if mine is None:
            import numpy as np

            mine = self._of_rank[rank] = np.flatnonzero(self.array == rank)
            mine.flags.writeable = False
        return mine

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return tuple(self.array[i].tolist())
        return int(self.array[i])

    def __iter__(self) -> Iterator[int]:
        return iter(self.array.tolist())

    def count(self, value: Any) -> int:
        return int((self.array == value).sum())

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence):
            return NotImplemented
        return len(self) == len(other) and list(self) == list(other)

    def __hash__(self) -> int:
        return hash(tuple(self))  # equal to the tuple of the same writers, as __eq__ says

    def __repr__(self) -> str:
        kind = "" if not self.derived else "derived, " if self.shift is None else f"cyclic {self.shift}, "
        return f"Writers({kind}{self._len} chunks)"


def _frozen(out: Any, name: str, nchunks: int) -> Any:
    """Derived writers as a read-only int64 array; :class:`MetadataError` naming the tensor when their count is
    not its chunks'."""
    import numpy as np

    if len(out) != nchunks:
        raise MetadataError(f"metadata: tensor {name!r}: {len(out)} derived writers for {nchunks} chunks")
    out = np.ascontiguousarray(out, dtype=np.int64)
    out.flags.writeable = False
    return out


class ReaderBudget:
    """What deriving a checkpoint's writers costs a reader, charged once per distinct derived layout while its
    metadata is parsed, before any is derived: chunks (one int64 each; :data:`MAX_DERIVED_WRITERS` per array,
    :data:`MAX_DERIVED_WRITERS_TOTAL` in all) and ranks visited expanding the layout rules
    (:func:`arraycheckpoint.planning.rules.rule_visits`, :data:`MAX_DERIVED_RANK_VISITS` in all); the planner
    lists the writers past these bounds, so a valid save never meets them. Also the saved regions tools expand
    (:meth:`regions`): once per distinct layout, :data:`MAX_EXPANDED_RANK_VISITS` ranks visited in all."""

    def __init__(self) -> None:
        self.chunks = 0
        self.visits = 0
        self.expanded = 0
        self._regions: dict[tuple[Any, ...], list[tuple[Any, list[int]]]] = {}

    def regions(
        self, name: str, shape: tuple[int, ...], regions: tuple, groups: tuple
    ) -> list[tuple[Any, list[int]]]:
        """The saved regions of the tensor ``name`` and their holders, sorted, expanded from its rules once per
        distinct ``(shape, regions)`` of the checkpoint; :class:`MetadataError` naming the tensor when they are
        malformed, or when the checkpoint's expansions pass the bound (a mesh rule of a few bytes names up to
        4M ranks: repeated with new shapes, a tool listing every tensor's regions would run for hours)."""
        from ..checks.bounds import MAX_EXPANDED_RANK_VISITS
        from ..planning.groupplan import TensorRule, _regions_of, _rule_tuple
        from ..planning.rules import rule_visits

        key = (shape, repr(regions))
        hit = self._regions.get(key)
        if hit is None:
            self.expanded += sum(
                rule_visits(shape, r, groups[g][0].meshes, len(groups[g][1])) for g, r in regions
            )
            if self.expanded > MAX_EXPANDED_RANK_VISITS:
                raise MetadataError(
                    f"metadata: tensor {name!r}: expanding the checkpoint's saved regions visits more than "
                    f"{MAX_EXPANDED_RANK_VISITS} ranks of its layout rules in all; the checkpoint is hostile "
                    "or far beyond what a save plans"
                )
            contribs = [
                (groups[g][0], groups[g][1], TensorRule(name, shape, "", 0, _rule_tuple(rule)))
                for g, rule in regions
            ]
            try:
                hit = self._regions[key] = sorted(_regions_of(name, contribs).items())
            except ArrayCheckpointError as e:
                raise MetadataError(f"metadata: tensor {name!r}: {e}") from None
        return hit

    def charge(self, where: str, nchunks: int, shape: tuple[int, ...], regions: tuple, groups: tuple) -> None:
        """Count one distinct derived layout of the tensor at ``where``; :class:`MetadataError` naming it past
        a bound."""
        from ..checks.bounds import MAX_DERIVED_RANK_VISITS, MAX_DERIVED_WRITERS, MAX_DERIVED_WRITERS_TOTAL
        from ..planning.rules import rule_visits

        if nchunks > MAX_DERIVED_WRITERS:
            raise MetadataError(
                f"metadata: {where}.writers is derived for {nchunks} chunks, above the limit of "
                f"{MAX_DERIVED_WRITERS} (a save lists the writers of such an array)"
            )
        self.chunks += nchunks
        if self.chunks > MAX_DERIVED_WRITERS_TOTAL:
            raise MetadataError(
                f"metadata: {where}.writers is derived, and the checkpoint's derived writers pass "
                f"{MAX_DERIVED_WRITERS_TOTAL} in all (a save lists the writers beyond that)"
            )
        self.visits += sum(rule_visits(shape, r, groups[g][0].meshes, len(groups[g][1])) for g, r in regions)
        if self.visits > MAX_DERIVED_RANK_VISITS:
            raise MetadataError(
                f"metadata: {where}.writers is derived, and deriving the checkpoint's writers visits more than "
                f"{MAX_DERIVED_RANK_VISITS} ranks of its layout rules in all (a save lists the writers beyond "
                "that)"
            )


def _counts(writers: Any) -> dict[int, int]:
    import numpy as np

    ranks, counts = np.unique(np.asarray(writers, dtype=np.int64), return_counts=True)
    return dict(zip(ranks.tolist(), counts.tolist()))


def rank_counts(writers: Sequence[int]) -> dict[int, int]:
    """``rank -> how many chunks it writes`` of a tensor's ``writers`` (a :class:`Writers`, kept there: the
    tensors of one layout share theirs, so a load counts each distinct one once; or a plain sequence)."""
    return writers.counts() if isinstance(writers, Writers) else _counts(writers)


def rank_chunks(writers: Sequence[int], rank: int) -> Any:
    """The chunks (flat indices, ascending) of a tensor that ``rank`` writes (see :func:`rank_counts`)."""
    if isinstance(writers, Writers):
        return writers.of_rank(rank)
    import numpy as np

    return np.flatnonzero(np.asarray(writers, dtype=np.int64) == rank)
