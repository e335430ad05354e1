"""Dataloader checkpoints across real processes: exactly-once under DP resharding, bit-identical resume."""

from __future__ import annotations

import numpy as np
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.data import NumberedSource, TokenBufferLoader, decode_tokens

SOURCES = [
    NumberedSource("corpus/web", 120, ratio=3.0, min_len=1, max_len=13),
    NumberedSource("corpus/code", 70, ratio=1.0, min_len=2, max_len=9),
]
SEQ = 16


def _all_tokens() -> np.ndarray:
    return np.sort(np.concatenate([s.all_tokens(i) for i, s in enumerate(SOURCES)]))


def _loader(rank: int, world: int, workers: int, background: bool = True) -> TokenBufferLoader:
    return TokenBufferLoader(
        SOURCES,
        seq_len=SEQ,
        dp_rank=rank,
        dp_size=world,
        num_workers=workers,
        prefetch_tokens=7,
        max_ready_batches=3,
        background=background,
    )


def _phase(
    rank: int,
    world: int,
    root: str,
    workers: int,
    load_from: str | None,
    steps: int | None,
    save_to: str | None,
    prefetch: bool,
    tp: int = 1,
) -> list[np.ndarray]:
    """One phase of a run; with ``tp > 1``, ``tp`` consecutive ranks share a DP rank (tensor-parallel peers)
    and only the first of them reports its batches (the peers see the same ones)."""
    loader = _loader(rank // tp, world // tp, workers)
    state = {"dataloader": loader, "extra_state": {"phase_world": world}}
    if load_from is not None:
        acp.load(load_from, state)
    start = loader.consumed
    out = []
    if prefetch and steps is not None:
        loader.prepare_checkpoint(start + steps)
    for batch in loader:
        out.append(batch)
        if steps is not None and len(out) == steps:
            break
    if save_to is not None:
        acp.save(save_to, state, step=loader.consumed)
    loader.close()
    return out if rank % tp == 0 else []


def test_exactly_once_across_dp4_dp2_dp3(tmp_path) -> None:
    """DP=4 (2 workers) -> save -> DP=2 (3 workers, TP=2: 4 ranks) -> save -> DP=3 (1 worker) to the end:
    every token is consumed exactly once."""
    import zarr

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    p1 = run_distributed(_phase, 4, (str(tmp_path), 2, None, 3, a, True))
    meta = acp.read_metadata(a)
    assert sorted(n for n in meta.tensors if n.startswith("dataloader/shard_")) == [
        f"dataloader/shard_{d}_{w}/buffer" for d in range(4) for w in range(2)
    ]
    assert meta.objects["dataloader"].value["dp_size"] == 4
    index = meta.objects["dataloader/~shards"]  # one template: every rank's index has one structure
    assert index.rows is not None and not index.per_rank and index.template["dp_rank"] == {"__leaf__": "i0"}
    # TP peers save one DP shard between them: its state must be the same on both, so they capture it where
    # the reader produces the step (prepare_checkpoint); a synchronous snapshot of a background reader holds
    # whatever each peer's reader has read ahead, and peers that read ahead differently disagree (PlanError)
    p2 = run_distributed(_phase, 4, (str(tmp_path), 3, a, 5, b, True, 2))
    meta = acp.read_metadata(b)
    assert meta.objects["dataloader"].value["dp_size"] == 2
    from arraycheckpoint.zarr import checkpoint_store

    ints = np.asarray(zarr.open_group(checkpoint_store(b), mode="r")["dataloader/~shards/~int"][...])
    assert ints[:, 0].tolist() == [0, 0, 1, 1]  # every rank indexed its shards: its DP rank leads its row
    shards = {n: t for n, t in meta.tensors.items() if n.startswith("dataloader/shard_")}
    assert sorted(shards) == [f"dataloader/shard_{d}_{w}/buffer" for d in range(2) for w in range(3)]
    assert all(len({s.rank for s in t.shards}) == 1 for t in shards.values())  # TP peers' copies written once
    p3 = run_distributed(_phase, 3, (str(tmp_path), 1, b, None, None, False))
    consumed = [t for phase in (p1, p2, p3) for rank in phase for t in rank]
    assert all(len(x) == SEQ for p in (p1, p2) for r in p for x in r)  # mid-run batches are full
    p2 = [r for i, r in enumerate(p2) if i % 2 == 0]
    got = np.sort(np.concatenate(consumed))
    expected = _all_tokens()
    assert got.size == expected.size, (got.size, expected.size)
    np.testing.assert_array_equal(got, expected)  # the multiset: nothing lost, nothing twice
    # and at the sample level: every (source, sample) id appears, each with all of its positions exactly once
    src, sample, _pos = decode_tokens(got)
    ids = src * 10_000 + sample
    assert len(np.unique(ids)) == sum(s.num_samples for s in SOURCES)
    # every phase actually consumed data on every rank (the run exercised all three layouts)
    assert all(len(r) > 0 for p in (p1, p2, p3) for r in p) and len(p2) == 2


def _interrupted(rank: int, world: int, root: str) -> dict[str, list[np.ndarray]]:
    """The reference (uninterrupted) run, and two runs cut at different steps: one prefetched, one not."""
    ref = _loader(rank, world, 2)
    out = {"reference": list(ref)}
    ref.close()
    for name, steps, prefetch in (("prefetched", 4, True), ("synchronous", 7, False)):
        out[name] = _phase(rank, world, root, 2, None, steps, f"{root}/{name}", prefetch)
    return out


def _resumed(rank: int, world: int, root: str) -> dict[str, list[np.ndarray]]:
    return {
        name: _phase(rank, world, root, 2, f"{root}/{name}", None, None, False)
        for name in ("prefetched", "synchronous")
    }


def test_same_dp_resume_is_bit_identical(tmp_path) -> None:
    """Unchanged DP=2 x 2 workers: resumed batches equal an uninterrupted run's, batch for batch."""
    first = run_distributed(_interrupted, 2, (str(tmp_path),))
    rest = run_distributed(_resumed, 2, (str(tmp_path),))
    for rank in range(2):
        reference = first[rank]["reference"]
        assert len(reference) > 12
        for name in ("prefetched", "synchronous"):
            resumed = first[rank][name] + rest[rank][name]
            assert len(resumed) == len(reference), name
            for i, (x, y) in enumerate(zip(resumed, reference)):
                assert np.array_equal(x, y), f"{name}: rank {rank} batch {i} differs"
