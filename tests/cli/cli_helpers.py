"""Shared helpers of the CLI tests: run the command as a user would, build small models, distributed bodies."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m arraycheckpoint.cli ARGS``; assert the exit code when ``check`` is not None."""
    proc = subprocess.run(
        [sys.executable, "-m", "arraycheckpoint.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    if check is not None:
        assert proc.returncode == check, (
            f"exit {proc.returncode} != {check} for {args}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def cli_json(*args: str) -> Any:
    return json.loads(cli(*args, "--json").stdout)


def make_mlp() -> Any:
    """Dims that do not divide by 4 ranks, so FSDP2 shards are uneven."""
    import torch

    return torch.nn.Sequential(torch.nn.Linear(13, 24), torch.nn.ReLU(), torch.nn.Linear(24, 7))


def fsdp2_save_body(rank: int, world: int, path: str) -> dict[str, dict[str, np.ndarray]] | None:
    """Train one step under FSDP2 on a CPU mesh, save with acp, return the full tensors (rank 0)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import arraycheckpoint as acp

    torch.manual_seed(0)
    model = make_mlp()
    mesh = init_device_mesh("cpu", (world,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model[2], mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    model(torch.randn(5, 13, generator=g)).sum().backward()
    opt.step()
    acp.save(path, {"model": model, "optimizer": opt}, step=7)
    # full_tensor() is a collective: every rank calls it; numpy arrays travel back by value
    model_sd = {k: v.full_tensor().numpy() for k, v in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    opt_sd = {}
    for p, st in opt.state.items():
        for key, v in st.items():
            full = v.full_tensor() if hasattr(v, "full_tensor") else v
            opt_sd[f"optimizer/{names[id(p)]}/{key}"] = full.detach().numpy()
    return {"model": model_sd, "optimizer": opt_sd} if rank == 0 else None


def flip_byte(path: str, offset: int) -> None:
    """XOR one byte of a file."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
