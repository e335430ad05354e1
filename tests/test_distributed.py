"""Distributed PyTorch: DDP, FSDP2/DTensor, FSDP1 flat shards, load-time resharding (issue 3).

Real processes (gloo on CPU, spawned). Every comparison is bit-exact on reassembled full tensors: the
saving ranks return their full model and optimizer state, the loading ranks return what they loaded.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist import run_distributed, torch_full_state

import arraycheckpoint as acp

pytestmark = pytest.mark.multiprocess

IN, HID, OUT = 10, 13, 6  # odd sizes: uneven shards at every world size


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(IN, HID), torch.nn.Tanh(), torch.nn.Linear(HID, OUT))


def _mesh(shape):
    from torch.distributed.device_mesh import init_device_mesh

    names = ("replicate", "shard") if len(shape) == 2 else ("shard",)
    return init_device_mesh("cpu", shape, mesh_dim_names=names)


def _fsdp2(model, mesh):
    from torch.distributed.fsdp import fully_shard

    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _fsdp1(model):
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    return FSDP(model, use_orig_params=True, device_id=torch.device("cpu"))


def _step(model, opt, rank, world, steps=1, batch=12):
    """Train with a fixed global batch split over the ranks; returns the global losses."""
    losses = []
    for s in range(steps):
        gen = torch.Generator().manual_seed(100 + s)
        x = torch.randn(batch, IN, generator=gen)
        y = torch.randn(batch, OUT, generator=gen)
        per = batch // world
        xs, ys = x[rank * per : (rank + 1) * per], y[rank * per : (rank + 1) * per]
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(xs), ys)
        loss.backward()
        opt.step()
        t = loss.detach().clone()
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(t)
            t /= world
        losses.append(t.item())
    return losses


def _full(t: torch.Tensor) -> np.ndarray:
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        t = t.full_tensor()
    return t.detach().clone().numpy()


def _full_state(model, opt) -> dict[str, np.ndarray]:
    """Full model and optimizer state by FQN (FSDP1: gathered by torch's own get_state_dict, independent of
    the adapter's flat-fragment view; otherwise every tensor made full)."""
    from arraycheckpoint.adapters.torch.module import ModuleView

    view = ModuleView(model)
    if view.fragments:
        return torch_full_state(model, opt)
    out = {f"model/{k}": _full(v) for k, v in view.tensors.items()}
    for group in opt.param_groups:
        for p in group["params"]:
            fqn = view.param_fqn[id(p)]
            out.update({f"optimizer/{fqn}/{k}": _full(v) for k, v in opt.state.get(p, {}).items()})
    return out


def _wrap(kind: str, model, world):
    if kind == "fsdp2":
        return _fsdp2(model, _mesh((world,)))
    if kind == "hsdp":
        return _fsdp2(model, _mesh((2, world // 2)))
    if kind == "fsdp1":
        return _fsdp1(model)
    if kind == "ddp":
        return torch.nn.parallel.DistributedDataParallel(model)
    return model


def save_body(rank, world, path, kind):
    model = _wrap(kind, _model(0), world)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _step(model, opt, rank, world, steps=2)
    acp.save(path, {"model": model, "optimizer": opt, "extra_state": {"step": 2}}, step=2)
    return _full_state(model, opt)


def load_body(rank, world, paths, kind):
    results = []
    for path in paths:
        model = _wrap(kind, _model(rank + 7), world)
        opt = torch.optim.Adam(model.parameters(), lr=0.05)
        extra: dict = {}
        acp.load(path, {"model": model, "optimizer": opt, "extra_state": extra})
        assert extra == {"step": 2}
        results.append(_full_state(model, opt))
    return results


def _assert_same(saved: dict, loaded: dict, what: str) -> None:
    assert set(saved) == set(loaded), (what, set(saved) ^ set(loaded))
    for k in saved:
        assert saved[k].dtype == loaded[k].dtype and np.array_equal(saved[k], loaded[k]), (what, k)


@pytest.fixture(scope="module")
def fsdp2_checkpoints(tmp_path_factory):
    """FSDP2 checkpoints saved at world sizes 2, 3, 4, and a plain module saved by one process."""
    root = tmp_path_factory.mktemp("fsdp2")
    saved = {}
    for n in (2, 3, 4):
        saved[n] = (str(root / f"n{n}"), run_distributed(save_body, n, (str(root / f"n{n}"), "fsdp2"))[0])
    model, opt = _model(0), None
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    _step(model, opt, 0, 1, steps=2)
    acp.save(root / "n1", {"model": model, "optimizer": opt, "extra_state": {"step": 2}}, step=2)
    saved[1] = (str(root / "n1"), _full_state(model, opt))
    return saved


@pytest.mark.parametrize("m", [2, 3, 4])
def test_fsdp2_reshard_matrix(fsdp2_checkpoints, m):
    """Save at N, load at M, for every N in {1,2,3,4}: all ranks reassemble the saved state bit-exactly."""
    ns = sorted(fsdp2_checkpoints)
    results = run_distributed(load_body, m, ([fsdp2_checkpoints[n][0] for n in ns], "fsdp2"))
    for i, n in enumerate(ns):
        _assert_same(fsdp2_checkpoints[n][1], results[0][i], f"{n}->{m}")


def _load_in_small_blocks(rank, world, paths, kind):
    """:func:`load_body` with chunk files read and checksummed 40 bytes at a time (a block is a part of an inner
    chunk, several blocks per ``preadv`` run): the block-by-block read is exercised on real shards."""
    from arraycheckpoint.engine import chunkread

    block = chunkread._BLOCK
    chunkread._BLOCK = 40
    try:
        return load_body(rank, world, paths, kind)
    finally:
        chunkread._BLOCK = block


def test_fsdp2_reshard_in_small_blocks(fsdp2_checkpoints):
    """Saved at 2 and at 4 ranks, loaded at 3 in 40-byte blocks: bit-exact."""
    ns = [2, 4]
    results = run_distributed(_load_in_small_blocks, 3, ([fsdp2_checkpoints[n][0] for n in ns], "fsdp2"))
    for i, n in enumerate(ns):
        _assert_same(fsdp2_checkpoints[n][1], results[0][i], f"{n}->3 in 40-byte blocks")


def test_fsdp2_to_plain_module(fsdp2_checkpoints):
    for n, (path, saved) in fsdp2_checkpoints.items():
        (loaded,) = load_body(0, 1, [path], "plain")
        _assert_same(saved, loaded, f"{n}->1")


def test_fsdp2_1d_to_hsdp_2d_mesh(fsdp2_checkpoints):
    path, saved = fsdp2_checkpoints[3]
    (loaded,) = run_distributed(load_body, 4, ([path], "hsdp"))[0]
    _assert_same(saved, loaded, "3 -> 2x2 mesh")


def test_fsdp1_to_fsdp2_and_back(tmp_path):
    p1, p2 = str(tmp_path / "fsdp1"), str(tmp_path / "fsdp2")
    saved1 = run_distributed(save_body, 3, (p1, "fsdp1"))[0]
    meta = acp.read_metadata(p1)
    # flat slices cut through rows: regions are the decomposed boxes of each rank's range
    assert any(len(t.shards) > 3 for t in meta.tensors.values())
    (loaded,) = run_distributed(load_body, 2, ([p1], "fsdp2"))[0]
    _assert_same(saved1, loaded, "fsdp1@3 -> fsdp2@2")
    saved2 = run_distributed(save_body, 2, (p2, "fsdp2"))[0]
    (loaded,) = run_distributed(load_body, 3, ([p2], "fsdp1"))[0]
    _assert_same(saved2, loaded, "fsdp2@2 -> fsdp1@3")


def test_ddp_writes_spread_and_load_into_fsdp2(tmp_path):
    path = str(tmp_path / "ddp")
    saved = run_distributed(save_body, 3, (path, "ddp"))[0]
    meta = acp.read_metadata(path)
    writers = {w for t in meta.tensors.values() for w in t.writers}
    assert writers == {0, 1, 2}, writers  # replicas written once, by every rank, not all by rank 0
    assert all(len(t.shards) == 1 for t in meta.tensors.values())
    (loaded,) = run_distributed(load_body, 2, ([path], "fsdp2"))[0]
    _assert_same(saved, loaded, "ddp@3 -> fsdp2@2")


def _dtensor_state(world):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh1, mesh2 = _mesh((world,)), None
    if world == 4:
        mesh2 = _mesh((2, 2))
    gen = torch.Generator().manual_seed(3)
    full = {
        "rows": torch.randn(10, 7, generator=gen),  # 10 rows over 4 ranks: 3,3,3,1
        "cols": torch.randn(5, 11, generator=gen).to(torch.bfloat16),
        "rep": torch.randn(6, generator=gen),
        "grid": torch.randn(9, 6, generator=gen),
    }
    placements = {"rows": [Shard(0)], "cols": [Shard(1)], "rep": [Replicate()], "grid": [Shard(0)]}
    meshes = {k: mesh1 for k in full}
    if mesh2 is not None:
        placements.update(grid=[Shard(0), Shard(1)], rep=[Shard(0), Replicate()])
        meshes.update(grid=mesh2, rep=mesh2)
    return full, {k: distribute_tensor(v, meshes[k], placements[k]) for k, v in full.items()}


def dtensor_save(rank, world, path):
    full, state = _dtensor_state(world)
    fut = acp.save_async(path, {"model": state})
    fut.staged.result()
    for v in state.values():
        v._local_tensor.zero_()  # mutation after the snapshot must not reach the checkpoint
    fut.result()
    # a second save of the same structure reuses the cached plan: no planning collective
    acp.save(path + "-again", {"model": _dtensor_state(world)[1]})
    phases = [p["phase"] for p in acp.read_metadata(path + "-again").metrics["save"][str(rank)]["phases"]]
    return {
        k: v.numpy() if v.dtype != torch.bfloat16 else v.view(torch.int16).numpy() for k, v in full.items()
    }, phases


def dtensor_load(rank, world, path):
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = _mesh((world,))
    _, like = _dtensor_state(4) if world == 4 else (None, None)
    targets = {
        "rows": distribute_tensor(torch.zeros(10, 7), mesh, [Shard(1)]),
        "cols": distribute_tensor(torch.zeros(5, 11, dtype=torch.bfloat16), mesh, [Shard(0)]),
        "rep": distribute_tensor(torch.zeros(6), mesh, [Shard(0)]),
        "grid": distribute_tensor(torch.zeros(9, 6), mesh, [Replicate()]),
    }
    acp.load(path, {"model": targets})
    out = {}
    for k, v in targets.items():
        f = v.full_tensor()
        out[k] = f.numpy() if f.dtype != torch.bfloat16 else f.view(torch.int16).numpy()
    return out


def test_dtensor_placements_1d_2d_uneven_and_plan_cache(tmp_path):
    path = str(tmp_path / "dt")
    results = run_distributed(dtensor_save, 4, (path,))
    expected, phases = results[0]
    assert "plan" not in phases and "write" in phases  # cached plan on the second save
    assert all("plan" not in r[1] for r in results)
    loaded = run_distributed(dtensor_load, 3, (path,))
    for k in expected:
        assert np.array_equal(expected[k], loaded[0][k]), k
        assert np.array_equal(expected[k], loaded[2][k]), k


def bad_shape_body(rank, world, path):
    state = {"w": torch.zeros(4 if rank == 0 else 5)}
    try:
        acp.save(path, {"model": state})
    except acp.SaveFailedError as e:
        return str(e)
    return None


def test_planning_error_reaches_every_rank(tmp_path):
    path = str(tmp_path / "bad")
    errors = run_distributed(bad_shape_body, 2, (path,))
    assert all(e is not None and "model/w" in e for e in errors), errors
    with pytest.raises(acp.CheckpointNotFoundError):
        acp.read_metadata(path)


def continuity_save(rank, world, path, steps_before, steps_after):
    model = _fsdp2(_model(0), _mesh((world,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    _step(model, opt, rank, world, steps=steps_before)
    acp.save(path, {"model": model, "optimizer": opt})
    return [_step(model, opt, rank, world, steps=1, batch=12)[0] for _ in range(steps_after)]


def continuity_load(rank, world, path, steps_after):
    model = _fsdp2(_model(99), _mesh((world,)))
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    acp.load(path, {"model": model, "optimizer": opt})
    return [_step(model, opt, rank, world, steps=1, batch=12)[0] for _ in range(steps_after)]


def test_training_continues_after_resharding_4_to_2(tmp_path):
    path = str(tmp_path / "cont")
    uninterrupted = run_distributed(continuity_save, 4, (path, 3, 3))[0]
    resumed = run_distributed(continuity_load, 2, (path, 3))[0]
    np.testing.assert_allclose(resumed, uninterrupted, rtol=1e-5, atol=1e-7)


def shared_read_body(rank, world, path, dedup):
    model = _model(rank + 50)  # plain replicated targets: every rank needs every full tensor
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    report: dict = {}
    acp.load(path, {"model": model, "optimizer": opt, "extra_state": {}}, dedup_reads=dedup, report=report)
    read: dict[str, int] = {}
    for p in report["metrics"]:
        read[p["phase"]] = read.get(p["phase"], 0) + p["bytes"]
    return _full_state(model, opt), read


def test_dedup_reads_read_each_shared_region_once(fsdp2_checkpoints):
    path, saved = fsdp2_checkpoints[4]
    plain = run_distributed(shared_read_body, 3, (path, False))
    shared = run_distributed(shared_read_body, 3, (path, True))
    for state, _ in plain + shared:
        _assert_same(saved, state, "4 -> 3 replicated targets")
    total = plain[0][1]["read"]
    assert all(r[1]["read"] == total for r in plain)  # without sharing every rank reads everything
    # with sharing each shared region is read by one rank: the ranks' reads add up to one copy
    assert sum(r[1]["read"] for r in shared) == total
    assert all(r[1]["read-shared"] == total for r in shared)


def save_twice_body(rank, world, path):
    model = _fsdp2(_model(0), _mesh((world,)))
    acp.save(path, {"model": model})
    try:  # rank 0 refuses (committed, no overwrite); every rank must hear of it, none may hang
        acp.save(path, {"model": model})
    except acp.SaveFailedError as e:
        return str(e)
    return None


def test_refused_save_fails_on_every_rank_without_hanging(tmp_path):
    errors = run_distributed(save_twice_body, 2, (str(tmp_path / "ck"),), timeout=120)
    assert all(e is not None and "already exists" in e for e in errors), errors
