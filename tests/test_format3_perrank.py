"""A format-3 checkpoint whose per-rank documents are stored per rank keeps loading bit-exactly.

The fixture under ``tests/fixtures/format3_perrank/`` was written by a real 2-process save before per-rank JSON
documents were split into a template and numeric rows (``tests/fixtures/make_format3_perrank.py``); its
expected values were written by safetensors. ``ckpt`` holds per-rank arrays and a DP-2 loader, ``ckpt_stacked``
stacked arrays named ``~r<rank>`` by the documents. Loaded at 2 ranks every rank gets its own values back
bit-exactly (the loader resumes batch for batch); at 3 ranks the new rank derives from saved rank 0.
"""

from __future__ import annotations

import math
import os
import shutil

import numpy as np
import pytest
from dist import run_distributed
from safetensors.numpy import load_file

import arraycheckpoint as acp

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "format3_perrank")


def _load(rank: int, world: int, root: str, with_loader: bool) -> dict[str, object]:
    import torch
    from fixtures.make_format2_perrank import draws, loader

    from arraycheckpoint import rng
    from arraycheckpoint.format.perrank import PerRank

    extra = {"step": 0, "rng": PerRank(), "counter": PerRank(), "scalars": PerRank()}
    dl = loader(rank, world) if with_loader else None
    state = {"extra_state": extra, **({"dataloader": dl} if dl is not None else {})}
    out = acp.load(root, state)["extra_state"]
    rng.restore(out["rng"].value)
    got = draws()
    raw = acp.load(root, {"extra_state": {"step": 0, "rng": PerRank(derive=lambda v, r, s: v)}})
    counter = out["counter"].value
    batches = list(dl) if dl is not None else []
    if dl is not None:
        dl.close()
    assert isinstance(counter["tokens"], torch.Tensor)
    return {
        "step": out["step"],
        "draws": got,
        "raw_rng": raw["extra_state"]["rng"].value,
        "counter_rank": counter["rank"],
        "tokens": counter["tokens"].numpy(),
        "scalars": out["scalars"].value,
        "batches": batches,
    }


def _copy(tmp_path, name: str) -> str:
    dst = str(tmp_path / name)
    shutil.copytree(os.path.join(FIXTURE, name), dst)
    return dst


def _check_scalars(got: dict, source: int, expected: dict) -> None:
    from fixtures.make_format3_perrank import float_bits, scalars

    want = scalars(source)
    assert np.array_equal(float_bits(got), expected[f"rank{source}/scalars"])
    assert math.copysign(1.0, got["floats"][1]) == -1.0
    for k in ("step", "neg", "big", "flag", "none", "name"):
        assert got[k] == want[k] and type(got[k]) is type(want[k]), k


def test_format3_perrank_fixture_is_per_rank_documents() -> None:
    for name, arrays in (("ckpt", "extra_state/~r1/0/torch"), ("ckpt_stacked", "extra_state/~rows/0/torch")):
        meta = acp.read_metadata(os.path.join(FIXTURE, name))
        assert meta.format_version == 3 and meta.world_size == 2
        assert arrays in meta.tensors
        assert sorted(meta.objects["extra_state/~per_rank"].per_rank) == [0, 1]


@pytest.mark.parametrize("name", ["ckpt", "ckpt_stacked"])
def test_format3_perrank_loads_bit_exactly_at_2_ranks(tmp_path, name: str) -> None:
    root = _copy(tmp_path, name)
    expected = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    got = run_distributed(_load, 2, (root, name == "ckpt"))
    for r, g in enumerate(got):
        assert g["step"] == 7 and g["counter_rank"] == r
        for k, d in enumerate(g["draws"]):
            assert np.array_equal(d, expected[f"rank{r}/draws/{k}"]), (r, k)
        assert np.array_equal(g["tokens"], expected[f"rank{r}/tokens"])
        _check_scalars(g["scalars"], r, expected)
        nxt = sorted(
            (k for k in expected if k.startswith(f"rank{r}/next/")), key=lambda k: int(k.rsplit("/", 1)[1])
        )
        if name == "ckpt":
            assert len(g["batches"]) == len(nxt) > 0
            for b, k in zip(g["batches"], nxt):
                assert np.array_equal(b, expected[k]), k


@pytest.mark.parametrize("name", ["ckpt", "ckpt_stacked"])
def test_format3_perrank_loads_at_3_ranks(tmp_path, name: str) -> None:
    from fixtures.make_format2_perrank import all_tokens, draws

    from arraycheckpoint import rng

    root = _copy(tmp_path, name)
    expected = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    got = run_distributed(_load, 3, (root, name == "ckpt"))
    for r in (0, 1):
        for k, d in enumerate(got[r]["draws"]):
            assert np.array_equal(d, expected[f"rank{r}/draws/{k}"]), (r, k)
        assert np.array_equal(got[r]["tokens"], expected[f"rank{r}/tokens"])
        _check_scalars(got[r]["scalars"], r, expected)
    assert got[2]["counter_rank"] == 0  # rank 2: saved rank 0's values, the RNG reseeded
    assert np.array_equal(got[2]["tokens"], expected["rank0/tokens"])
    _check_scalars(got[2]["scalars"], 0, expected)
    rng.restore(rng.derive(got[2]["raw_rng"], 2))
    for a, b in zip(draws(), got[2]["draws"]):
        assert np.array_equal(a, b)
    assert not np.array_equal(got[2]["draws"][0], expected["rank0/draws/0"])
    if name == "ckpt":  # the loaders resharded DP 2 -> 3: every token exactly once
        rest = np.concatenate([b for g in got for b in g["batches"]])
        seen = np.sort(np.concatenate([expected["consumed"], rest]))
        np.testing.assert_array_equal(seen, all_tokens())
