"""Save arguments that differ on one rank fail every rank at once, naming the argument and the ranks (agreed in
the fixed-size agreement: no hang, nothing written, no lock left); differing global values warn."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.planning.plan import PlanOptions


def _state(rank: int) -> dict:
    torch.manual_seed(0)
    return {"model": torch.nn.Linear(8, 8), "extra_state": {"seed": 1}}


def _failed(path: str, state: dict, **kwargs: object) -> str:
    try:
        acp.save(path, state, timeout=60, **kwargs)
    except acp.SaveFailedError as e:
        return str(e)
    raise AssertionError("the save did not fail")


def body_two_ranks(rank: int, world: int, tmp: str) -> dict:
    state = _state(rank)
    opts = PlanOptions(pack_array_bytes=0) if rank == 1 else PlanOptions()
    msg = _failed(f"{tmp}/a", state, plan_options=opts)
    # the next save (arguments alike) works; a global value that differs on rank 1 warns on rank 0
    state["extra_state"] = {"seed": 7 if rank == 1 else 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        acp.save(f"{tmp}/b", state, timeout=60)
    return {"msg": msg, "warnings": [str(w.message) for w in caught]}


def body_three_ranks(rank: int, world: int, tmp: str) -> str:
    return _failed(f"{tmp}/a", _state(rank), compression="zstd" if rank == 2 else None, step=5)


def _no_trace(tmp: Path) -> None:
    assert sorted(os.listdir(tmp)) in ([], ["b"]), os.listdir(tmp)  # no lock, no staging, nothing committed


def test_differing_plan_options_on_two_ranks(tmp_path: Path) -> None:
    results = run_distributed(body_two_ranks, world=2, args=(str(tmp_path),), timeout=240)
    for r in results:
        msg = r["msg"]
        assert "save arguments differ between ranks: plan_options:" in msg, msg
        assert "pack_array_bytes=0" in msg and "on rank 1" in msg and "on rank 0" in msg, msg
        assert "state structure changed" not in msg
    assert any("extra_state" in w and "rank 1" in w for w in results[0]["warnings"]), results[0]["warnings"]
    _no_trace(tmp_path)
    assert acp.read_metadata(tmp_path / "b").objects["extra_state"].value is not None


def test_differing_compression_on_three_ranks(tmp_path: Path) -> None:
    msgs = run_distributed(body_three_ranks, world=3, args=(str(tmp_path),), timeout=240)
    for msg in msgs:
        assert "compression: None on ranks 0, 1; 'zstd' on rank 2" in msg, msg
        assert "plan_options" not in msg and "step" not in msg, msg
    assert len(set(msgs)) == 1
    _no_trace(tmp_path)
