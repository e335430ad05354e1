"""Bug: a save hung when only one rank's structure changed (each rank decided alone to reuse its cached
plan). The cache decision is now one fixed-size all-reduce before the snapshot: a change anywhere replans
everywhere, and a rank that cannot describe its state fails the save on every rank, quickly."""

from __future__ import annotations

import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp

pytestmark = pytest.mark.multiprocess


def _change_on_one_rank(rank, world, root):
    import time

    from arraycheckpoint.format.perrank import PerRank

    w = torch.arange(12.0).reshape(6, 2) + rank
    times = []
    for step in range(4):
        buf = list(range(4 + (step if rank == world - 1 else 0)))  # only the last rank's list grows
        state = {"model": {"w": w}, "extra_state": {"buf": PerRank(buf), "step": step}}
        t0 = time.monotonic()
        acp.save(f"{root}/s{step}", state)
        times.append(time.monotonic() - t0)
    out = {"model": {"w": torch.zeros(6, 2)}, "extra_state": {"buf": PerRank(None), "step": 0}}
    acp.load(f"{root}/s3", out)
    return out["extra_state"]["buf"].value, out["extra_state"]["step"], times


def test_structure_change_on_one_rank_replans_everywhere(tmp_path):
    results = run_distributed(_change_on_one_rank, world=3, args=(str(tmp_path),), timeout=240)
    for rank, (buf, step, _times) in enumerate(results):
        assert step == 3
        assert buf == list(range(4 + (3 if rank == 2 else 0)))


def _bad_name_on_one_rank(rank, world, root):
    import time

    state = {"model": {"w": torch.ones(4)}}
    if rank == 1:
        state["model"]["../escape"] = torch.ones(2)  # an unsafe name on one rank only
    t0 = time.monotonic()
    try:
        acp.save(f"{root}/ck", state)
    except acp.ArrayCheckpointError as e:
        return str(e), time.monotonic() - t0
    return None, time.monotonic() - t0


def test_a_rank_that_cannot_declare_fails_the_save_on_every_rank(tmp_path):
    results = run_distributed(_bad_name_on_one_rank, world=3, args=(str(tmp_path),), timeout=120)
    for msg, _elapsed in results:
        assert msg is not None and "rank 1" in msg and "escape" in msg
    assert not (tmp_path / "ck").exists()


def _fsdp2_declarations_identical(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from arraycheckpoint.engine.coordinate import declaration_digest, declare
    from arraycheckpoint.engine.job import SaveOptions
    from arraycheckpoint.runtime.collectives import default_communicator

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    full = {k: v.clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    from arraycheckpoint.adapters.base import AdapterOptions
    from arraycheckpoint.adapters.torch import TorchAdapter

    req = TorchAdapter().save_request({"model": model}, AdapterOptions())
    comm = default_communicator()
    decl = declare(req.tensors, rank)
    digest = declaration_digest(decl, comm, SaveOptions()).hex()
    fut = acp.save_async(f"{root}/ck", {"model": model})
    fut.result()
    from arraycheckpoint.engine import engine

    mode = engine()._save._last_mode
    return digest, [t.rule[0] for t in decl.tensors], mode, {k: v.numpy() for k, v in full.items()}


def test_fsdp2_ranks_declare_identically_and_plan_without_collectives(tmp_path):
    import numpy as np

    results = run_distributed(_fsdp2_declarations_identical, world=3, args=(str(tmp_path),), timeout=240)
    assert len({r[0] for r in results}) == 1
    assert all(kinds == ["mesh"] * 4 for _d, kinds, _m, _f in results)
    assert {r[2] for r in results} == {"local"}
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))
    acp.load(tmp_path / "ck", {"model": model})
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), results[0][3][k]), k


def _flat_ranges_straddle(rank, world, root):
    """FSDP1-like flat ranges of ``w`` (elements 0-13, 13-27, 27-40 of a 10 x 4 tensor): no grid nests in
    ranges cut inside rows, so one chunk is written by rank 1 (it holds most of it) from its own piece and
    the pieces ranks 0 and 2 send it; replicas ``big0``/``big1`` on ranks 0 and 1 are written by a holder."""
    import numpy as np

    from arraycheckpoint.engine import SaveOptions, engine
    from arraycheckpoint.planning.items import ArraySource, SaveRequest, SaveShard, SaveTensor
    from arraycheckpoint.planning.plan import PlanOptions
    from arraycheckpoint.planning.regions import Box, flat_range_to_boxes
    from arraycheckpoint.runtime.collectives import default_communicator

    full = np.arange(40, dtype=np.float32).reshape(10, 4)
    big = np.ones((64, 4), dtype=np.float64)
    lo, hi = [(0, 13), (13, 27), (27, 40)][rank]
    flat = full.reshape(-1)
    shards = [
        SaveShard(b, ArraySource(full[b.slices()].copy())) for b in flat_range_to_boxes((10, 4), lo, hi)
    ]
    assert sum(s.box.volume for s in shards) == len(flat[lo:hi])
    tensors = [SaveTensor("model/w", (10, 4), full.dtype, shards)]
    if rank < 2:
        for name in ("model/big0", "model/big1"):  # replicas on ranks 0 and 1: one each
            shard = SaveShard(Box((0, 0), (64, 4)), ArraySource(big))
            tensors.append(SaveTensor(name, (64, 4), big.dtype, [shard]))
    req = SaveRequest(tensors, [], framework="torch")
    opts = SaveOptions(plan=PlanOptions(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20))
    engine().save_async(f"{root}/ck", req, default_communicator(), opts).result()
    plan = list(engine()._save._coordinator._plans.values())[-1].rank_plan
    return full, [(t.src, t.dst) for t in plan.sends]


def test_a_straddling_chunk_of_flat_ranges_is_assembled_by_the_holder_of_most_of_it(tmp_path):
    import numpy as np

    results = run_distributed(_flat_ranges_straddle, world=3, args=(str(tmp_path),), timeout=120)
    full = results[0][0]
    assert sorted(p for _f, sends in results for p in sends) == [(0, 1), (0, 1), (2, 1), (2, 1)], results
    meta = acp.read_metadata(tmp_path / "ck")
    assert meta.tensors["model/w"].writers == (1,)  # 14 of its 40 elements are on rank 1
    assert {meta.tensors[n].writers for n in ("model/big0", "model/big1")} == {(0,), (1,)}
    out = {"w": torch.zeros(10, 4), "big0": torch.zeros(64, 4, dtype=torch.float64)}
    acp.load(tmp_path / "ck", {"model": out}, strict=False)
    assert np.array_equal(out["w"].numpy(), full)
