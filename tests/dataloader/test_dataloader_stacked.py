"""Dataloader shard arrays that agree in shape across ranks are stored as one stacked array per worker.

A loader whose per-shard state is fixed-size arrays (positions, counters) is saved by 3 real gloo ranks: zarr
sees ONE array per (worker, array) holding every rank's row; loading at DP 2 and DP 4 hands every saved
shard's arrays to the loader bit-exactly (it reshards from them). Arrays that differ make every rank fall back
to one array per DP shard.
"""

from __future__ import annotations

import numpy as np
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.data import LoaderState, SavedLoaderState, ShardState

WORKERS = 2
INDEX = ["~shards/~int"]  # the shard index's numbers (no float in its meta)


class PositionLoader:
    """A minimal reshardable loader: per (dp rank, worker) a position array and a seen-count matrix."""

    def __init__(self, dp_rank: int, dp_size: int, grow: bool = False) -> None:
        self.dp_rank, self.dp_size, self.grow = dp_rank, dp_size, grow
        self.loaded: dict[tuple[int, int], dict[str, np.ndarray]] = {}
        self.saved_dp = 0

    def arrays(self, d: int, w: int) -> dict[str, np.ndarray]:
        n = 4 if self.grow and d == 1 else 3  # ``grow``: DP rank 1's positions have another element
        return {
            "pos": np.arange(n, dtype=np.int64) * 1000 + d * 10 + w,
            "seen": np.full((2, 2), d + w / 8, dtype=np.float32),
        }

    def checkpoint_state(self, step: int | None = None) -> LoaderState:
        shards = {
            (self.dp_rank, w): ShardState({"cursor": self.dp_rank * 100 + w}, self.arrays(self.dp_rank, w))
            for w in range(WORKERS)
        }
        return LoaderState({"seq": 8}, self.dp_rank, self.dp_size, WORKERS, shards, step)

    def shards_to_load(self, saved: SavedLoaderState) -> list[tuple[int, int]]:
        return saved.ordered_keys()  # every saved shard (a resharding loader merges them)

    def load_checkpoint_state(self, saved: SavedLoaderState) -> None:
        self.saved_dp = saved.dp_size
        for key, st in saved.shards.items():
            assert st.meta["cursor"] == key[0] * 100 + key[1]
            assert {a: saved.array_shapes[key][a] for a in st.arrays} == {
                a: v.shape for a, v in st.arrays.items()
            }
            self.loaded[key] = dict(st.arrays)


def _save(rank: int, world: int, root: str, grow: bool) -> None:
    acp.save(root, {"dataloader": PositionLoader(rank, world, grow)}, step=5)


def _load(rank: int, world: int, root: str) -> dict:
    loader = PositionLoader(rank, world)
    acp.load(root, {"dataloader": loader})
    return {"saved_dp": loader.saved_dp, "loaded": loader.loaded}


def _zarr_arrays(root: str) -> dict[str, np.ndarray]:
    import zarr

    def walk(g, prefix=""):
        out = {f"{prefix}{n}": np.asarray(a[...]) for n, a in g.arrays()}
        for n, sub in g.groups():
            out.update(walk(sub, f"{prefix}{n}/"))
        return out

    from arraycheckpoint.zarr import checkpoint_store

    return walk(zarr.open_group(checkpoint_store(root), mode="r")["dataloader"])


def _check_loaded(got: list[dict], saved_world: int, grow: bool = False) -> None:
    ref = PositionLoader(0, saved_world, grow)
    for g in got:
        assert g["saved_dp"] == saved_world
        assert sorted(g["loaded"]) == [(d, w) for d in range(saved_world) for w in range(WORKERS)]
        for (d, w), arrays in g["loaded"].items():
            for name, expected in ref.arrays(d, w).items():
                assert arrays[name].dtype == expected.dtype and np.array_equal(arrays[name], expected), (
                    d,
                    w,
                    name,
                )


def test_loader_arrays_stack_into_one_array_per_worker_and_reshard(tmp_path) -> None:
    root = str(tmp_path / "ck")
    run_distributed(_save, 3, (root, False))
    arrays = _zarr_arrays(root)
    assert sorted(arrays) == [f"~rows/{w}/{a}" for w in range(WORKERS) for a in ("pos", "seen")] + INDEX
    # the shard index is one template; row r holds rank r's DP rank and cursors (arraycheckpoint.format.rankdoc)
    assert arrays["~shards/~int"].tolist() == [[d, d * 100, d * 100 + 1] for d in range(3)]
    ref = PositionLoader(0, 3)
    for w in range(WORKERS):
        for d in range(3):  # row d is DP rank d's array (one rank per DP rank here)
            assert np.array_equal(arrays[f"~rows/{w}/pos"][d], ref.arrays(d, w)["pos"])
            assert np.array_equal(arrays[f"~rows/{w}/seen"][d], ref.arrays(d, w)["seen"])
    _check_loaded(run_distributed(_load, 2, (root,)), 3)
    _check_loaded(run_distributed(_load, 4, (root,)), 3)


def test_loader_arrays_that_differ_fall_back_to_one_array_per_shard(tmp_path) -> None:
    root = str(tmp_path / "ck")
    run_distributed(_save, 3, (root, True), timeout=120)
    arrays = _zarr_arrays(root)
    # the arrays differ, the index still agrees: its template names both forms
    per_shard = [f"shard_{d}_{w}/{a}" for d in range(3) for w in range(WORKERS) for a in ("pos", "seen")]
    assert sorted(arrays) == sorted(per_shard) + INDEX
    _check_loaded(run_distributed(_load, 2, (root,)), 3, grow=True)


def test_one_process_round_trip_keeps_each_array_shape(tmp_path) -> None:
    """World 1: the stacked array [1, *shape] has the row's shape plus one; the loader gets the row's shape."""
    root = str(tmp_path / "ck")
    _save(0, 1, root, False)
    want = [f"~rows/{w}/{a}" for w in range(WORKERS) for a in ("pos", "seen")] + INDEX
    assert sorted(_zarr_arrays(root)) == want
    _check_loaded([_load(0, 1, root)], 1)
