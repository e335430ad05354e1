"""The reference loader and the reshard helpers in one process (the protocol without storage), plus one save."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.data import (
    NumberedSource,
    ReshardableLoader,
    SavedLoaderState,
    TokenBufferLoader,
    range_count,
    split_ranges,
)
from arraycheckpoint.errors import ArrayCheckpointError

SOURCES = [
    NumberedSource("a", 40, ratio=2.0, max_len=11),
    NumberedSource("b", 25, ratio=0.5, min_len=3, max_len=7),
]


def _all() -> np.ndarray:
    return np.sort(np.concatenate([s.all_tokens(i) for i, s in enumerate(SOURCES)]))


def _make(dp_rank: int, dp_size: int, workers: int, background: bool = False) -> TokenBufferLoader:
    return TokenBufferLoader(
        SOURCES,
        seq_len=8,
        dp_rank=dp_rank,
        dp_size=dp_size,
        num_workers=workers,
        prefetch_tokens=5,
        max_ready_batches=3,
        background=background,
    )


def _saved(loaders: list[TokenBufferLoader]) -> SavedLoaderState:
    """What acp.load would hand the loaders: every shard's meta and arrays (the protocol, without storage)."""
    states = [lo.checkpoint_state() for lo in loaders]
    shards = {k: v for st in states for k, v in st.shards.items()}
    shapes = {k: {n: a.shape for n, a in v.arrays.items()} for k, v in shards.items()}
    st = states[0]
    return SavedLoaderState(st.replicated, st.dp_size, st.num_workers, shards, shapes, st.step)


def test_split_ranges_partitions_evenly() -> None:
    pooled = [(3, 10), (20, 21), (30, 30), (40, 47)]
    for parts in range(1, 9):
        pieces = split_ranges(pooled, parts)
        flat = [i for p in pieces for b, e in p for i in range(b, e)]
        assert flat == [i for b, e in pooled for i in range(b, e)]  # order kept, nothing lost or doubled
        counts = [range_count(p) for p in pieces]
        assert max(counts) - min(counts) <= 1
    with pytest.raises(ValueError):
        split_ranges(pooled, 0)


def test_loader_implements_protocol_and_modes_agree() -> None:
    a, b = _make(1, 2, 2, background=False), _make(1, 2, 2, background=True)
    assert isinstance(a, ReshardableLoader)
    xs, ys = list(a), list(b)
    b.close()
    assert len(xs) == len(ys) > 3 and all(np.array_equal(x, y) for x, y in zip(xs, ys))


def _drain_from(state, background: bool) -> list[np.ndarray]:
    shapes = {k: {n: a.shape for n, a in v.arrays.items()} for k, v in state.shards.items()}
    saved = SavedLoaderState(
        state.replicated, state.dp_size, state.num_workers, state.shards, shapes, state.step
    )
    lo = _make(state.dp_rank, state.dp_size, state.num_workers, background=background)
    lo.load_checkpoint_state(saved)
    out = list(lo)
    lo.close()
    return out


@pytest.mark.parametrize("background", [False, True])
def test_prefetched_state_equals_synchronous_state(background: bool) -> None:
    """The state captured ahead (prepare_checkpoint) and the one collected at save time resume identically."""
    lo = _make(0, 1, 3, background=background)
    lo.prepare_checkpoint(5)
    for _ in range(5):
        next(lo)
    prepared = lo.checkpoint_state(5)
    rest = list(lo)
    lo.close()
    lo2 = _make(0, 1, 3, background=background)
    for _ in range(5):
        next(lo2)
    sync = lo2.checkpoint_state()
    lo2.close()
    assert prepared.step == sync.step == 5
    if not background:  # no read-ahead beyond the batch: the two captures are the same bytes
        for key in sync.shards:
            assert prepared.shards[key].meta == sync.shards[key].meta
            assert np.array_equal(prepared.shards[key].arrays["buffer"], sync.shards[key].arrays["buffer"])
    for state in (prepared, sync):
        resumed = _drain_from(state, background)
        assert len(resumed) == len(rest) > 3
        assert all(np.array_equal(x, y) for x, y in zip(resumed, rest))


@pytest.mark.parametrize(
    "old,new", [((4, 2), (2, 3)), ((2, 3), (3, 1)), ((1, 1), (5, 2)), ((3, 2), (3, 1)), ((5, 1), (1, 1))]
)
def test_reshard_exactly_once_in_process(old: tuple[int, int], new: tuple[int, int]) -> None:
    """Consume a few batches at layout ``old``, rebuild at ``new``, drain: every token once."""
    loaders = [_make(r, old[0], old[1]) for r in range(old[0])]
    consumed = [next(lo) for lo in loaders for _ in range(3)]
    saved = _saved(loaders)
    for r in range(new[0]):
        lo = _make(r, new[0], new[1])
        wanted = set(lo.shards_to_load(saved))
        view = SavedLoaderState(
            saved.replicated,
            saved.dp_size,
            saved.num_workers,
            {k: type(v)(v.meta, v.arrays if k in wanted else {}) for k, v in saved.shards.items()},
            saved.array_shapes,
            saved.step,
        )
        lo.load_checkpoint_state(view)
        consumed.extend(lo)
    got = np.sort(np.concatenate(consumed))
    np.testing.assert_array_equal(got, _all())


def test_mismatched_sources_are_refused() -> None:
    saved = _saved([_make(0, 1, 1)])
    other = TokenBufferLoader([NumberedSource("a", 41)], seq_len=8)
    with pytest.raises(ArrayCheckpointError, match="sources"):
        other.shards_to_load(saved)


def test_single_process_save_load_resume(tmp_path) -> None:
    """Through acp.save/acp.load in one process, with the loader mid-stream in its background thread."""
    lo = _make(0, 1, 2, background=True)
    head = list(itertools.islice(lo, 6))
    acp.save(tmp_path / "ck", {"dataloader": lo}, step=6)
    tail = list(lo)
    lo.close()
    lo2 = _make(0, 1, 2, background=True)
    out = acp.load(tmp_path / "ck", {"dataloader": lo2})
    assert out["dataloader"] is lo2 and lo2.consumed == 6
    again = list(lo2)
    assert len(again) == len(tail) and all(np.array_equal(x, y) for x, y in zip(again, tail))
    assert np.array_equal(np.sort(np.concatenate(head + again)), _all())
