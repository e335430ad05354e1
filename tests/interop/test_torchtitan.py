"""torchtitan's real ``CheckpointManager`` on arraycheckpoint's format (docs/integrations.md).

The change is the two storage arguments (``dcp_save``: ``storage_writer=acp.dcp.Writer(checkpoint_id)``,
``dcp_load``: ``storage_reader=acp.dcp.Reader(checkpoint_id)``); resume discovery (``_find_load_step`` looks
for ``step-N/.metadata``) needs no change because the Writer leaves that file. Saved by FSDP2 at 2 gloo ranks
(one synchronous and one async save), resumed at 3 bit-exactly (``load()`` returns True: never a silent
fresh start), and the same checkpoint loads through ``acp.load`` into a plain model and optimizer.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
import arraycheckpoint.dcp  # noqa: F401

pytest.importorskip("torchtitan")
import torch.distributed.checkpoint as dcp  # noqa: E402
from torchtitan.components.checkpoint import MODEL, AsyncMode, CheckpointManager  # noqa: E402
from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer  # noqa: E402
from torchtitan.components.optimizer.optimizer import OptimizersContainer, ParamGroupConfig  # noqa: E402


class AcpCheckpointManager(CheckpointManager):
    """torchtitan's CheckpointManager writing and reading arraycheckpoint's format (the two edits)."""

    def dcp_save(self, state_dict, checkpoint_id, async_mode, enable_garbage_collection=False, to_hf=False):  # type: ignore[no-untyped-def]
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = acp.dcp.Writer(checkpoint_id)
        if async_mode == AsyncMode.DISABLED:
            return dcp.save(state_dict, storage_writer=writer)
        return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)

    def dcp_load(self, state_dict, checkpoint_id, from_hf, from_quantized):  # type: ignore[no-untyped-def]
        if from_hf:
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, storage_reader=acp.dcp.Reader(checkpoint_id))
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(state_dict)


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))


def _build(seed: int, folder: str, world: int, async_mode: str = "disabled") -> tuple[Any, ...]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = fully_shard(_model(seed), mesh=init_device_mesh("cpu", (world,)))
    opts = OptimizersContainer(
        OptimizersContainer.Config(
            param_groups=[
                ParamGroupConfig(pattern=".*", optimizer_name="AdamW", optimizer_kwargs={"lr": 0.01})
            ],
            implementation="for-loop",
        ),
        model_parts=[model],
    )
    lrs = LRSchedulersContainer(opts, lambda s: 1.0 / (1 + s))
    config = CheckpointManager.Config(
        enable=True, folder="ckpt", interval=1, keep_latest_k=0, async_mode=async_mode
    )
    mgr = AcpCheckpointManager(
        config,
        dataloader=None,
        model_parts=[model],
        optimizers=opts,
        lr_schedulers=lrs,
        states={},
        sd_adapter=None,
        base_folder=folder,
    )
    return model, opts, lrs, mgr


def _full_state(model: torch.nn.Module, opts: Any) -> dict[str, np.ndarray]:
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> np.ndarray:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().numpy()

    out = {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    out.update(
        {f"optimizer/{k}": full(v) for k, v in opts.state_dict().items() if isinstance(v, torch.Tensor)}
    )
    return out


def save_body(rank: int, world: int, folder: str) -> dict:
    model, opts, lrs, mgr = _build(0, folder, world, async_mode="async")
    for step in (1, 2):
        model(torch.ones(2, 4)).sum().backward()
        opts.step()
        lrs.step()
        opts.zero_grad()
        if step == 1:
            mgr.dcp_save(
                mgr._flattened_model_states_sd(), mgr._create_checkpoint_id(step), AsyncMode.DISABLED
            )
        else:
            mgr.save(step)  # async (threaded) save
            # torchtitan's close() does not wait for an async save (its trainer saves the last step
            # synchronously, which first waits for the one in flight): wait as that does
            mgr.maybe_wait_for_saving()
            mgr.close()
    return {"state": _full_state(model, opts), "lr": opts.optimizers[0].param_groups[0]["lr"]}


def resume_body(rank: int, world: int, folder: str) -> dict:
    model, opts, lrs, mgr = _build(100 + rank, folder, world)
    model(torch.ones(2, 4)).sum().backward()
    opts.step()  # a different state that the load must replace
    loaded = mgr.load()
    out = {
        "loaded": loaded,
        "state": _full_state(model, opts),
        "epoch": lrs.schedulers[0].last_epoch,
        "lr": opts.optimizers[0].param_groups[0]["lr"],
    }
    mgr.close()
    return out


@pytest.mark.multiprocess
def test_checkpoint_manager_saves_at_2_resumes_at_3(tmp_path: Path) -> None:
    folder = str(tmp_path)
    saved = run_distributed(save_body, 2, (folder,))[0]
    steps = sorted(os.listdir(tmp_path / "ckpt"))
    assert steps == ["step-1", "step-2"]
    assert (tmp_path / "ckpt" / "step-2" / ".metadata").is_file()  # what _find_load_step looks for
    resumed = run_distributed(resume_body, 3, (folder,))
    for r in resumed:
        assert r["loaded"] is True  # never a silent fresh start
        assert r["epoch"] == 2 and r["lr"] == saved["lr"]
        assert set(r["state"]) == set(saved["state"])
        for k, v in saved["state"].items():
            assert np.array_equal(r["state"][k], v), k
    # the same checkpoint through acp.load: top-level model FQNs, flattened optimizer state
    model = _model(7)
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    acp.load(str(tmp_path / "ckpt" / "step-2"), {"model": model, "optimizer": opt}, strict=True)
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), saved["state"][f"model/{k}"]), k
    names = dict(zip((id(p) for p in model.parameters()), (n for n, _ in model.named_parameters())))
    for p, state in opt.state.items():
        for key, v in state.items():
            assert np.array_equal(v.numpy(), saved["state"][f"optimizer/state.{names[id(p)]}.{key}"]), key
    assert opt.param_groups[0]["lr"] == saved["lr"]
