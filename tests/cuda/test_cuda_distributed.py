"""NCCL jobs: the checkpoint's gloo group beside an NCCL training group, FSDP2 and DTensor with CUDA
parameters, saved on the GPU and loaded on CPU under another layout (one GPU: world size 1 for NCCL; two gloo
ranks share the device for DTensor)."""

from __future__ import annotations

import os

import torch
from dist import free_port, run_distributed

WIDTH = 256


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(WIDTH, 2 * WIDTH), torch.nn.ReLU(), torch.nn.Linear(2 * WIDTH, WIDTH)
    )


def _nccl_fsdp2_body(path: str, port: int, queue) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import arraycheckpoint as acp

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    )
    try:
        torch.cuda.set_device(0)
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)
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
            t = torch.ones(1, device="cuda")
            dist.all_reduce(t)  # the NCCL training group is busy while the checkpoint group works
            opt.step()
            opt.zero_grad()
        fut = acp.save_async(path, {"model": model, "optimizer": opt}, step=2)
        fut.staged.result()
        model(x).sum().backward()  # training goes on (NCCL) while the save writes (gloo)
        dist.all_reduce(torch.ones(1, device="cuda"))
        fut.result()
        full = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
        queue.put(("ok", full))
    except BaseException:  # noqa: BLE001
        import traceback

        queue.put(("error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def test_fsdp2_cuda_on_nccl_saved_then_loaded_on_cpu(tmp_path):
    import torch.multiprocessing as mp

    import arraycheckpoint as acp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_nccl_fsdp2_body, args=(str(tmp_path / "c"), free_port(), queue))
    proc.start()
    status, value = queue.get(timeout=300)
    proc.join(60)
    assert status == "ok", value
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
