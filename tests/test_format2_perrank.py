"""A format-2 checkpoint with one array per rank (``PerRank`` values, dataloader shards) keeps loading.

The fixture under ``tests/fixtures/format2_perrank/`` was written by a real 2-process save before per-rank
arrays were stacked (``tests/fixtures/make_format2_perrank.py``); its expected values were written by
safetensors. Loaded at 2 ranks every rank gets its own values back bit-exactly and its loader resumes batch for
batch; at 3 ranks the new rank derives from saved rank 0 and the loaders reshard without losing a token.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
from dist import run_distributed
from safetensors.numpy import load_file

import arraycheckpoint as acp

FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "format2_perrank")


def _load(rank: int, world: int, root: str) -> dict[str, object]:
    import torch
    from fixtures.make_format2_perrank import draws, loader

    from arraycheckpoint import rng
    from arraycheckpoint.format.perrank import PerRank

    dl = loader(rank, world)
    state = {"extra_state": {"step": 0, "rng": PerRank(), "counter": PerRank()}, "dataloader": dl}
    out = acp.load(root, state)
    extra = out["extra_state"]
    rng.restore(extra["rng"].value)
    got = draws()
    raw = acp.load(
        root, {"extra_state": {"step": 0, "rng": PerRank(derive=lambda v, r, s: v), "counter": PerRank()}}
    )
    counter = extra["counter"].value
    batches = list(dl)
    dl.close()
    assert isinstance(counter["tokens"], torch.Tensor)
    return {
        "step": extra["step"],
        "draws": got,
        "raw_rng": raw["extra_state"]["rng"].value,
        "counter_rank": counter["rank"],
        "tokens": counter["tokens"].numpy(),
        "batches": batches,
    }


def _copy(tmp_path) -> str:
    dst = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(FIXTURE, "ckpt"), dst)
    return dst


def test_format2_perrank_fixture_is_per_rank_arrays() -> None:
    meta = acp.read_metadata(os.path.join(FIXTURE, "ckpt"))
    assert meta.format_version == 2 and meta.world_size == 2
    assert "extra_state/~r0/0/torch" in meta.tensors and "extra_state/~r1/0/torch" in meta.tensors


def test_format2_perrank_loads_bit_exactly_at_2_ranks(tmp_path) -> None:
    root = _copy(tmp_path)
    expected = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    got = run_distributed(_load, 2, (root,))
    for r, g in enumerate(got):
        assert g["step"] == 7 and g["counter_rank"] == r
        for k, d in enumerate(g["draws"]):
            assert np.array_equal(d, expected[f"rank{r}/draws/{k}"]), (r, k)
        assert np.array_equal(g["tokens"], expected[f"rank{r}/tokens"])
        nxt = sorted(
            (k for k in expected if k.startswith(f"rank{r}/next/")), key=lambda k: int(k.rsplit("/", 1)[1])
        )
        assert len(g["batches"]) == len(nxt) > 0
        for b, k in zip(g["batches"], nxt):
            assert np.array_equal(b, expected[k]), k  # same DP: the resume is batch-for-batch identical


def test_format2_perrank_loads_at_3_ranks(tmp_path) -> None:
    from fixtures.make_format2_perrank import all_tokens

    from arraycheckpoint import rng

    root = _copy(tmp_path)
    expected = load_file(os.path.join(FIXTURE, "expected.safetensors"))
    got = run_distributed(_load, 3, (root,))
    for r in (0, 1):  # saved ranks take their own values
        for k, d in enumerate(got[r]["draws"]):
            assert np.array_equal(d, expected[f"rank{r}/draws/{k}"]), (r, k)
        assert np.array_equal(got[r]["tokens"], expected[f"rank{r}/tokens"])
    # rank 2 had no saved counterpart: saved rank 0's values, RNG reseeded by the default derive
    assert got[2]["counter_rank"] == 0
    assert np.array_equal(got[2]["tokens"], expected["rank0/tokens"])
    rng.restore(rng.derive(got[2]["raw_rng"], 2))
    from fixtures.make_format2_perrank import draws

    for a, b in zip(draws(), got[2]["draws"]):
        assert np.array_equal(a, b)
    assert not np.array_equal(got[2]["draws"][0], expected["rank0/draws/0"])
    # the loaders resharded DP 2 -> 3: the rest of the data, every token exactly once
    rest = np.concatenate([b for g in got for b in g["batches"]])
    seen = np.sort(np.concatenate([expected["consumed"], rest]))
    np.testing.assert_array_equal(seen, all_tokens())
