"""``acp.dcp.Writer``/``Reader`` behave like DCP's ``FileSystemWriter``/``FileSystemReader`` where users rely
on it (what PyTorch's own DCP tests check, with the plug-in swapped in): repeated saves to one
``checkpoint_id``, the "Checkpoint already exists" refusal, keys FileSystemWriter accepts, non-tensor values
and ``param_groups`` both ways, stateful objects, async saves, FSDP2 state, resharding between 1-D and 2-D
meshes; and torchtitan-style flattened optimizer state with top-level model FQNs loading through
``acp.load``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
import arraycheckpoint.dcp  # noqa: F401  (acp.dcp)

dcp = pytest.importorskip("torch.distributed.checkpoint")
from torch.distributed.checkpoint.state_dict import (  # noqa: E402
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful  # noqa: E402

FLAT = StateDictOptions(flatten_optimizer_state_dict=True)


def _trained(seed: int, lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return model, opt


def _assert_same(m: torch.nn.Module, o: torch.optim.Optimizer, m2: torch.nn.Module, o2: Any) -> None:
    for (k, a), b in zip(m.state_dict().items(), m2.state_dict().values()):
        assert torch.equal(a, b), k
    for p, p2 in zip(m.parameters(), m2.parameters()):
        assert set(o.state[p]) == set(o2.state[p2])
        for k, v in o.state[p].items():
            assert torch.equal(v, o2.state[p2][k]), k
    assert [g["lr"] for g in o2.param_groups] == [g["lr"] for g in o.param_groups]


class Counter(Stateful):
    """A stateful object as DCP's tests use them (a tensor and a plain value)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def state_dict(self) -> dict[str, Any]:
        return {"n": torch.tensor([self.n]), "name": f"counter-{self.n}"}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        assert sd["name"] == f"counter-{int(sd['n'][0])}"
        self.n = int(sd["n"][0])


# ------------------------------------------------------------------------------------------ one process
def test_repeated_saves_to_one_id_and_the_refusal_dcp_tests_match(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    for value in (1.0, 2.0, 3.0):  # a loop saving to one fixed checkpoint_id (overwrite defaults to True)
        dcp.save({"w": torch.full((3,), value)}, storage_writer=acp.dcp.Writer(path))
    back = {"w": torch.zeros(3)}
    dcp.load(back, storage_reader=acp.dcp.Reader(path))
    assert torch.equal(back["w"], torch.full((3,), 3.0))
    with pytest.raises(BaseException, match="Checkpoint already exists"):
        dcp.save({"w": torch.ones(3)}, storage_writer=acp.dcp.Writer(path, overwrite=False))
    dcp.load(back, checkpoint_id=path, storage_reader=acp.dcp.Reader())
    assert torch.equal(back["w"], torch.full((3,), 3.0))


def test_keys_filesystemwriter_accepts_round_trip_escaped(tmp_path: Path) -> None:
    keys = ["w:1", "__w", ".w", "a\\b", "x~y"]
    sd: dict[str, Any] = {k: torch.arange(i + 2, dtype=torch.float32) for i, k in enumerate(keys)}
    sd["step"] = 7
    path = str(tmp_path / "ckpt")
    dcp.save(sd, storage_writer=acp.dcp.Writer(path))
    entries = set(acp.read_metadata(path).tensors)
    assert entries == {"w~c1", "~u_w", "~dw", "a~bb", "x~y"}  # stored escaped, every name a safe entry
    back: dict[str, Any] = {k: torch.zeros_like(v) for k, v in sd.items() if k != "step"}
    back["step"] = 0
    dcp.load(back, storage_reader=acp.dcp.Reader(path))
    assert back["step"] == 7
    for k in keys:
        assert torch.equal(back[k], sd[k]), k


def test_param_groups_and_non_tensor_values_both_ways(tmp_path: Path) -> None:
    """Writer -> acp.load restores lr; FileSystemWriter -> Reader exposes 'step', -> acp.load restores lr."""
    model, opt = _trained(0, 0.25)
    msd, osd = get_state_dict(model, opt)
    ours, theirs = str(tmp_path / "acp"), str(tmp_path / "dcp")
    dcp.save({"model": msd, "optimizer": osd, "step": 11}, storage_writer=acp.dcp.Writer(ours))
    dcp.save({"model": msd, "optimizer": osd, "step": 11}, checkpoint_id=theirs)  # FileSystemWriter
    for path, allow_pickle in ((ours, False), (theirs, True)):
        m2, o2 = _trained(1, 0.5)
        acp.load(path, {"model": m2, "optimizer": o2}, strict=True, allow_pickle=allow_pickle)
        _assert_same(model, opt, m2, o2)
        m3, o3 = _trained(2, 0.5)
        msd3, osd3 = get_state_dict(m3, o3)
        state = {"model": msd3, "optimizer": osd3, "step": 0}
        dcp.load(state, storage_reader=acp.dcp.Reader(path, allow_pickle=allow_pickle))
        set_state_dict(m3, o3, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        assert state["step"] == 11
        _assert_same(model, opt, m3, o3)


def test_writer_top_level_tensors_dicts_and_values_load_strictly_through_acp(tmp_path: Path) -> None:
    """dcp.save of bare top-level tensors, nested dicts and plain values through the Writer: a strict
    acp.load fills every tensor in place and returns the values (before: the tensors stayed as they were,
    with an empty report), and a namespace with nothing stored is still refused."""
    path = str(tmp_path / "c")
    t = torch.arange(12.0).reshape(3, 4)
    saved = {"rows": t, "step": 11, "m": {"w": t + 1, "n": 3, "sub": {"b": t + 2, "name": "x"}}}
    dcp.save(saved, storage_writer=acp.dcp.Writer(path))

    def zeros() -> dict[str, Any]:
        z = torch.zeros_like(t)
        return {
            "rows": z.clone(),
            "step": 0,
            "m": {"w": z.clone(), "n": 0, "sub": {"b": z.clone(), "name": ""}},
        }

    target = zeros()
    out = acp.load(path, target, strict=True)
    assert torch.equal(target["rows"], t) and torch.equal(target["m"]["w"], t + 1)
    assert torch.equal(target["m"]["sub"]["b"], t + 2)
    assert out["step"] == 11 and target["m"]["n"] == 3 and target["m"]["sub"]["name"] == "x"
    back = zeros()
    dcp.load(back, storage_reader=acp.dcp.Reader(path))
    assert back["step"] == 11 and back["m"]["sub"]["name"] == "x" and torch.equal(back["m"]["w"], t + 1)
    with pytest.raises(acp.StateMismatchError, match="nothing"):
        acp.load(path, {"other": torch.zeros(2)}, strict=True)


def test_writer_key_map_from_a_hostile_checkpoint_is_not_trusted(tmp_path: Path) -> None:
    """The Writer's key map (``~dcp``) is checkpoint input: names that are not strings, paths that are not
    lists are skipped (no TypeError); a bare tensor still loads under its own name, and a nested namespace whose
    map is gone is refused by a strict load, not left untouched silently."""
    import json

    path = tmp_path / "c"
    t = torch.arange(12.0).reshape(3, 4)
    dcp.save({"rows": t, "m": {"w": t + 1}}, storage_writer=acp.dcp.Writer(str(path)))
    doc_path = path / ".acp" / "metadata.json"
    doc = json.loads(doc_path.read_text())
    doc["objects"]["~dcp"]["value"]["keys"] = {"rows": ["not", "a", "name"], "m.w": {"x": 1}}
    doc["objects"]["~dcp"]["value"]["paths"]["m.w"] = "m/w"
    doc_path.write_text(json.dumps(doc))
    rows = torch.zeros_like(t)
    acp.load(path, {"rows": rows}, strict=True)
    assert torch.equal(rows, t)
    with pytest.raises(acp.StateMismatchError, match="m"):
        acp.load(path, {"m": {"w": torch.zeros_like(t)}}, strict=True)


def test_flattened_optimizer_with_top_level_model_fqns_loads_through_acp(tmp_path: Path) -> None:
    """torchtitan's layout: model FQNs at the top level, ``optimizer`` flattened (``state.<fqn>.exp_avg``,
    ``param_groups.<fqn>.lr``); acp.load maps the model namespace automatically (the one module namespace
    with nothing stored under it) and stores optimizer state as ``optimizer/<fqn>/<key>``."""
    model, opt = _trained(0, 0.125)
    msd, osd = get_state_dict(model, opt, options=FLAT)
    assert any(k.startswith("param_groups.") for k in osd)
    path = str(tmp_path / "ckpt")
    dcp.save({**msd, "optimizer": osd, "app": Counter(5)}, storage_writer=acp.dcp.Writer(path))
    entries = set(acp.read_metadata(path).tensors)
    assert {"0.weight", "optimizer/0.weight/exp_avg", "optimizer/2.bias/step"} <= entries
    m2, o2 = _trained(1, 0.5)
    report: dict = {}
    acp.load(path, {"model": m2, "optimizer": o2}, strict=True, report=report)
    _assert_same(model, opt, m2, o2)
    assert report["missing"] == []
    m3, o3 = _trained(2, 0.5)  # an explicit key_map does the same
    acp.load(
        path,
        {"model": m3, "optimizer": o3},
        key_map=lambda n: n.split("/", 1)[1] if n.startswith("model/") else n,
    )
    _assert_same(model, opt, m3, o3)
    # and DCP reads its own flattened keys back (stateful object included)
    m4, o4 = _trained(3, 0.5)
    msd4, osd4 = get_state_dict(m4, o4, options=FLAT)
    app = Counter(0)
    state = {**msd4, "optimizer": osd4, "app": app}
    dcp.load(state, storage_reader=acp.dcp.Reader(path))
    set_state_dict(
        m4,
        o4,
        model_state_dict={k: state[k] for k in msd4},
        optim_state_dict=state["optimizer"],
        options=FLAT,
    )
    _assert_same(model, opt, m4, o4)
    assert app.n == 5
    # the same state dict written by FileSystemWriter loads through acp.load too (allow_pickle: DCP's metadata)
    theirs = str(tmp_path / "fs")
    dcp.save({**msd, "optimizer": osd}, checkpoint_id=theirs)
    m5, o5 = _trained(4, 0.5)
    acp.load(theirs, {"model": m5, "optimizer": o5}, strict=True, allow_pickle=True)
    _assert_same(model, opt, m5, o5)
    # a FileSystemReader pointed at the plug-in's checkpoint fails loudly (its .metadata is JSON, no pickle)
    with pytest.raises(BaseException, match="pickle|load key"):
        dcp.load({**msd4}, checkpoint_id=path)


def test_async_save_in_one_process(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    fut = dcp.async_save({"w": torch.arange(6.0), "app": Counter(3)}, storage_writer=acp.dcp.Writer(path))
    fut.result()
    app = Counter(0)
    back = {"w": torch.zeros(6), "app": app}
    dcp.load(back, storage_reader=acp.dcp.Reader(path))
    assert torch.equal(back["w"], torch.arange(6.0)) and app.n == 3


@pytest.mark.parametrize("where", ["local", "memory"])
def test_writer_refuses_a_target_holding_the_users_files_and_keeps_them(tmp_path: Path, where: str) -> None:
    """The Writer's default ``overwrite=True`` (DCP's) replaces only a committed checkpoint: a directory or
    prefix holding other files is refused, naming them (not "Checkpoint already exists"), and kept."""
    from arraycheckpoint.storage import storage_for

    url = str(tmp_path / "run") if where == "local" else f"memory://{tmp_path.name}/run"
    backend, root = storage_for(url)
    if where == "local":
        (tmp_path / "run").mkdir()
    backend.write(root, "notes.txt", b"mine")
    with pytest.raises(BaseException, match="CheckpointExistsError") as info:  # DCP wraps it
        dcp.save({"w": torch.ones(3)}, storage_writer=acp.dcp.Writer(url), no_dist=True)
    assert "not a checkpoint" in str(info.value) and "notes.txt" in str(info.value), info.value
    assert "overwrite is False" not in str(info.value)
    assert backend.read(root, "notes.txt") == b"mine" and not backend.is_committed(root)


# ------------------------------------------------------------------------------------------ 2 gloo ranks
def _full(t: torch.Tensor) -> np.ndarray:
    from torch.distributed.tensor import DTensor

    return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().numpy()


def fsdp2_body(rank: int, world: int, path: str) -> dict:
    """FSDP2 model + flattened optimizer, a 1-D and a 2-D DTensor and a stateful object, saved twice to one
    id (the second async); then loaded back with the meshes swapped (1-D <-> 2-D) and into fresh FSDP2."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1 = init_device_mesh("cpu", (world,))
    mesh2 = init_device_mesh("cpu", (1, world))
    rows = torch.arange(48.0).reshape(8, 6)
    cols = torch.arange(40.0).reshape(4, 10) * -1
    model, opt = _trained(0, 0.0625)
    model = fully_shard(model, mesh=mesh1)
    opt = torch.optim.AdamW(model.parameters(), lr=0.0625)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    for step in (1, 2):
        msd, osd = get_state_dict(model, opt, options=FLAT)
        sd = {
            **msd,
            "optimizer": osd,
            "rows": distribute_tensor(rows * step, mesh1, [Shard(0)]),
            "cols": distribute_tensor(cols * step, mesh2, [Replicate(), Shard(1)]),
            "app": Counter(step),
        }
        if step == 1:
            dcp.save(sd, storage_writer=acp.dcp.Writer(path))
        else:
            dcp.async_save(sd, storage_writer=acp.dcp.Writer(path)).result()
    rows_back = distribute_tensor(torch.zeros(8, 6), mesh2, [Replicate(), Shard(1)])  # 1-D -> 2-D
    cols_back = distribute_tensor(torch.zeros(4, 10), mesh1, [Shard(0)])  # 2-D -> 1-D
    app = Counter(0)
    torch.manual_seed(50 + rank)
    m2 = fully_shard(
        torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3)), mesh=mesh1
    )
    o2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    m2(torch.ones(2, 4)).sum().backward()
    o2.step()
    msd2, osd2 = get_state_dict(m2, o2, options=FLAT)
    state = {**msd2, "optimizer": osd2, "rows": rows_back, "cols": cols_back, "app": app}
    dcp.load(state, storage_reader=acp.dcp.Reader(path))
    set_state_dict(
        m2,
        o2,
        model_state_dict={k: state[k] for k in msd2},
        optim_state_dict=state["optimizer"],
        options=FLAT,
    )
    want_m, want_o = get_state_dict(model, opt, options=FLAT)
    got_m, got_o = get_state_dict(m2, o2, options=FLAT)
    same = all(np.array_equal(_full(v), _full(got_m[k])) for k, v in want_m.items()) and all(
        (np.array_equal(_full(v), _full(got_o[k])) if isinstance(v, torch.Tensor) else v == got_o[k])
        for k, v in want_o.items()
    )
    return {
        "same": same,
        "rows": np.array_equal(_full(rows_back), (rows * 2).numpy()),
        "cols": np.array_equal(_full(cols_back), (cols * 2).numpy()),
        "app": app.n,
        "model": {k: _full(v) for k, v in want_m.items()},
        "optimizer": {k: _full(v) for k, v in want_o.items() if isinstance(v, torch.Tensor)},
    }


@pytest.mark.multiprocess
def test_fsdp2_repeated_async_saves_and_mesh_resharding_at_2_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    results = run_distributed(fsdp2_body, 2, (path,))
    for r in results:
        assert r["same"] and r["rows"] and r["cols"] and r["app"] == 2, r
    # acp.load into one plain process (2 -> 1): top-level model FQNs and flattened optimizer state
    torch.manual_seed(9)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    acp.load(path, {"model": model, "optimizer": opt}, strict=True)
    want = results[0]
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), want["model"][k]), k
    fqn = dict(zip((id(p) for p in model.parameters()), (n for n, _ in model.named_parameters())))
    for p, state in opt.state.items():
        for key, v in state.items():
            assert np.array_equal(v.numpy(), want["optimizer"][f"state.{fqn[id(p)]}.{key}"]), (
                fqn[id(p)],
                key,
            )
    assert opt.param_groups[0]["lr"] == 0.0625
