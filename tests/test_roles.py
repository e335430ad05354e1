"""Multi-role checkpoints (PPO actor/critic): separate committed sub-checkpoints under one root."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.format.metadata import METADATA_FILE
from arraycheckpoint.format.perrank import PerRank
from arraycheckpoint.stateful import list_roles

SHAPES = {"actor": (9, 5), "critic": (7, 6)}


def _full(role: str) -> torch.Tensor:
    shape = SHAPES[role]
    base = 1000.0 if role == "actor" else -1000.0
    return base + torch.arange(shape[0] * shape[1], dtype=torch.float32).view(shape)


def _save_role(rank: int, world: int, root: str, role: str, dim: int) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(_full(role), mesh, [Shard(dim)])  # uneven shards: 9 rows over 2, 6 cols over 4
    state = {"model": {"w": w}, "extra_state": {"role": role, "rank_seen": PerRank(rank)}}
    acp.save(root, state, role=role, step=3 if role == "actor" else 4)


def test_roles_save_and_load_independently(tmp_path) -> None:
    root = str(tmp_path / "ppo")
    run_distributed(_save_role, 2, (root, "actor", 0))
    run_distributed(_save_role, 4, (root, "critic", 1))
    assert list_roles(root) == ["actor", "critic"]
    actor, critic = (
        acp.read_metadata(os.path.join(root, "actor")),
        acp.read_metadata(os.path.join(root, "critic")),
    )
    assert actor.roles == ("actor",) and critic.roles == ("critic",)
    assert (actor.world_size, critic.world_size, actor.step, critic.step) == (2, 4, 3, 4)
    assert (
        actor.tensors["model/w"].shape == SHAPES["actor"]
        and critic.tensors["model/w"].shape == SHAPES["critic"]
    )
    with pytest.raises(acp.CheckpointNotFoundError):
        acp.load(root, {"model": {"w": torch.empty(SHAPES["actor"])}})  # the root itself is no checkpoint

    # corrupt the critic: loading the actor (resharded 2 -> 1) never looks at it
    meta_file = os.path.join(root, "critic", METADATA_FILE)
    good = open(meta_file, "rb").read()
    with open(meta_file, "wb") as f:
        f.write(b"{not json")
    target = {
        "model": {"w": torch.zeros(SHAPES["actor"])},
        "extra_state": {"role": "", "rank_seen": PerRank()},
    }
    out = acp.load(root, target, role="actor")
    assert torch.equal(target["model"]["w"], _full("actor"))
    assert out["extra_state"]["role"] == "actor" and out["extra_state"]["rank_seen"].value == 0
    with pytest.raises(acp.MetadataError):
        acp.load(root, {"model": {"w": torch.zeros(SHAPES["critic"])}}, role="critic")
    with open(meta_file, "wb") as f:
        f.write(good)

    # remove the actor entirely: the critic (resharded 4 -> 3) still loads
    shutil.rmtree(os.path.join(root, "actor"))
    assert list_roles(root) == ["critic"]
    results = run_distributed(_load_critic, 3, (root,))
    assert results == [True, True, True]
    with pytest.raises(acp.CheckpointNotFoundError, match="actor"):
        acp.load(root, {"model": {"w": torch.zeros(SHAPES["actor"])}}, role="actor")


def _load_critic(rank: int, world: int, root: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    w = distribute_tensor(torch.zeros(SHAPES["critic"]), mesh, [Shard(0)])
    out = acp.load(
        root, {"model": {"w": w}, "extra_state": {"role": "", "rank_seen": PerRank()}}, role="critic"
    )
    assert out["extra_state"]["role"] == "critic" and out["extra_state"]["rank_seen"].value == rank
    return bool(torch.equal(w.full_tensor(), _full("critic")))


def test_role_names_are_checked(tmp_path) -> None:
    for bad in ("../x", "a/b", ".hidden", ""):
        with pytest.raises(acp.UnsafeNameError):
            acp.save(tmp_path, {"extra_state": {"a": 1}}, role=bad)
