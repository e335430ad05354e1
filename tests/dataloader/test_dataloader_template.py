"""A dataloader's shard index whose ranks share one structure is one template plus numeric rows.

Real gloo processes save a reshardable loader whose per-shard ``meta`` holds ints, floats (NaN, -0.0, inf,
subnormals), bools, strings, None and an int beyond int64: the commit statuses carry no per-rank index, the
metadata holds one template, and loads at the same, fewer and more DP ranks hand every saved shard's meta and
arrays to the loader bit for bit. A rank whose index differs in structure makes every rank fall back to
per-rank indexes, never hang. At 1,000 and 10,000 simulated ranks the coordinator's commit bytes and the
metadata do not grow with N.
"""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.data import LoaderState, SavedLoaderState, ShardState
from arraycheckpoint.data.checkpoint import save_items, saved_state
from arraycheckpoint.engine import engine
from arraycheckpoint.format import rankdoc
from arraycheckpoint.format.metadata import CheckpointMetadata

WORKERS = 2
INDEX = "dataloader/~shards"


def shard_meta(d: int, w: int, odd: bool = False, extra: bool = False) -> dict[str, Any]:
    """DP shard ``(d, w)``'s JSON: numbers differ per shard, strings do not (``odd``: only finite floats,
    ``extra``: and another key)."""
    meta: dict[str, Any] = {
        "cursor": d * 100 + w,
        "epoch": 3,
        "seed": 2**40 + d,
        "neg": -(2**63) + d,
        "big": 2**70,  # beyond int64: stays in the template (equal on every rank)
        "frac": [0.1 * (d + 1), -0.0, math.inf, math.nan, 5e-324 * (w + 1)],
        "done": d == 1,
        "source": "corpus-a",
        "none": None,
    }
    if odd:  # per-rank documents are plain JSON: no NaN or inf (the template's rows hold any float)
        meta["frac"] = [0.1 * (d + 1), -0.0, 5e-324 * (w + 1)]
    if extra:
        meta["extra"] = 1
    return meta


def same_meta(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-exact: float bits, and the type of every other leaf."""
    bits = [np.asarray(x["frac"], dtype=np.float64).view(np.int64).tolist() for x in (got, want)]
    assert bits[0] == bits[1]
    for k, v in want.items():
        if k != "frac":
            assert got[k] == v and type(got[k]) is type(v), (k, got[k], v)


class MetaLoader:
    """Per (dp rank, worker): the JSON above, a position array and a buffer whose length varies by DP rank."""

    def __init__(self, dp_rank: int, dp_size: int, odd_rank: int = -1) -> None:
        self.dp_rank, self.dp_size, self.odd_rank = dp_rank, dp_size, odd_rank
        self.loaded: dict[tuple[int, int], tuple[dict, dict]] = {}

    @staticmethod
    def arrays(d: int, w: int) -> dict[str, np.ndarray]:
        return {
            "pos": np.arange(3, dtype=np.int64) * 1000 + d * 10 + w,
            "buf": np.arange(d + 2, dtype=np.float32) / (w + 3),  # shapes differ: stored per DP shard
        }

    def meta(self, d: int, w: int) -> dict[str, Any]:
        return shard_meta(d, w, odd=self.odd_rank >= 0, extra=d == self.odd_rank)

    def checkpoint_state(self, step: int | None = None) -> LoaderState:
        d = self.dp_rank
        shards = {(d, w): ShardState(self.meta(d, w), self.arrays(d, w)) for w in range(WORKERS)}
        return LoaderState({"seq": 8, "paths": ["a", "b"]}, d, self.dp_size, WORKERS, shards, step)

    def shards_to_load(self, saved: SavedLoaderState) -> list[tuple[int, int]]:
        return saved.ordered_keys()  # every saved shard: a resharding loader merges or splits them

    def load_checkpoint_state(self, saved: SavedLoaderState) -> None:
        for key, st in saved.shards.items():
            assert saved.array_shapes[key] == {a: v.shape for a, v in st.arrays.items()}
            self.loaded[key] = (st.meta, dict(st.arrays))


def _save(rank: int, world: int, root: str, odd_rank: int) -> dict[str, Any]:
    from arraycheckpoint.engine import coordinate

    sent: list[dict] = []
    inner = coordinate.status_payload

    def spy(*args: Any) -> bytes:
        payload = inner(*args)
        sent.append(json.loads(payload) if payload else {})
        return payload

    coordinate.status_payload = spy
    try:
        acp.save(root, {"dataloader": MetaLoader(rank, world, odd_rank)}, step=7)
    finally:
        coordinate.status_payload = inner  # the pool's worker runs later bodies
    return {"objects": [s.get("objects", {}) for s in sent]}  # what this rank sent the coordinator


def _load(rank: int, world: int, root: str) -> dict:
    loader = MetaLoader(rank, world)
    acp.load(root, {"dataloader": loader})
    return loader.loaded


def _check_loaded(got: list[dict], saved_world: int, odd_rank: int = -1) -> None:
    for loaded in got:
        assert sorted(loaded) == [(d, w) for d in range(saved_world) for w in range(WORKERS)]
        for (d, w), (meta, arrays) in loaded.items():
            same_meta(meta, MetaLoader(0, 1, odd_rank).meta(d, w))
            want = MetaLoader.arrays(d, w)
            assert sorted(arrays) == sorted(want)
            for name, a in want.items():
                assert arrays[name].dtype == a.dtype and arrays[name].tobytes() == a.tobytes()


def test_agreeing_indexes_commit_no_per_rank_document_and_reload_at_4_2_and_6(tmp_path) -> None:
    root = str(tmp_path / "ck")
    saved = run_distributed(_save, 4, (root, -1))
    assert all(INDEX not in o for s in saved for o in s["objects"])  # no rank sent its index
    meta = acp.read_metadata(root)
    obj = meta.objects[INDEX]
    assert obj.rows is not None and not obj.per_rank and set(obj.rows) == {"int", "float"}
    text = json.dumps(obj.template)
    assert "shard_" not in text and '"corpus-a"' in text and str(2**70) in text  # rank-independent
    assert meta.tensors[obj.rows["int"]].shape[0] == 4
    assert "dataloader/shard_3_1/buf" in meta.tensors  # buffers of different lengths: per DP shard
    for world in (4, 2, 6):
        _check_loaded(run_distributed(_load, world, (root,)), 4)
    # a loader reading the saved layout directly needs the rows
    state = saved_state(meta, "dataloader", _reader(root, meta))
    same_meta(state.shards[(2, 1)].meta, shard_meta(2, 1))


def _reader(root: str, meta: CheckpointMetadata) -> Any:
    eng = engine()
    storage, url, _ = eng.read_metadata(root)
    return lambda targets: eng.load(storage, url, meta, targets)


def test_an_index_of_another_structure_makes_every_rank_fall_back(tmp_path) -> None:
    root = str(tmp_path / "ck")
    saved = run_distributed(_save, 3, (root, 1), timeout=120)  # DP rank 1's meta has another key
    # nobody hung: every rank took the per-rank path and sent its index at commit
    assert all(any(INDEX in o for o in s["objects"]) for s in saved)
    meta = acp.read_metadata(root)
    obj = meta.objects[INDEX]
    assert obj.rows is None and sorted(obj.per_rank) == [0, 1, 2]
    assert "shard_1_0" in obj.per_rank[1]["shards"]["1_0"]["arrays"]["pos"]  # today's per-rank form
    assert not any(n.startswith(INDEX) for n in meta.tensors)  # no leaf rows
    _check_loaded(run_distributed(_load, 2, (root,)), 3, odd_rank=1)


def test_meta_that_looks_like_a_leaf_stays_per_rank(tmp_path) -> None:
    class Tagged(MetaLoader):
        def checkpoint_state(self, step: int | None = None) -> LoaderState:
            state = super().checkpoint_state(step)
            state.shards[(0, 0)].meta["tag"] = {"__leaf__": "i0", "__float__": "nan"}
            state.shards[(0, 1)].meta["tag"] = {"__float__": "nan"}
            return state

    root = str(tmp_path / "ck")
    acp.save(root, {"dataloader": Tagged(0, 1, odd_rank=5)})  # finite floats: per-rank JSON
    assert acp.read_metadata(root).objects[INDEX].rows is None
    loader = MetaLoader(0, 1)
    acp.load(root, {"dataloader": loader})
    assert loader.loaded[(0, 1)][0]["tag"] == {"__float__": "nan"}  # back as it was, not as a float


def _simulate(world: int, odd: int = -1) -> dict[str, Any]:
    """Every rank's items, commit status and template digest, and the coordinator's metadata."""
    from arraycheckpoint.engine.coordinate import build_metadata, declare, status_payload
    from arraycheckpoint.planning.groupplan import build_compact_plan
    from arraycheckpoint.planning.items import SaveRequest
    from arraycheckpoint.planning.plan import PlanOptions

    recv, digests, statuses = 0, set(), []
    rank0: tuple[list, list] = ([], [])
    rows: dict[int, dict[str, np.ndarray]] = {}
    for r in range(world):
        tensors, objects = save_items("dataloader", MetaLoader(r, world, odd), 7, r, world)
        payload = status_payload(SaveRequest(tensors, objects, framework="torch"), None, {}, r, world)
        recv += len(payload)
        statuses.append(json.loads(payload) if payload else {})
        digests.add(rankdoc.template_digest(objects))
        rank0 = (tensors, objects) if r == 0 else rank0
        if r in (0, world // 2, world - 1):  # the rows this rank writes
            for t in tensors:
                if t.name.startswith(INDEX + "/~"):
                    out = np.empty(t.shards[0].box.lengths, dtype=t.dtype)
                    t.shards[0].source.copy_into(out)
                    rows.setdefault(r, {})[t.name.rsplit("~", 1)[1]] = out
    plan = build_compact_plan([(declare(rank0[0], 0), tuple(range(world)))], world, PlanOptions())
    meta = build_metadata(plan, SaveRequest(rank0[0], rank0[1], framework="torch"), statuses)
    return {"recv": recv, "digests": digests, "text": meta.to_json(), "rows": rows}


def test_simulated_10000_ranks_commit_and_metadata_do_not_grow_with_n() -> None:
    small, large = _simulate(1000), _simulate(10_000)
    for sim, world in ((small, 1000), (large, 10_000)):
        assert len(sim["digests"]) == 1
        obj = CheckpointMetadata.from_json(sim["text"]).objects[INDEX]
        assert obj.rows is not None and not obj.per_rank
        for r, leaf in sim["rows"].items():  # row r rebuilds rank r's index
            doc = rankdoc.documents(obj, {k: np.repeat(v, world, axis=0) for k, v in leaf.items()}, world)[r]
            assert doc["dp_rank"] == r and sorted(doc["workers"]) == ["0", "1"]
            same_meta(doc["workers"]["1"]["meta"], shard_meta(r, 1))
    # no commit status carries an index: the coordinator receives only the metrics sample
    assert large["recv"] <= small["recv"] * 1.1
    index = [json.dumps(json.loads(s["text"])["objects"][INDEX]) for s in (small, large)]
    assert index[0] == index[1] and len(index[0]) < 2000  # one template, whatever N
    # each rank writes its own rows (no bytes travel): a stacked array's writers follow from its regions
    # (format 7: not listed, derived by readers), nothing grows with N
    docs = [json.loads(s["text"]) for s in (small, large)]
    for doc, n in zip(docs, (1000, 10_000)):
        for name, t in doc["tensors"].items():
            if t.get("rank_rows"):
                assert t["writers"] == "held", name
        parsed = CheckpointMetadata.from_json(json.dumps(doc))
        for name, t in parsed.tensors.items():
            if t.rank_rows:
                assert list(t.writers) == list(range(n)), name
    assert len(json.dumps(docs[1])) - len(json.dumps(docs[0])) < 4096


def test_simulated_rank_with_another_structure_disagrees() -> None:
    digests = {
        rankdoc.template_digest(save_items("dataloader", MetaLoader(r, 50, 17), 7, r, 50)[1])
        for r in range(50)
    }
    assert len(digests) == 2  # the agreement's min != max: every rank falls back
