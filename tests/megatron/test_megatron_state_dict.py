"""Sharded state dicts given directly (no module): every megatron leaf kind, on 2 gloo ranks.

Saved with ``save_async`` (the source is zeroed after the snapshot). ShardedTensor with a ``flattened_range`` (irregular flat slices straddling rows, resplit differently on load),
a stacked tensor (``prepend_axis_num``), a bfloat16 tensor, a tensor with ``allow_shape_mismatch`` (loaded
into a larger global shape), a replicated tensor (saved once), ShardedObjects per offset (one
holding a tensor), a replicated ShardedObject, a LocalNonpersistentObject and a plain common value.
"""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from dist import run_distributed  # noqa: E402
from megatron_helpers import value_of  # noqa: E402

SAVE_SPLIT = (0, 10, 24)  # flat element ranges of a [4, 6] tensor on ranks 0 and 1
LOAD_SPLIT = (0, 17, 24)


def _sharded_dict(rank: int, split: tuple[int, ...], filled: bool) -> dict:
    import torch
    from megatron.core.dist_checkpointing.mapping import (
        LocalNonpersistentObject,
        ShardedObject,
        ShardedTensor,
    )

    full = torch.from_numpy(value_of("w", (4, 6))).reshape(-1)
    start, stop = split[rank], split[rank + 1]
    flat = ShardedTensor("w", None, torch.float32, (4, 6), (4, 6), (0, 0), None, 0, 0)
    # megatron < 0.14 (and distributed optimizers) emit flat slices; 0.16 refuses them in the constructor
    flat.data = full[start:stop].clone() if filled else torch.zeros(stop - start)
    flat.flattened_range = slice(start, stop)
    layer = torch.from_numpy(value_of("s", (2, 3))[rank]).clone() if filled else torch.zeros(3)
    stacked = ShardedTensor.from_rank_offsets("s", layer, (0, rank, 2), replica_id=0, prepend_axis_num=1)
    rep_data = torch.from_numpy(value_of("r", (5,))).clone() if filled else torch.zeros(5)
    replicated = ShardedTensor.from_rank_offsets("r", rep_data, replica_id=rank)
    bf16 = torch.from_numpy(value_of("b", (2, 4))).to(torch.bfloat16)[rank].clone()
    half = ShardedTensor.from_rank_offsets(
        "b", bf16 if filled else torch.zeros(4, dtype=torch.bfloat16), (0, rank, 2)
    )
    rows = 3 if filled else 4  # saved as [6, 2], loaded as [8, 2] (a vocabulary padded for another TP size)
    padded = (
        torch.from_numpy(value_of("v", (6, 2)))[rank * 3 : rank * 3 + 3].clone()
        if filled
        else torch.zeros(4, 2)
    )
    vocab = ShardedTensor.from_rank_offsets("v", padded, (0, rank, 2), allow_shape_mismatch=True)
    assert vocab.local_shape == (rows, 2)
    rng = {"seed": 10 + rank, "state": torch.arange(3) + rank} if filled else None
    return {
        "w": flat,
        "layers": [stacked],
        "r": replicated,
        "b": half,
        "v": vocab,
        "rng": ShardedObject("rng", rng, (2,), (rank,), replica_id=0),
        "shared": ShardedObject("shared", "same" if filled else None, (1,), (0,), replica_id=rank),
        "local": LocalNonpersistentObject(123 if filled else 456),
        "iteration": 7 if filled else 0,
    }


def save_then_load(rank: int, world: int, path: str) -> dict:
    import torch

    import arraycheckpoint as acp

    source = _sharded_dict(rank, SAVE_SPLIT, True)
    fut = acp.save_async(path, {"model": source})  # framework detected from the leaves
    fut.staged.result()
    source["w"].data.zero_()  # after the snapshot: must not reach the checkpoint
    source["b"].data.zero_()
    fut.result()
    target = _sharded_dict(rank, LOAD_SPLIT, False)
    out = acp.load(path, {"model": target})["model"]
    start, stop = LOAD_SPLIT[rank], LOAD_SPLIT[rank + 1]
    assert out["w"] is target["w"].data  # loaded in place
    assert torch.equal(out["w"], torch.from_numpy(value_of("w", (4, 6))).reshape(-1)[start:stop])
    assert torch.equal(out["layers"][0], torch.from_numpy(value_of("s", (2, 3))[rank]))
    assert torch.equal(out["r"], torch.from_numpy(value_of("r", (5,))))
    want = torch.zeros(8, 2)
    want[:6] = torch.from_numpy(value_of("v", (6, 2)))
    assert torch.equal(out["v"], want[rank * 4 : rank * 4 + 4])  # the overlap loaded, padding rows kept
    assert out["b"].dtype == torch.bfloat16
    assert torch.equal(out["b"], torch.from_numpy(value_of("b", (2, 4))).to(torch.bfloat16)[rank])
    assert out["rng"]["seed"] == 10 + rank and torch.equal(out["rng"]["state"], torch.arange(3) + rank)
    assert target["rng"].data["seed"] == 10 + rank  # ShardedObject.data set too
    assert out["shared"] == "same"
    assert out["local"] == 456  # never stored: the local value
    assert out["iteration"] == 7
    return {"w": out["w"].numpy().copy(), "objects": sorted(acp.read_metadata(path).objects)}


def test_sharded_dict_round_trip_with_every_leaf_kind(tmp_path) -> None:
    import arraycheckpoint as acp

    path = str(tmp_path / "ckpt")
    results = run_distributed(save_then_load, 2, (path,))
    assert np.array_equal(np.concatenate([r["w"] for r in results]), value_of("w", (4, 6)).reshape(-1))
    meta = acp.read_metadata(path)
    assert meta.framework == "megatron"
    assert meta.tensors["model/w"].shape == (4, 6)
    assert meta.tensors["model/s"].shape == (2, 3)
    assert [s.rank for s in meta.tensors["model/r"].shards] == [0]  # replica 1 never reported
    assert meta.objects["model/shared/shard_0_1"].per_rank == {0: "same"}
    assert set(meta.objects["model/rng/shard_1_2"].per_rank) == {1}
    assert "model/local" not in str(sorted(meta.objects)) and "model/local" not in meta.tensors
    assert meta.objects["model/~common"].value == {"iteration": 7}


def test_megatron_core_refuses_flattened_range_tensors() -> None:
    """megatron-core 0.16 cannot write ``flattened_range`` state: its ShardedTensor refuses one, so its
    DistributedOptimizer's ``fully_sharded_model_space`` format (what ``sharded_state_dict`` still picks when
    no ``distrib_optim_sharding_type`` is given) fails where it builds them, with ``dataclasses.replace`` as
    here. The adapter's ``flattened_range`` support (the round trip above) serves older releases and
    hand-built dicts; the formats 0.16 writes are tested with its real optimizer in
    ``tests/cuda/test_cuda_megatron_distopt_dp.py`` (CUDA only). Should a release accept them again, this
    fails: then test that release's optimizer too."""
    import dataclasses

    import torch
    from megatron.core.dist_checkpointing.core import CheckpointingException
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    st = ShardedTensor.from_rank_offsets("w", torch.zeros(4, 6))
    with pytest.raises(CheckpointingException, match="flattened_range is not supported"):
        dataclasses.replace(st, data=torch.zeros(5), flattened_range=slice(0, 5))
