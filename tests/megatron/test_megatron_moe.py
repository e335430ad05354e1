"""A real megatron-core mixture-of-experts GPT on CPU over gloo: expert-parallel boxes become mesh rules.

Saved at TP=2 x EP=2 (4 ranks, DP 2) and loaded at TP=1 x EP=4: every parameter reassembled from every
rank's ShardedTensors is bit-identical to the source. Every rank declares the same rules on megatron's
process grids (:mod:`arraycheckpoint.adapters.torch.megatron_grid`), so the save plans as one layout group
and the metadata holds mesh rules, not one box per rank (the expert weights' boxes depend on the EP rank).
"""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from dist import run_distributed  # noqa: E402
from megatron_helpers import assemble, assert_equal_tensors, build_moe, fill_model, local_shards  # noqa: E402


def save_moe(rank: int, world: int, path: str) -> list:
    import arraycheckpoint as acp

    model = build_moe(2, 2, seed=rank)
    fill_model(model)
    acp.save(path, {"model": model}, framework="megatron")
    return local_shards(model)


def load_moe(rank: int, world: int, path: str) -> tuple:
    import arraycheckpoint as acp

    model = build_moe(1, 4, seed=50 + rank)
    before = local_shards(model)
    acp.load(path, {"model": model})
    return before, local_shards(model)


def test_moe_saved_at_tp2_ep2_loads_at_ep4_with_rules(tmp_path) -> None:
    import arraycheckpoint as acp

    path = str(tmp_path / "moe")
    want = assemble(run_distributed(save_moe, 4, (path,)))
    assert any("experts" in k for k in want)
    meta = acp.read_metadata(path)
    assert len(meta.layout_groups) == 1  # every rank declared the same rules: nothing was gathered
    kinds = {n: {rule[0] for _g, rule in t.regions} for n, t in meta.tensors.items() if t.regions}
    experts = [n for n in kinds if "experts" in n]
    assert experts and all(kinds[n] == {"mesh"} for n in experts), kinds
    assert not any("boxes" in k for k in kinds.values()), kinds
    got = run_distributed(load_moe, 4, (path,))
    assert assemble([b for b, _a in got], replicas_agree=False).keys() == want.keys()
    assert_equal_tensors(assemble([a for _b, a in got]), want)


def save_many_experts(rank: int, world: int, path: str) -> list:
    import arraycheckpoint as acp

    model = build_moe(1, 2, seed=rank, num_layers=8, experts=16)
    fill_model(model)
    acp.save(path, {"model": model}, framework="megatron")
    return local_shards(model)


def load_many_experts(rank: int, world: int, path: str) -> list:
    import arraycheckpoint as acp

    model = build_moe(2, 2, seed=50 + rank, num_layers=8, experts=16)
    acp.load(path, {"model": model})
    return local_shards(model)


def test_replicated_expert_writers_by_rule_load_bit_exactly(tmp_path) -> None:
    """8 layers x 16 experts at EP 2 over 4 ranks (expert DP 2): each stacked expert weight has 128 chunks,
    (fc1: 256, its SwiGLU halves) each held by two expert data-parallel replicas; the metadata stores their writers as the cyclic rule
    (format 8), each rank writes a quarter of them, and the checkpoint loads bit-exactly at TP 2 x EP 2
    (expert TP 2: every expert weight cut in halves, no expert replicas)."""
    import json
    import os

    import numpy as np

    import arraycheckpoint as acp

    path = str(tmp_path / "moe")
    want = assemble(run_distributed(save_many_experts, 4, (path,)))
    with open(os.path.join(path, ".acp", "metadata.json")) as f:
        doc = json.load(f)
    experts = [n for n in doc["tensors"] if "experts.experts" in n]
    assert experts and all(doc["tensors"][n]["writers"][0] == "cyclic" for n in experts), experts
    meta = acp.read_metadata(path)
    for n in experts:
        counts = np.bincount(np.asarray(list(meta.tensors[n].writers)), minlength=4)
        assert counts.sum() >= 128 and counts.max() - counts.min() <= 1, (n, counts)  # fc1: two halves
    assert_equal_tensors(assemble(run_distributed(load_many_experts, 4, (path,))), want)
