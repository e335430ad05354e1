"""Save metrics include the coordinator's commit phase; opt-in load metrics are stored and shown (issue 7)."""

from __future__ import annotations

import json
import os

import torch
from cli_helpers import cli, cli_json
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.format.metadata import LOAD_METRICS_FILE


def _model(world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    return fully_shard(model, mesh=init_device_mesh("cpu", (world,)))


def save_body(rank: int, world: int, path: str) -> None:
    acp.save(path, {"model": _model(world)})


def load_body(rank: int, world: int, path: str) -> list[str]:
    report: dict = {}
    acp.load(path, {"model": _model(world)}, record_metrics=True, report=report)
    return [p["phase"] for p in report["metrics"]]


def test_commit_phase_and_recorded_loads(tmp_path):
    path = str(tmp_path / "ck")
    run_distributed(save_body, 2, (path,))
    assert not os.path.exists(os.path.join(path, LOAD_METRICS_FILE))
    save = cli_json("metrics", path, "--json")
    assert save["ranks"] == [0, 1] and "commit" in save["phases"] and "write" in save["phases"]
    commit = save["seconds"][0][save["phases"].index("commit")]
    assert commit > 0  # the coordinator's commit (metadata, marker, rename) was timed
    phases = run_distributed(load_body, 2, (path,))
    assert all("read" in p for p in phases)
    with open(os.path.join(path, LOAD_METRICS_FILE)) as f:
        doc = json.load(f)
    assert sorted(doc["load"]) == ["0", "1"]
    load = cli_json("metrics", path, "--kind", "load", "--json")
    assert load["ranks"] == [0, 1] and "read" in load["phases"]
    read = load["bytes"][0][load["phases"].index("read")] + load["bytes"][1][load["phases"].index("read")]
    assert read == sum(t.nbytes for t in acp.read_metadata(path).tensors.values())  # each rank its shard
    out = cli("metrics", path, "--kind", "load", "--plot", str(tmp_path / "load.png"))
    assert out.returncode == 0 and os.path.getsize(tmp_path / "load.png") > 10_000
    assert acp.load(path, {"model": {}}, strict=False) is not None  # the sidecars do not disturb loading
