"""NCCL jobs: the checkpoint's gloo group beside an NCCL training group, FSDP2 and DTensor with CUDA
parameters, saved on the GPU and loaded on CPU under another layout (one GPU: world size 1 for NCCL; two gloo
ranks share the device for DTensor)."""

from __future__ import annotations

import torch
from dist import run_distributed
from nccl1 import run_nccl_world1

WIDTH = 256


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(2 * WIDTH, WIDTH)
    )


def _fsdp2_body(path: str) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import arraycheckpoint as acp

    mesh = init_device_mesh("cuda", (1,))
    model = _net().cuda()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(16, WIDTH, device="cuda")
    for _ in range(2):
        model(x).sum().backward()
        dist.all_reduce(torch.ones(1, device="cuda"))  # the NCCL training group is busy too
        opt.step()
        opt.zero_grad()
    fut = acp.save_async(path, {"model": model, "optimizer": opt}, step=2)
    fut.staged.result()
    model(x).sum().backward()  # training goes on (NCCL) while the save writes (gloo)
    dist.all_reduce(torch.ones(1, device="cuda"))
    fut.result()
    return {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}


def test_fsdp2_cuda_on_nccl_saved_then_loaded_on_cpu(tmp_path):
    import arraycheckpoint as acp

    value = run_nccl_world1(_fsdp2_body, str(tmp_path / "c"))
    cpu = _net()
    opt = torch.optim.Adam(cpu.parameters(), lr=1e-2)
    acp.load(tmp_path / "c", {"model": cpu, "optimizer": opt})
    for k, v in cpu.state_dict().items():
        assert torch.equal(v, value[k]), k
    assert all(len(s) == 3 for s in opt.state.values())


def _dtensor_body(rank: int, world: int, path: str) -> dict:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Shard

    import arraycheckpoint as acp

    torch.manual_seed(0)
    full = torch.randn(37, 11)  # 37 rows: uneven Shard(0) over two ranks
    rows = [19, 18]
    start = sum(rows[:rank])
    local = full[start : start + rows[rank]].cuda()  # both ranks' shards on the one device
    mesh = DeviceMesh("cuda", list(range(world)))  # over the gloo group: one device, two ranks
    dt = DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape, stride=full.stride())
    acp.save(path, {"model": {"w": dt}})
    return {"full": full}


def test_two_ranks_cuda_shards_on_one_device_loaded_on_cpu_and_cuda(tmp_path):
    import arraycheckpoint as acp

    path = str(tmp_path / "c")
    results = run_distributed(_dtensor_body, 2, (path,))
    full = results[0]["full"]
    out = {"model": {"w": torch.zeros(37, 11)}}
    acp.load(path, out)
    assert torch.equal(out["model"]["w"], full)
    on_gpu = {"model": {"w": torch.zeros(37, 11, device="cuda")}}
    acp.load(path, on_gpu)
    assert torch.equal(on_gpu["model"]["w"].cpu(), full)
