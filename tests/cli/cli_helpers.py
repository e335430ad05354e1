"""Shared helpers of the CLI tests: run the command as a user would, build small models, distributed bodies."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
from typing import Any

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def cli(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    """Run ``python -m arraycheckpoint.cli ARGS`` in its own process (forked from the suite's preloaded server:
    tests/forked.py; ``cli_process`` starts a new interpreter); assert the exit code when ``check`` is not
    None."""
    from forked import run_forked

    proc = run_forked(_as_module, *map(str, args), cwd=REPO)
    return _checked(proc, args, check)


def cli_process(*args: str, check: int | None = 0) -> subprocess.CompletedProcess[str]:
    """As :func:`cli`, in a new interpreter (``python -m arraycheckpoint.cli ARGS``)."""
    proc = subprocess.run(
        [sys.executable, "-m", "arraycheckpoint.cli", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    return _checked(proc, args, check)


def _as_module(*args: str) -> None:
    """What ``python -m arraycheckpoint.cli ARGS`` runs."""
    sys.argv = ["arraycheckpoint", *args]
    runpy.run_module("arraycheckpoint.cli", run_name="__main__", alter_sys=True)


def _checked(
    proc: subprocess.CompletedProcess[str], args: tuple[str, ...], check: int | None
) -> subprocess.CompletedProcess[str]:
    if check is not None:
        assert proc.returncode == check, (
            f"exit {proc.returncode} != {check} for {args}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc


def run_main(capsys: Any, *args: object) -> tuple[int, str, str]:
    """Run the command in process (``cli.main``): ``(exit code, stdout, stderr)``; never a traceback."""
    from arraycheckpoint.cli import main

    code = main([str(a) for a in args])
    out = capsys.readouterr()
    assert "Traceback" not in out.err, out.err
    return code, out.out, out.err


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


def chunk_span(ckpt: str, name: str, key: str) -> tuple[str, int, int]:
    """Where the stored chunk ``key`` (``c.1.0``) of the tensor ``name`` lies: ``(file, offset, size)``.

    An array of its own directory: the chunk file, whole. A packed array (formats 5 and 6): its member's bytes
    inside the pack's ZIP file (after the member's local header, which ``zipfile`` does not expose).
    """
    import struct
    import zipfile

    from arraycheckpoint.format.metadata import CheckpointMetadata
    from arraycheckpoint.storage import LocalStorage

    meta = CheckpointMetadata.from_json(
        LocalStorage().read(ckpt, LocalStorage().control_files(ckpt).metadata)
    )
    tm = meta.tensors[name]
    if tm.pack is None:
        path = os.path.join(ckpt, *name.split("/"), key)
        return path, 0, os.path.getsize(path)
    pack = os.path.join(ckpt, *tm.pack.split("/"))
    if tm.pack_rank is not None:  # format 6: the pack of its rank's packs that holds the member
        k = 0
        while True:
            pack = os.path.join(ckpt, *f"{tm.pack.partition('@')[0]}.{k}.zip".split("/"))
            with zipfile.ZipFile(pack) as zf:
                if f"{name}/{key}" in zf.namelist():
                    break
            k += 1
    with zipfile.ZipFile(pack) as zf:
        info = zf.getinfo(f"{name}/{key}")
    with open(pack, "rb") as f:
        f.seek(info.header_offset)
        header = f.read(30)
    assert header[:4] == b"PK\x03\x04"
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    return pack, info.header_offset + 30 + name_len + extra_len, info.file_size


def flip_chunk_byte(ckpt: str, name: str, key: str, offset: int) -> None:
    """XOR one byte of a stored chunk (``offset`` within the chunk; negative: from its end), in its own file
    or inside its pack member."""
    path, start, size = chunk_span(ckpt, name, key)
    flip_byte(path, start + (offset % size))


def remove_chunk(ckpt: str, name: str, key: str) -> str:
    """Delete a stored chunk: its file, or its member from the pack (the pack is rewritten without it, with
    Python's ``zipfile``); returns the file that held it."""
    import zipfile

    path, _start, _size = chunk_span(ckpt, name, key)
    if not path.endswith(".zip"):  # a chunk file of the array's directory
        os.unlink(path)
        return path
    with zipfile.ZipFile(path) as zf:
        kept = [(i, zf.read(i)) for i in zf.infolist() if i.filename != f"{name}/{key}"]
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        for info, data in kept:
            zf.writestr(info, data)
    return path
