"""The GPU snapshot copies only what a rank writes (issue 22, item 4): replicated CUDA tensors at two gloo ranks
on the one GPU, chunk grids that cut rows and columns (non-contiguous device slices), buffers carved out of what
``acp.prepare`` reserved on one rank and taken per region on the other; packed small tensors loaded back into CUDA
destinations through the pinned staging path."""

from __future__ import annotations

import numpy as np
import torch
from dist import run_distributed, snapshot_copied, written_bytes


def _build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # Linear(4096, 8).weight is (8, 4096): a 16 KiB row, so 2 KiB chunks cut columns (strided device slices)
    model = torch.nn.Sequential(torch.nn.Linear(64, 4096), torch.nn.Linear(4096, 8)).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.ones(4, 64, device="cuda")).sum().backward()
    opt.step()
    opt.zero_grad()


def _cpu_state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, np.ndarray]:
    out = {f"p{i}": p.detach().cpu().numpy().copy() for i, p in enumerate(model.parameters())}
    for i, p in enumerate(model.parameters()):
        for k, v in opt.state[p].items():
            if torch.is_tensor(v):  # the 0-dim step counters too
                out[f"s{i}.{k}"] = v.detach().cpu().numpy().copy()
    return out


def _body(rank: int, world: int, tmp: str) -> dict:
    import arraycheckpoint as acp
    from arraycheckpoint.planning.plan import PlanOptions

    model, opt = _build(0)
    _step(model, opt)
    if rank == 0:  # whole-shard pinned buffers: rank 0's snapshot carves its regions out of them
        acp.prepare({"model": model, "optimizer": opt})
    options = PlanOptions(
        min_chunk_bytes=1024, max_chunk_bytes=2048, inner_chunk_bytes=512, pack_array_bytes=0
    )
    out: dict = {"copied": [], "split": 0}
    states = []
    for i in range(2):  # the first save (planned before the snapshot), then the cached plan
        states.append(_cpu_state(model, opt))
        fut = acp.save_async(f"{tmp}/s{i}", {"model": model, "optimizer": opt}, plan_options=options)
        fut.staged.result()
        _step(model, opt)  # every tensor changes on the device while the save writes
        meta = fut.result()
        if rank == 0:
            out["copied"].append(snapshot_copied(meta, world))
            out["written"] = written_bytes(meta, world)
            out["split"] = sum(len(set(tm.writers)) > 1 for tm in meta.tensors.values())
    out["state_bytes"] = sum(a.nbytes for a in states[0].values())
    for i in range(2):
        fresh, fresh_opt = _build(1)
        _step(fresh, fresh_opt)  # optimizer state exists to load into
        acp.load(f"{tmp}/s{i}", {"model": fresh, "optimizer": fresh_opt})
        got = _cpu_state(fresh, fresh_opt)
        for key, want in states[i].items():
            assert np.array_equal(got[key], want), f"save {i}: {key} did not reload bit-exactly"
    return out


def test_replicated_cuda_snapshot_copies_only_the_chunks_each_rank_writes(tmp_path):
    r0 = run_distributed(_body, 2, (str(tmp_path),))[0]
    assert r0["split"] >= 2, "the chunk grid should spread tensors over both writers"
    assert sum(r0["written"]) == r0["state_bytes"]
    for copied in r0["copied"]:
        assert copied == r0["written"], (copied, r0["written"])
        assert max(copied) < r0["state_bytes"] * 0.75


def test_packed_small_tensors_load_into_cuda_bit_exactly(tmp_path):
    import arraycheckpoint as acp

    torch.manual_seed(0)
    small = {f"t{i}": torch.randn(3 + i, 5, device="cuda") for i in range(200)}  # packed: one pack per rank
    small["big"] = torch.randn(1 << 20, device="cuda")
    small["half"] = torch.randn(64, 33, device="cuda").to(torch.bfloat16)
    acp.save(tmp_path / "c", {"model": small})
    assert list((tmp_path / "c").rglob("*.zip")), "the small tensors should be packed"
    out = {"model": {k: torch.full_like(v, float("nan")) for k, v in small.items()}}
    acp.load(tmp_path / "c", out)
    for k, v in small.items():
        assert torch.equal(
            out["model"][k].view(torch.int16) if v.dtype == torch.bfloat16 else out["model"][k],
            v.view(torch.int16) if v.dtype == torch.bfloat16 else v,
        ), k
    cols = {"model": {"big": torch.zeros(1 << 20, device="cuda")}}
    acp.load(tmp_path / "c", cols, strict=False)
    assert torch.equal(cols["model"]["big"], small["big"])
