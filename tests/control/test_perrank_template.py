"""Per-rank documents whose ranks share one structure are stored as one template plus numeric rows.

Real gloo processes save ``PerRank`` RNG states and plain per-rank scalars (ints, floats with NaN/-0.0/inf and
subnormals, bools, None, an int beyond int64); zarr-python reads the rows bit-exactly; loads at the same, a
smaller and a larger world give every value back bit for bit (the per-rank rule unchanged). A rank whose
template differs (an extra key, a big int that differs) makes every rank fall back to per-rank documents, never
hang. At 1,000 and 10,000 simulated ranks the coordinator's commit bytes and the metadata do not grow with N.
"""

from __future__ import annotations

import json
import math
import os
import random
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint import rng
from arraycheckpoint.engine import engine
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.format import rankdoc
from arraycheckpoint.format.metadata import METADATA_FILE, CheckpointMetadata
from arraycheckpoint.format.perrank import PerRank

CASES = ("agree", "odd_key", "big_differs", "arrays_differ")
PR = "extra_state/~per_rank"


def scalars(rank: int, case: str = "agree") -> dict[str, Any]:
    """Rank ``rank``'s plain per-rank scalars; ``case`` makes rank 1's template differ."""
    s: dict[str, Any] = {
        "step": 1000 + rank,
        "neg": -(2**63) + rank,
        "big": 2**70 + (rank if case == "big_differs" else 0),  # beyond int64: stays in the template
        "flag": rank == 1,
        "none": None,
        "floats": [0.5 + rank, -0.0, math.inf, -math.inf, math.nan, 5e-324 * (rank + 1), 1e308],
        "name": "same on every rank",
        "pair": (rank, True),
        "keys": {3: "x", (1, 2): rank},
    }
    if case == "odd_key" and rank == 1:
        s["extra"] = 1
    return s


def bits(s: dict[str, Any]) -> list[int]:
    return np.asarray(s["floats"], dtype=np.float64).view(np.int64).tolist()


def same(got: dict[str, Any], want: dict[str, Any]) -> None:
    """Bit-exact equality: float bits, and the type of every other leaf."""
    assert bits(got) == bits(want)
    for k, v in want.items():
        if k != "floats":
            assert got[k] == v and type(got[k]) is type(v), (k, got[k], v)


def _arr(rank: int, case: str) -> np.ndarray:
    return np.arange(4 + (case == "arrays_differ" and rank == 1), dtype=np.int32) * 10 + rank


def _draws() -> list[list[float]]:
    return [torch.rand(3).tolist(), np.random.rand(3).tolist(), [random.random() for _ in range(3)]]


def _save(rank: int, world: int, root: str) -> dict:
    torch.manual_seed(10 + rank)
    np.random.seed(20 + rank)
    random.seed(30 + rank)
    np.random.standard_normal()  # numpy's legacy state holds a cached gaussian
    captured = rng.capture()
    modes = {}
    for case in CASES:
        state = {
            "extra_state": {"step": 3, "rng": PerRank(captured), "scalars": PerRank(scalars(rank, case))}
        }
        # rank 1's array is longer: the arrays fall back to ~r<rank>, the template still agrees
        state["extra_state"]["arr"] = PerRank(_arr(rank, case))
        acp.save(f"{root}/{case}", state, step=3)
        modes[case] = engine()._save._last_mode
    return {"modes": modes, "draws": _draws(), "numpy": captured["numpy"]}


def _load(rank: int, world: int, root: str) -> dict:
    out = {}
    for case in CASES:
        identity = PerRank(derive=lambda v, r, s: v)
        state = {"extra_state": {"step": 0, "rng": identity, "scalars": PerRank(), "arr": PerRank()}}
        extra = acp.load(f"{root}/{case}", state)["extra_state"]
        rng.restore(extra["rng"].value)
        out[case] = {
            "draws": _draws(),
            "scalars": extra["scalars"].value,
            "numpy": extra["rng"].value["numpy"],
            "arr": extra["arr"].value,
        }
    return out


def test_template_form_saves_once_and_loads_bit_exactly_at_2_1_and_3_ranks(tmp_path) -> None:
    import zarr

    root = str(tmp_path)
    saved = run_distributed(_save, 2, (root,))
    for case in CASES:
        meta = acp.read_metadata(f"{root}/{case}")
        obj = meta.objects[PR]
        if case == "arrays_differ":  # arrays per rank; one template naming ~rows, resolved to ~r<s>
            assert obj.rows is not None and not any("~rows/" in n for n in meta.tensors)
            assert "extra_state/~r1/2" in meta.tensors and '"extra_state/~rows/2"' in json.dumps(obj.template)
            continue
        if case == "agree":  # one template, no per-rank documents; the plan needed no gather
            assert obj.rows is not None and not obj.per_rank
            assert all(s["modes"][case] == "local" for s in saved)
            text = json.dumps(obj.template, separators=(",", ":"))
            assert "~r0" not in text and '"big":1180591620717411303424' in text
        else:  # one rank's template differs: every rank fell back to per-rank documents, nobody hung
            assert obj.rows is None and sorted(obj.per_rank) == [0, 1]
            assert all(s["modes"][case] == "gather" for s in saved)
            assert not any(n.startswith(PR) for n in meta.tensors)  # no leaf rows
        assert any("~rows/" in n for n in meta.tensors)  # the arrays stay stacked either way
    # zarr-python reads the rows: row r holds rank r's leaves (floats by their bits)
    from arraycheckpoint.zarr import checkpoint_store

    group = zarr.open_group(checkpoint_store(os.path.join(root, "agree")), mode="r")
    ints, floats = np.asarray(group[f"{PR}/~int"][...]), np.asarray(group[f"{PR}/~float"][...])
    template = acp.read_metadata(f"{root}/agree").objects[PR].template
    assert ints.dtype == np.int64 and floats.dtype == np.float64 and ints.shape[0] == floats.shape[0] == 2
    for r in range(2):
        doc = rankdoc.join(template, ints[r], floats[r])
        assert doc["values"][1]["step"] == 1000 + r and doc["values"][1]["neg"] == -(2**63) + r
        assert doc["values"][0]["numpy"]["pos"] == saved[r]["numpy"]["pos"]
        assert -(2**63) + r in ints[r].tolist() and (0.5 + r) in floats[r].tolist()

    for world in (2, 1, 3):
        got = run_distributed(_load, world, (root,))
        for r, g in enumerate(got):
            source = r % 2  # saved ranks take their own values; rank 2 takes saved rank 0's
            for case in CASES:
                same(g[case]["scalars"], scalars(source, case))
                assert g[case]["numpy"]["pos"] == saved[source]["numpy"]["pos"]
                assert bits({"floats": [g[case]["numpy"]["cached_gaussian"]]}) == bits(
                    {"floats": [saved[source]["numpy"]["cached_gaussian"]]}
                )
                assert g[case]["draws"] == saved[source]["draws"]  # identity derive: the source's stream
                assert np.array_equal(g[case]["arr"], _arr(source, case)) and g[case]["arr"].dtype == np.int32


def test_split_and_join_are_exact_inverses() -> None:
    from arraycheckpoint.format import extras

    value = {**scalars(1), "user": {"__leaf__": "i0"}, "f": 2.5, "b": b"\x00\x01"}
    doc, arrays = extras.encode(value, "ns", lambda v: False)
    template, ints, floats = rankdoc.split(doc)
    assert json.dumps(template, allow_nan=False)  # no float left in the template
    assert json.loads(json.dumps(template))["big"] == 2**70  # beyond int64: in the template, exact
    back = extras.decode(rankdoc.join(template, ints, floats), arrays)
    same(back, value)
    assert back["user"] == {"__leaf__": "i0"} and back["b"] == b"\x00\x01"
    payload = np.frombuffer(np.uint64(0x7FF8000000000123).tobytes(), dtype=np.float64)[0]
    t2, i2, f2 = rankdoc.split([float(payload), True, 1, -(2**63), 2**63])
    assert t2[-1] == 2**63 and i2 == [True, 1, -(2**63)]
    row = np.asarray(f2, dtype=np.float64)  # the NaN payload survives the float64 row
    assert row.view(np.uint64)[0] == 0x7FF8000000000123
    assert type(rankdoc.join(t2, np.asarray(i2, dtype=np.int64), row)[1]) is bool


def _rank_save(rank: int, world: int, base: dict, odd: int = -1) -> tuple[list, list]:
    from arraycheckpoint.adapters.base import AdapterOptions
    from arraycheckpoint.stateful import save_items

    own = {**base, "numpy": {**base["numpy"], "pos": rank % 624, "cached_gaussian": rank / 7}}
    value = {
        "rng": PerRank(own),
        "s": PerRank({"step": rank, "odd": rank == odd} if rank != odd else {"x": 1}),
    }
    return save_items("extra_state", value, SimpleNamespace(rank=rank, world_size=world), AdapterOptions())


def _simulate(world: int) -> dict[str, Any]:
    """Every rank's save items, commit status and template digest, and the coordinator's metadata."""
    from arraycheckpoint.engine.coordinate import build_metadata, declare, status_payload
    from arraycheckpoint.planning.groupplan import build_compact_plan
    from arraycheckpoint.planning.items import SaveRequest
    from arraycheckpoint.planning.plan import PlanOptions

    base = rng.capture()
    recv, digests, rows = 0, set(), {}
    statuses: list[dict] = []
    rank0: tuple[list, list] = ([], [])
    picks = {0, 1, world // 2, world - 1}
    for r in range(world):
        tensors, objects = _rank_save(r, world, base)
        request = SaveRequest(tensors, objects, framework="torch")
        payload = status_payload(request, None, {}, r, world)
        recv += len(payload)
        statuses.append(json.loads(payload) if payload else {})
        digests.add(rankdoc.template_digest(objects))
        if r == 0:
            rank0 = (tensors, objects)
        if r in picks:  # the rows this rank writes, and the per-rank document they must give back
            leaf = {}
            for t in tensors:
                if t.name.startswith(PR + "/"):
                    out = np.empty(t.shards[0].box.lengths, dtype=t.dtype)
                    t.shards[0].source.copy_into(out)
                    leaf[t.name.rsplit("~", 1)[1]] = out[0]
            plain = next(o for o in objects if o.name == PR).fallback.value
            rows[r] = (leaf, plain)
    decl = declare(rank0[0], 0)
    plan = build_compact_plan([(decl, tuple(range(world)))], world, PlanOptions())
    meta = build_metadata(plan, SaveRequest(rank0[0], rank0[1], framework="torch"), statuses)
    text = meta.to_json()
    return {"recv": recv, "digests": digests, "text": text, "rows": rows, "meta": meta}


def test_simulated_10000_ranks_commit_and_metadata_do_not_grow_with_n() -> None:
    small, large = _simulate(1000), _simulate(10_000)
    for sim in (small, large):
        assert len(sim["digests"]) == 1  # every rank's template agrees
        parsed = CheckpointMetadata.from_json(sim["text"])
        obj = parsed.objects[PR]
        assert obj.rows is not None and not obj.per_rank
        for r, (leaf, plain) in sim["rows"].items():  # row r rebuilds rank r's document exactly
            doc = rankdoc.join(obj.template, leaf.get("int", ()), leaf.get("float", ()))
            plain = json.loads(json.dumps(plain).replace(f"extra_state/~r{r}/", "extra_state/~rows/"))
            assert doc["values"] == plain["values"]
    # the commit statuses carry no per-rank document: the coordinator receives only the metrics sample
    assert large["recv"] <= small["recv"] * 1.1
    objects = [json.dumps(json.loads(s["text"])["objects"]) for s in (small, large)]
    assert objects[0] == objects[1] and len(objects[0]) < 2000  # one template, whatever N
    # only the arrays' shapes change: each rank writes its own row (nothing travels), so a stacked array's
    # writers follow from its regions (format 7: not listed); everything else is the same size whatever N
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


def test_simulated_rank_with_another_template_disagrees() -> None:
    base = rng.capture()
    digests = {rankdoc.template_digest(_rank_save(r, 100, base, odd=57)[1]) for r in range(100)}
    assert len(digests) == 2  # the agreement's min != max: every rank falls back


def test_hostile_template_metadata_is_refused(tmp_path) -> None:
    acp.save(str(tmp_path / "ck"), {"extra_state": {"s": PerRank(scalars(0))}})
    text = (tmp_path / "ck" / METADATA_FILE).read_text()
    CheckpointMetadata.from_json(text)
    got = acp.load(str(tmp_path / "ck"), {"extra_state": {"s": PerRank()}})["extra_state"]["s"].value
    same(got, scalars(0))

    def broken(fn) -> str:
        d = json.loads(text)
        fn(d["objects"][PR], d["tensors"])
        return json.dumps(d)

    def far_leaf(o, t):
        o["template"]["values"][0]["step"] = {"__leaf__": "i999"}

    def wide_rows(o, t):
        # a self-consistent row array far wider than the template's leaves: a reader would size its
        # buffer from it (64 GiB of int64 per rank here) before any file check
        t[f"{PR}/~int"].update(
            shape=[1, 2**33], chunk_shape=[1, 2**26], inner_chunk_shape=[1, 2**26], writers=[0] * 128
        )

    cases = [
        far_leaf,
        lambda o, t: o["template"]["values"][0].update(step={"__leaf__": "q1"}),
        lambda o, t: o["rows"].update(int="extra_state/nothing"),
        lambda o, t: o["rows"].update(bad="x"),
        lambda o, t: o.update(rows=[1]),
        lambda o, t: o["rows"].pop("float"),
        lambda o, t: t[f"{PR}/~int"].update(dtype="float64"),
        lambda o, t: t[f"{PR}/~int"].pop("rank_rows"),
        wide_rows,
    ]
    for fn in cases:
        with pytest.raises(MetadataError, match=r"objects\['extra_state/~per_rank'\]"):
            CheckpointMetadata.from_json(broken(fn))
    d = json.loads(text)
    d["objects"]["x"] = {"scope": "rank", "per_rank": {"5": 1}}  # a rank outside the world of 1
    with pytest.raises(MetadataError, match="per_rank names a rank outside"):
        CheckpointMetadata.from_json(json.dumps(d))


def test_tools_handle_templates(tmp_path) -> None:
    from arraycheckpoint.tools.common import open_checkpoint
    from arraycheckpoint.tools.diff import diff_checkpoints
    from arraycheckpoint.tools.rename import plan_rename
    from arraycheckpoint.tools.verify import verify

    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    acp.save(a, {"extra_state": {"s": PerRank(scalars(0))}})
    acp.save(b, {"extra_state": {"s": PerRank(scalars(1))}})
    assert verify(a).ok
    assert diff_checkpoints(open_checkpoint(a), open_checkpoint(a)).same
    report = diff_checkpoints(open_checkpoint(a), open_checkpoint(b))
    assert not report.objects  # same template: the leaves differ, in the rows
    assert {t.name for t in report.tensors if t.status != "equal"} == {f"{PR}/~int", f"{PR}/~float"}
    meta, _moved = plan_rename(acp.read_metadata(a), {PR: "extra_state/~moved"})  # rows move with the object
    rows = {"int": "extra_state/~moved/~int", "float": "extra_state/~moved/~float"}
    assert meta.objects["extra_state/~moved"].rows == rows and set(rows.values()) <= set(meta.tensors)
    CheckpointMetadata.from_json(meta.to_json())
