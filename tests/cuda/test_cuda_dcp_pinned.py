"""DCP's pinned-memory async save through ``acp.dcp.Writer`` on a GPU: what torchtitan's
``async_mode="async_with_pinned_mem"`` runs (``DefaultStager(StagingOptions(True, True, True, True))``, the
checkpoint written by a daemon process), with FSDP2 CUDA parameters on an NCCL group; read back by
``acp.dcp.Reader`` on the GPU and by ``acp.load`` on CPU, bit-exactly. It cannot run on a CPU-only torch (the
stager's non-blocking copies need an accelerator)."""

from __future__ import annotations

import torch
from nccl1 import run_nccl_world1


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(96, 160), torch.nn.ReLU(), torch.nn.Linear(160, 48))


def _body(path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import arraycheckpoint.dcp

    mesh = init_device_mesh("cuda", (1,))
    model = _net().cuda()
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 96, device="cuda")).sum().backward()
    opt.step()
    state = {"model": get_model_state_dict(model), "step": 7}
    want = {k: v.full_tensor().cpu() for k, v in state["model"].items()}
    stager = DefaultStager(StagingOptions(True, True, True, True))
    response = dcp.async_save(
        state,
        storage_writer=arraycheckpoint.dcp.Writer(path),
        async_checkpointer_type=AsyncCheckpointerType.PROCESS,
        async_stager=stager,
    )
    upload = getattr(response, "upload_completion", response)
    getattr(response, "staging_completion", upload).result()
    with torch.no_grad():  # training goes on once staged: the checkpoint keeps the values it staged
        for p in model.parameters():
            p.add_(1.0)
    upload.result()
    stager.close()
    back = {"model": {k: torch.zeros_like(v) for k, v in get_model_state_dict(model).items()}, "step": 0}
    dcp.load(back, storage_reader=arraycheckpoint.dcp.Reader(path))
    for k, v in back["model"].items():
        assert torch.equal(v.full_tensor().cpu(), want[k]), k
    assert back["step"] == 7
    return {
        k: v.numpy() for k, v in want.items()
    }  # plain arrays: the worker exits before shared tensors arrive


def test_dcp_async_save_with_pinned_stager_through_the_writer(tmp_path):
    import arraycheckpoint as acp

    want = run_nccl_world1(_body, str(tmp_path / "c"))
    cpu = _net()
    acp.load(tmp_path / "c", {"model": cpu})
    for k, v in cpu.state_dict().items():
        assert torch.equal(v, torch.from_numpy(want[k])), k
