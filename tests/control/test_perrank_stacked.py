"""PerRank arrays whose shape and dtype agree across ranks are stored as one stacked array [N, *shape].

Real gloo processes save; zarr-python (an independent reader) checks that one array per slot holds every
rank's row bit-exactly; loads at other world sizes keep the per-rank rule (own row, else derived from saved
rank ``r % N``). A rank whose rows differ makes every rank fall back to per-rank arrays, never hang.
"""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint import rng
from arraycheckpoint.engine import engine
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata
from arraycheckpoint.format.perrank import PerRank
from arraycheckpoint.testing import chunk_files


def _draws() -> list[list[float]]:
    return [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]


def _save(rank: int, world: int, root: str, odd_rank: int = -1, saves: int = 1) -> dict:
    torch.manual_seed(10 + rank)
    np.random.seed(20 + rank)
    random.seed(30 + rank)
    captured = rng.capture()
    n = 5 if rank == odd_rank else 4
    tokens = torch.arange(n, dtype=torch.int64) * 100 + rank
    state = {
        "model": {"w": torch.arange(6.0).view(3, 2)},
        "extra_state": {
            "step": 3,
            "rng": PerRank(captured),
            "counter": PerRank({"rank": rank, "tokens": tokens}),
        },
    }
    modes = []
    for i in range(saves):  # a second save of the same structure reuses the cached plan
        acp.save(f"{root}{i or ''}", state, step=3)
        modes.append(engine()._save._last_mode)
    return {
        "modes": modes,
        "draws": _draws(),
        "torch": captured["torch"].copy(),
        "python": captured["python"]["state"].copy(),
        "numpy": captured["numpy"]["key"].copy(),
        "tokens": tokens.numpy(),
    }


def _load(rank: int, world: int, root: str) -> dict:
    def tag(value, r, source):
        return {**value, "derived_for": r, "from": source}

    state = {"extra_state": {"step": 0, "rng": PerRank(), "counter": PerRank(derive=tag)}}
    extra = acp.load(root, state)["extra_state"]
    rng.restore(extra["rng"].value)
    counter = dict(extra["counter"].value)
    counter["tokens"] = counter["tokens"].tolist()
    raw = acp.load(
        root, {"extra_state": {"step": 0, "rng": PerRank(derive=lambda v, r, s: v), "counter": PerRank()}}
    )
    return {"draws": _draws(), "counter": counter, "raw_rng": raw["extra_state"]["rng"].value}


def _arrays(root: str) -> dict[str, np.ndarray]:
    """Every array under ``extra_state/`` as zarr-python reads it."""
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    group = zarr.open_group(checkpoint_store(root), mode="r")["extra_state"]
    return {n: np.asarray(a[...]) for n, a in _walk(group)}


def _walk(group) -> list:
    out = [(n, a) for n, a in group.arrays()]
    for g, sub in group.groups():
        out.extend((f"{g}/{n}", a) for n, a in _walk(sub))
    return out


def _chunk_files(root: str, name: str) -> int:
    """Stored chunk files of ``name``: in its directory, or its chunk members when it is packed."""
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    if os.path.isdir(os.path.join(root, name)):
        return len(chunk_files(os.path.join(root, name)))
    return zarr.open_array(checkpoint_store(root), path=name, mode="r").nchunks_initialized


def test_three_ranks_store_one_stacked_array_per_slot_and_load_at_2_and_4(tmp_path) -> None:
    root = str(tmp_path / "ck")
    saved = run_distributed(_save, 3, (root,))
    assert all(s["modes"] == ["local"] for s in saved)  # identical declarations: each rank planned alone
    arrays = _arrays(root)  # zarr-python's view of every array under extra_state/
    assert sorted(arrays) == [
        "~per_rank/~float",  # the documents' numeric leaves (arraycheckpoint.format.rankdoc)
        "~per_rank/~int",
        "~rows/0/numpy/key",
        "~rows/0/python/state",
        "~rows/0/torch",
        "~rows/1/tokens",
    ]
    for r, s in enumerate(saved):  # row r is rank r's value, bit for bit
        assert np.array_equal(arrays["~rows/0/torch"][r], s["torch"])
        assert np.array_equal(arrays["~rows/0/python/state"][r], s["python"])
        assert np.array_equal(arrays["~rows/0/numpy/key"][r], s["numpy"])
        assert np.array_equal(arrays["~rows/1/tokens"][r], s["tokens"])
    assert arrays["~rows/0/torch"].shape == (3, 5056)
    meta = acp.read_metadata(root)
    for name in ("~rows/0/torch", "~rows/1/tokens"):  # each rank writes its own row: no bytes travel
        assert _chunk_files(root, f"extra_state/{name}") == 3
        assert meta.tensors[f"extra_state/{name}"].writers == (0, 1, 2)
    assert all(t.rank_rows for n, t in meta.tensors.items() if "~rows" in n)
    assert meta.objects["extra_state/~per_rank"].rows is not None  # one template for every rank

    shrunk = run_distributed(_load, 2, (root,))
    for r in (0, 1):
        assert shrunk[r]["draws"] == saved[r]["draws"]
        assert shrunk[r]["counter"] == {"rank": r, "tokens": saved[r]["tokens"].tolist()}
    grown = run_distributed(_load, 4, (root,))
    for r in (0, 1, 2):  # saved ranks take their own rows
        assert grown[r]["draws"] == saved[r]["draws"]
        assert grown[r]["counter"]["tokens"] == saved[r]["tokens"].tolist()
    # rank 3 has no saved row: saved rank 3 % 3 = 0's value through derive (RNG reseeded, custom derive used)
    assert grown[3]["counter"] == {
        "rank": 0,
        "tokens": saved[0]["tokens"].tolist(),
        "derived_for": 3,
        "from": 0,
    }
    assert np.array_equal(np.asarray(grown[3]["raw_rng"]["torch"]), saved[0]["torch"])
    rng.restore(rng.derive(grown[3]["raw_rng"], 3))
    assert _draws() == grown[3]["draws"]
    assert grown[3]["draws"] not in [s["draws"] for s in saved]


def test_a_rank_whose_rows_differ_makes_every_rank_save_per_rank_arrays(tmp_path) -> None:
    """Rank 1's counter has 5 elements, the others 4: every rank falls back (twice: the second save runs on
    the cached fallback plan), nothing hangs, and each rank's values load back."""
    root = str(tmp_path / "ck")
    saved = run_distributed(_save, 3, (root, 1, 2), timeout=120)
    assert all(s["modes"] == ["gather", "cached"] for s in saved)
    for path in (root, root + "1"):
        meta = acp.read_metadata(path)
        names = sorted(n for n in meta.tensors if n.startswith("extra_state/~r"))
        assert not any("~rows" in n for n in names)
        assert names == sorted(
            f"extra_state/~r{r}/{x}"
            for r in range(3)
            for x in ("0/numpy/key", "0/python/state", "0/torch", "1/tokens")
        )
        arrays = _arrays(path)
        for r, s in enumerate(saved):
            assert np.array_equal(arrays[f"~r{r}/1/tokens"], s["tokens"])
            assert np.array_equal(arrays[f"~r{r}/0/torch"], s["torch"])
    loaded = run_distributed(_load, 3, (root + "1",))
    for r in range(3):
        assert loaded[r]["draws"] == saved[r]["draws"]
        assert loaded[r]["counter"]["tokens"] == saved[r]["tokens"].tolist()


def test_stacked_marker_is_checked_against_the_world_size(tmp_path) -> None:
    """Hostile metadata: ``rank_rows`` on an array whose leading dimension is not the world size is refused."""
    acp.save(str(tmp_path / "ck"), {"extra_state": {"r": PerRank(np.arange(4))}})
    text = (tmp_path / "ck" / METADATA_FILE).read_text()
    doc = json.loads(text)
    assert doc["tensors"]["extra_state/~rows/0"]["rank_rows"] is True
    CheckpointMetadata.from_json(text)
    got = acp.load(str(tmp_path / "ck"), {"extra_state": {"r": PerRank()}})["extra_state"]["r"].value
    assert got.shape == (4,) and np.array_equal(got, np.arange(4))  # world 1: row 0, without the rank dim
    for bad in ({"world_size": 2}, {"rank_rows": 1}, {"rank_rows": "yes"}):
        d = json.loads(text)
        if "world_size" in bad:
            d.update(bad)
        else:
            d["tensors"]["extra_state/~rows/0"].update(bad)
        with pytest.raises(MetadataError, match="rank_rows"):
            CheckpointMetadata.from_json(json.dumps(d))


def test_simulated_10000_ranks_declare_one_rule_and_write_bounded_files() -> None:
    """The real save path (``save_items`` -> ``declare``) at 10,000 simulated ranks: a PerRank RNG state is the
    same declaration on every rank (each plans alone, no gather), 3 arrays and 2 rows of numeric leaves,
    each rank writing its own rows, files under per-rank packs bounded by bytes plus ranks; the
    fallback would be one distinct declaration per rank."""
    import math
    from types import SimpleNamespace

    from test_groupplan import count_files

    from arraycheckpoint.adapters.base import AdapterOptions
    from arraycheckpoint.engine.coordinate import declare
    from arraycheckpoint.format import perrank
    from arraycheckpoint.planning.groupplan import build_compact_plan, rank_plan
    from arraycheckpoint.planning.plan import PlanOptions
    from arraycheckpoint.stateful import save_items

    world, state = 10_000, rng.capture()
    decls, fallbacks = [], []
    for r in (0, 1, 4321, world - 1):
        tensors, _ = save_items(
            "extra_state",
            {"rng": PerRank(state)},
            SimpleNamespace(rank=r, world_size=world),
            AdapterOptions(),
        )
        decls.append(declare(tensors, r).to_json())
        fallbacks.append(declare(perrank.fall_back(tensors), r).to_json())
    assert all(d == decls[0] for d in decls) and len(decls[0]["tensors"]) == 5  # 3 arrays, 2 leaf rows
    assert len({json.dumps(f) for f in fallbacks}) == 4  # per-rank arrays: every rank's declaration differs
    decl = declare(
        save_items(
            "extra_state",
            {"rng": PerRank(state)},
            SimpleNamespace(rank=0, world_size=world),
            AdapterOptions(),
        )[0],
        0,
    )
    options = PlanOptions()
    plan = build_compact_plan([(decl, tuple(range(world)))], world, options)
    total = sum(math.prod(t.shape) * t.itemsize for t in decl.tensors)
    assert all(d.layout.shape[0] == world for d in plan.tensors.values())
    for d in plan.tensors.values():  # every rank writes its own row (no bytes travel) into its packs
        assert d.writers.tolist() == list(range(world))
    # files under per-rank packs: bounded by bytes plus ranks (one pack per rank), not ranks x arrays
    assert count_files(plan, options.min_chunk_bytes) <= total // options.min_chunk_bytes + world
    # every rank's row is written once: the writers' chunks cover each array, each from the rows' pieces
    writers = {r for d in plan.tensors.values() for r in d.writers}
    by_rank = {r: rank_plan(plan, r).writes for r in writers}  # each rank's plan once, not once per array
    for name, d in plan.tensors.items():
        writes = [w for r in set(d.writers) for w in by_rank[r] if w.name == name]
        assert sum(w.chunk.volume for w in writes) == math.prod(d.layout.shape)
        assert all(sum(p.box.volume for p in w.pieces) == w.chunk.volume for w in writes)
