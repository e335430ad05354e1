"""Real megatron-core GPT models on CPU over gloo: save under one TP/PP/DP layout, load under others.

Every comparison reassembles each parameter (and Adam's exp_avg/exp_avg_sq) into its full global tensor from
every rank's ShardedTensors and compares bit-exactly with the source, whose values are a distinct function
of (key, global index). The target models start from other random weights, checked to differ before loading.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from dist import run_distributed  # noqa: E402
from megatron_helpers import (  # noqa: E402
    assemble,
    assert_equal_tensors,
    build_gpt,
    fill_model,
    local_shards,
    make_optimizer,
    optimizer_shards,
    optimizer_steps,
    value_of,
)


# ----------------------------------------------------------------------------------------- rank bodies
def load_layout(rank: int, world: int, path: str, tp: int, pp: int) -> tuple:
    import arraycheckpoint as acp

    model = build_gpt(tp, pp, seed=100 + rank)
    opt = make_optimizer(model)
    before = local_shards(model)
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {}})
    assert out["model"] is model
    return before, local_shards(model), optimizer_shards(model, opt), optimizer_steps(opt), out["extra_state"]


def load_single_and_mismatch(rank: int, world: int, path: str) -> tuple:
    import arraycheckpoint as acp
    from arraycheckpoint.errors import StateMismatchError

    result = load_layout(rank, world, path, 1, 1)

    def mismatch(model) -> str:
        """The StateMismatchError's message of a strict load into ``model`` ("" where it loads)."""
        try:
            acp.load(path, {"model": model})
        except StateMismatchError as e:
            return str(e)
        return ""

    message = mismatch(build_gpt(1, 1, seed=5, num_layers=2))
    # stored keys no rank loads: the output layer
    unloaded = mismatch(build_gpt(1, 1, seed=6, post_process=False))
    return result, message, unloaded


def tp2pp2_and_back(rank: int, world: int, path: str, path2: str, path3: str) -> tuple:
    from megatron.core import parallel_state as ps

    import arraycheckpoint as acp

    first = load_layout(rank, world, path, 2, 2)
    model = build_gpt(2, 2, seed=300 + rank)
    fill_model(model, salt=7)
    acp.save(path2, {"model": model}, framework="megatron")
    back = build_gpt(2, 1, seed=200 + rank)  # 4 ranks: TP=2, PP=1, DP=2
    before = local_shards(back)
    acp.load(path2, {"model": back}, framework="megatron")
    after = local_shards(back)
    acp.save(path3, {"model": back}, framework="megatron")
    return first, before, after, ps.get_data_parallel_rank()


# ----------------------------------------------------------------------------------------- tests
def _check_load(results: list, source: tuple) -> None:
    _, model, optim = source
    before = assemble([r[0] for r in results], replicas_agree=False)
    assert all(not np.array_equal(before[k], model[k]) for k in model), (
        "targets must start from other weights"
    )
    assert_equal_tensors(assemble([r[1] for r in results]), model)
    assert_equal_tensors(assemble([r[2] for r in results]), optim)
    assert {s for r in results for s in r[3]} == {1.0}
    assert all(r[4] == {"iteration": 7} for r in results)


def test_metadata_names_and_replicas(tp2_checkpoint: tuple) -> None:
    import arraycheckpoint as acp

    path, model, optim = tp2_checkpoint
    meta = acp.read_metadata(path)
    assert meta.framework == "megatron"
    assert {f"model/{k}" for k in model} <= set(meta.tensors)
    assert {f"optimizer/{k}" for k in optim} <= set(meta.tensors)
    qkv = meta.tensors["model/decoder.layers.self_attention.linear_qkv.weight"]
    assert qkv.shape == (4, 96, 32)  # stacked layers first, TP-split rows reassembled
    # a TP-replicated layernorm is reported by TP rank 0 only (rank 1 holds replica_id (0, 1, 0))
    ln = meta.tensors["model/decoder.layers.self_attention.linear_qkv.layer_norm_weight"]
    assert {s.rank for s in ln.shards} == {0}
    # one sharded object per (key, offset), stored by the main replica
    objs = [n for n in meta.objects if n.startswith("model/decoder.layers.mlp.linear_fc2._extra_state/")]
    assert sorted(objs) == [f"model/decoder.layers.mlp.linear_fc2._extra_state/shard_{i}_4" for i in range(4)]
    assert all(list(meta.objects[n].per_rank) == [0] for n in objs)


def test_tp2_to_tp1_pp2(tp2_checkpoint: tuple) -> None:
    _check_load(run_distributed(load_layout, 2, (tp2_checkpoint[0], 1, 2)), tp2_checkpoint)


def test_tp2_to_single_process_and_strict_mismatch(tp2_checkpoint: tuple) -> None:
    [(result, message, unloaded)] = run_distributed(load_single_and_mismatch, 1, (tp2_checkpoint[0],))
    _check_load([result], tp2_checkpoint)
    assert "model/decoder.layers.mlp.linear_fc2.weight" in message and "[4, 32, 128]" in message
    assert "checkpoint keys no rank loads" in unloaded and "model/output_layer.weight" in unloaded, unloaded


def test_tp2_to_tp2_pp2_and_back_with_dp(tp2_checkpoint: tuple, tmp_path) -> None:
    import arraycheckpoint as acp

    path2, path3 = str(tmp_path / "tp2pp2"), str(tmp_path / "tp2dp2")
    results = run_distributed(tp2pp2_and_back, 4, (tp2_checkpoint[0], path2, path3))
    _check_load([r[0] for r in results], tp2_checkpoint)
    salted = {k: value_of(k, v.shape, 7) for k, v in tp2_checkpoint[1].items()}
    before = assemble([r[1] for r in results], replicas_agree=False)
    assert all(not np.array_equal(before[k], salted[k]) for k in salted)
    assert_equal_tensors(assemble([r[2] for r in results]), salted)
    # TP=2/PP=1 on 4 ranks has DP=2: every replica is declared and each region is written once, by a
    # writer chosen among its replicas, so the writes spread over both data-parallel groups
    dp0 = {rank for rank, r in enumerate(results) if r[3] == 0}
    assert len(dp0) == 2
    meta = acp.read_metadata(path3)
    writers = set()
    for name, tm in meta.tensors.items():
        assert {s.rank for s in tm.shards} <= dp0, name  # credited to the lowest holder
        writers |= set(tm.writers)
    assert writers - dp0, "no data-parallel replica outside DP rank 0 wrote anything"
