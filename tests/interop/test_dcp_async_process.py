"""``acp.dcp.Writer`` with ``dcp.async_save(..., async_checkpointer_type=AsyncCheckpointerType.PROCESS)``:
DCP pickles the Writer into a checkpoint daemon process per rank (with its own gloo group) that plans and
writes there. Two real ranks (separate interpreters, as torchrun starts them: the daemon is spawned, so the
ranks cannot be the suite's daemonic pool workers) save a row-sharded DTensor, a replicated tensor and a
non-tensor value twice to one id; the ranks read the second save back with ``acp.dcp.Reader``, and the test
process loads it with ``acp.load``, bit-exactly."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from dist import free_port

import arraycheckpoint as acp

pytest.importorskip("torch.distributed.checkpoint")

REPO = str(Path(__file__).resolve().parents[2])

_RANK = """
    import os, sys, torch, torch.distributed as dist, torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
    import arraycheckpoint as acp, arraycheckpoint.dcp

    def state(step):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor
        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        rows = torch.arange(60, dtype=torch.float32).reshape(10, 6) * step
        return {"model": {"rows": distribute_tensor(rows, mesh, [Shard(0)]),
                          "bias": torch.arange(5, dtype=torch.int64) - step}, "step": step}

    def main(path):
        dist.init_process_group("gloo")
        for step in (1, 2):  # the second save replaces the first at the same id
            dcp.async_save(state(step), storage_writer=acp.dcp.Writer(path),
                           async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        back = state(0)
        dcp.load(back, storage_reader=acp.dcp.Reader(path))
        want = state(2)
        assert torch.equal(back["model"]["rows"].full_tensor(), want["model"]["rows"].full_tensor())
        assert torch.equal(back["model"]["bias"], want["model"]["bias"]) and back["step"] == 2, back
        dist.destroy_process_group()
        print("rank", dist_rank, "ok")

    if __name__ == "__main__":
        dist_rank = int(os.environ["RANK"])
        main(sys.argv[1])
"""


@pytest.mark.multiprocess
def test_async_save_in_process_mode_at_two_ranks(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent(_RANK))
    path = str(tmp_path / "ckpt")
    port = str(free_port())
    procs = []
    for rank in range(2):
        env = {
            **os.environ,
            "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port,
            "RANK": str(rank),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(rank),
        }
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), path],
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                env=env,
                cwd=str(tmp_path),
            )
        )
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=300)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    for rank, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0 and f"rank {rank} ok" in out, out[-4000:]
    got = acp.load(path, {"model": {"rows": torch.zeros(10, 6), "bias": torch.zeros(5, dtype=torch.int64)}})
    assert torch.equal(got["model"]["rows"], torch.arange(60, dtype=torch.float32).reshape(10, 6) * 2)
    assert torch.equal(got["model"]["bias"], torch.arange(5, dtype=torch.int64) - 2)
