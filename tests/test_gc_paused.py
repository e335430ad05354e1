"""A blocking save and a load run with the cyclic garbage collector paused: the objects they keep alive until
they return (the state's requests, the plan, the metadata) are all reachable, so a collector pass over them frees
nothing and costs a gen-2 walk of the process (65 of 230 ms of a 2,000-tensor save, in the commit's metadata).
``save_async`` leaves the collector alone, since the training thread runs beside it."""

from __future__ import annotations

import gc

import pytest

import arraycheckpoint as acp
from arraycheckpoint.format.metadata import CheckpointMetadata

torch = pytest.importorskip("torch")


def test_blocking_save_and_load_run_with_the_collector_paused(tmp_path, monkeypatch) -> None:
    seen: list[tuple[str, bool]] = []
    to_json, from_json = CheckpointMetadata.to_json, CheckpointMetadata.from_json

    def spy_to_json(self):  # the save's commit, on the engine's thread
        seen.append(("commit", gc.isenabled()))
        return to_json(self)

    def spy_from_json(text, *args, **kwargs):  # the load's metadata parse
        seen.append(("parse", gc.isenabled()))
        return from_json(text, *args, **kwargs)

    monkeypatch.setattr(CheckpointMetadata, "to_json", spy_to_json)
    monkeypatch.setattr(CheckpointMetadata, "from_json", staticmethod(spy_from_json))
    state = {"model": {f"t{i}": torch.full((4,), float(i)) for i in range(30)}}
    acp.save(tmp_path / "c", state)
    fresh = {"model": {f"t{i}": torch.zeros(4) for i in range(30)}}
    acp.load(tmp_path / "c", fresh)
    assert ("commit", False) in seen and ("parse", False) in seen, seen
    assert all(not enabled for _, enabled in seen), seen
    assert gc.isenabled()  # restored after each
    seen.clear()
    acp.save_async(tmp_path / "d", state).result()
    assert seen == [("commit", True)]  # beside a training thread: untouched
    assert all(torch.equal(fresh["model"][k], v) for k, v in state["model"].items())
