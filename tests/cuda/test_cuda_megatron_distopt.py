"""Megatron's DistributedOptimizer (CUDA only) saved through its own ``sharded_state_dict()`` with
``distrib_optim_sharding_type="fully_reshardable"`` at world size 1 on the GPU, then loaded on CPU at TP=2 on two
gloo ranks (another layout), bit-exact. One GPU allows no more: a DP>1 or TP>1 DistributedOptimizer save needs
one device per NCCL rank."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from dist import run_distributed
from nccl1 import run_nccl_world1

pytest.importorskip("megatron.core")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "megatron"))

STATES = ("param", "exp_avg", "exp_avg_sq")


def _records(sts) -> list[tuple]:
    out = []
    for key, st in sts:
        lengths = (1,) * st.prepend_axis_num + tuple(st.local_shape)
        data = st.data.detach().cpu().clone().numpy().reshape(lengths)
        out.append((key, tuple(st.global_shape), tuple(st.global_offset), lengths, data))
    return out


def _distopt_save_body(path: str) -> tuple:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron_helpers import build_gpt, fill_model

    import arraycheckpoint as acp

    gpt = build_gpt(1, 1, seed=0, glu=False)
    fill_model(gpt)
    gpt.cuda()
    ddp = DistributedDataParallel(
        config=gpt.config,
        ddp_config=DistributedDataParallelConfig(use_distributed_optimizer=True),
        module=gpt,
    )
    opt = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=1e-2, use_distributed_optimizer=True), [ddp]
    )
    torch.manual_seed(3)
    for _ in range(2):
        for p in ddp.parameters():
            p.main_grad.copy_(torch.randn_like(p))
        opt.step()
    model_sd = gpt.sharded_state_dict()
    opt_sd = opt.sharded_state_dict(model_sd, metadata={"distrib_optim_sharding_type": "fully_reshardable"})
    fut = acp.save_async(path, {"model": model_sd, "optimizer": opt_sd}, framework="megatron")
    fut.staged.result()
    fut.result()
    sts = [(st.key, st) for group in opt_sd["param_state"].values() for st in group.values()]
    model = [(st.key, st) for st in model_sd.values() if isinstance(st, ShardedTensor)]
    return _records(model), _records(sts)


def _load_tp2_body(rank: int, world: int, path: str) -> tuple:
    import dataclasses

    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron_helpers import build_gpt

    import arraycheckpoint as acp

    model = build_gpt(2, 1, seed=10 + rank, glu=False)
    targets = {}
    for st in model.sharded_state_dict().values():
        if isinstance(st, ShardedTensor):
            for state in STATES:
                key = f"optimizer.state.{state}.{st.key}"
                where = ".".join(str(o) for o in st.global_offset)  # stacked layers share a key
                targets[f"{key}@{where}"] = dataclasses.replace(
                    st, key=key, data=torch.full_like(st.data, float("nan"))
                )
    acp.load(path, {"model": model, "optimizer": targets}, framework="megatron", strict=False)
    model_sts = [(st.key, st) for st in model.sharded_state_dict().values() if isinstance(st, ShardedTensor)]
    return _records(model_sts), _records([(st.key, st) for st in targets.values()])


def test_distributed_optimizer_fully_reshardable_saved_on_gpu_loads_on_cpu_at_tp2(tmp_path):
    from megatron_helpers import assemble

    path = str(tmp_path / "distopt")
    value = run_nccl_world1(_distopt_save_body, path)
    saved_model, saved_optim = (assemble([v]) for v in value)
    assert saved_optim and all(k.startswith("optimizer.state.") for k in saved_optim)
    assert {k.split(".")[2] for k in saved_optim} == set(STATES)
    results = run_distributed(_load_tp2_body, 2, (path,))
    loaded_model = assemble([r[0] for r in results])
    loaded_optim = assemble([r[1] for r in results])
    for want, got in ((saved_model, loaded_model), (saved_optim, loaded_optim)):
        assert sorted(got) == sorted(want), sorted(set(got) ^ set(want))
        for k in want:
            assert np.array_equal(got[k], want[k]), k
    moved = [k for k in saved_optim if ".exp_avg." in k]
    assert any(np.abs(saved_optim[k]).sum() > 0 for k in moved)  # the optimizer did step
