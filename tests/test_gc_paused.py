"""A blocking save and a load run with the cyclic garbage collector paused: the objects they keep alive until
they return (the state's requests, the plan, the metadata) are all reachable, so a collector pass over them frees
nothing and costs a gen-2 walk of the process (65 of 230 ms of a 2,000-tensor save, in the commit's metadata).
``save_async`` leaves the collector alone, since the training thread runs beside it."""

from __future__ import annotations

import gc
from functools import partial

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


def _walked_after(fn, kind: type | None = None) -> int:
    """Objects (of ``kind``, or all) the cyclic collector walks in its first passes after ``fn()`` returns: the
    passes that resume once a blocking call re-enables it. ``fn``'s return value stays alive meanwhile."""
    gc.collect()  # everything so far in the oldest generation: the passes below walk only new objects
    walked = [0]

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            young = (o for g in range(info["generation"] + 1) for o in gc.get_objects(generation=g))
            walked[0] += sum(1 for o in young if kind is None or isinstance(o, kind))

    gc.callbacks.append(count)
    try:
        kept = fn()
        allocated = [[] for _ in range(2000)]  # past the collector's threshold: its pass runs here
    finally:
        gc.callbacks.remove(count)
    del allocated, kept
    return walked[0]


def test_the_collector_resumes_after_the_save_and_load_objects_are_freed(tmp_path) -> None:
    """A blocking load frees its objects (the parsed metadata, the targets, the read plan) before the collector
    is back, and a save its request's tensors: measured, the first pass after a load walked 20 objects per
    tensor that died right after, and after a save most of the request (5-8 objects per tensor, as the
    save's thread happened to be freeing them). Counted at two sizes: nothing per tensor after a load (what a
    load keeps is the caller's), no request tensor after any save (the plan cached for the next save and the
    returned metadata are walked, and stay)."""
    from arraycheckpoint.planning.items import SaveTensor

    walked: dict[int, int] = {}
    for n in (100, 600):
        state = {"model": {f"layers.{i // 8}.p{i % 8}": torch.full((4,), float(i)) for i in range(n)}}
        fresh = {"model": {k: torch.zeros(4) for k in state["model"]}}
        for r in range(3):
            saved = _walked_after(partial(acp.save, tmp_path / f"s{n}-{r}", state), SaveTensor)
            assert saved == 0, (n, r, saved)
        walked[n] = _walked_after(partial(acp.load, tmp_path / f"s{n}-0", fresh))
        assert all(torch.equal(fresh["model"][k], v) for k, v in state["model"].items())
    assert (walked[600] - walked[100]) / 500 < 1, walked
