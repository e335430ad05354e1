"""Where ranks are changes no save decision: chunks are written by ranks that hold them, so nothing travels
between ranks or hosts. Write balance at a few thousand simulated ranks (replicas balanced by worst fit; a
sharded layout writes what each rank holds), and the launcher's LOCAL_WORLD_SIZE (agreed, or not, by the
ranks of a real gloo job) never hangs a save nor changes it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist import run_distributed
from test_groupplan import check_plan, count_files

import arraycheckpoint as acp
from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan
from arraycheckpoint.planning.plan import PlanOptions, TensorDecl, build_global_plan
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.planning.rules import Mesh

BIG = dict(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20, inner_chunk_bytes=64)


def _rows(world_rows: list[int], cols: int = 4) -> list[list[TensorDecl]]:
    total, local, at = sum(world_rows), [], 0
    for n in world_rows:
        boxes = (Box((at, 0), (n, cols)),) if n else ()
        local.append([TensorDecl("w", (total, cols), "float32", 4, boxes)])
        at += n
    return local


def test_uneven_rows_are_written_where_they_are_whatever_the_hosts():
    """Ranks 0-2 hold 2 rows each, rank 3 holds 4, all far below the target file size: the grid nests in the
    rows (2-row chunks), every rank writes its own rows (the small files go into its packs) and nothing is
    sent, with or without host maps (the old planner shipped all 10 rows to one writer)."""
    local = _rows([2, 2, 2, 4])
    for options in (
        PlanOptions(**BIG),
        PlanOptions(**BIG, ranks_per_host=3),
        PlanOptions(**BIG, host_of=(7, 7, 7, 2)),
    ):
        plan = build_global_plan(local, options)
        assert plan.tensors["w"].layout.chunk_shape == (2, 4)
        assert plan.tensors["w"].writers == (0, 1, 2, 3, 3)
        assert not any(rp.sends or rp.recvs or rp.exchange for rp in plan.ranks)


_TENSORS: list = []  # the tensors of the last _scale call


def _scale(layout: str, world: int) -> tuple[list, int]:
    """Transformer-like tensors (bf16 params, fp32 Adam states) whose bytes per rank hold two target files."""
    h, ffn = 1024, 3584
    shapes = [(1280, h), (h, h), (ffn, h), (h, ffn)]
    tensors = []
    for layer in range(16):
        for k, s in enumerate(shapes):
            for state, (dt, isz) in enumerate((("bfloat16", 2), ("float32", 4), ("float32", 4))):
                tensors.append((f"l{layer}.{k}.{state}", s, dt, isz))
        tensors.append((f"l{layer}.norm", (h,), "float32", 4))
    _TENSORS[:] = tensors
    if layout == "ddp":
        decl = Decl((), tuple(TensorRule(n, s, d, i, ("replica",)) for n, s, d, i in tensors))
    else:
        mesh = Mesh((world,), tuple(range(world)))
        decl = Decl((mesh,), tuple(TensorRule(n, s, d, i, ("mesh", 0, (0,))) for n, s, d, i in tensors))
    return [(decl, range(world))], sum(int(np.prod(s)) * i for _n, s, _d, i in tensors)


@pytest.mark.parametrize("world", [512, pytest.param(2048, marks=pytest.mark.slow)])
@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_write_balance_at_simulated_scale(layout, world):
    """512 and 2,048 ranks (~270 KB per rank at 2,048), 100 KB target files, no byte moved. DDP: replicated chunks cut to at
    most (write_balance - 1) of a rank's share, every rank writes within ``write_balance`` of the mean. FSDP2:
    every rank writes exactly the rows it holds (Shard(0) of 1,024-3,584 rows over 2,048 ranks leaves some
    ranks without rows: that imbalance is the layout's, nothing moves to even it). Files under per-rank
    packs stay bounded by bytes plus ranks, and the plan is deterministic."""
    groups, total = _scale(layout, world)
    opts = PlanOptions(
        min_chunk_bytes=100_000, max_chunk_bytes=400_000, inner_chunk_bytes=1 << 14, ranks_per_host=8
    )
    plan = build_compact_plan(groups, world, opts)
    assert check_plan(plan, opts) == 0
    load = np.zeros(world)
    for name, d in plan.tensors.items():
        np.add.at(load, list(d.writers), plan._classes[name].nbytes)
    assert load.sum() == total
    if layout == "ddp":
        assert load.max() <= opts.write_balance * load.mean(), load.max() / load.mean()
    else:
        held = np.zeros(world)
        for _n, shape, _d, isz in _TENSORS:
            rows = -(-shape[0] // world)
            for r in range(world):
                held[r] += max(0, min(rows, shape[0] - r * rows)) * int(np.prod(shape[1:])) * isz
        assert np.array_equal(load, held)
    assert count_files(plan, opts.min_chunk_bytes) <= total / opts.min_chunk_bytes + world
    assert build_compact_plan(groups, world, opts).plan_id == plan.plan_id


def _save_with_hosts(rank, world, root, sizes):
    import os

    from arraycheckpoint.engine import engine

    os.environ["LOCAL_WORLD_SIZE"] = str(sizes[rank])
    os.environ["LOCAL_RANK"] = str(rank % sizes[rank])
    from arraycheckpoint.engine import SaveOptions
    from arraycheckpoint.planning.items import ArraySource, SaveRequest, SaveShard, SaveTensor
    from arraycheckpoint.runtime.collectives import default_communicator

    full = (np.arange(24 * 6, dtype=np.float32).reshape(24, 6) * 1.5).copy()
    lo, n = [(0, 3), (3, 3), (6, 9), (15, 9)][rank]  # uneven: files straddle ranks and hosts
    shard = SaveShard(Box((lo, 0), (n, 6)), ArraySource(full[lo : lo + n].copy()))
    req = SaveRequest([SaveTensor("model/w", (24, 6), full.dtype, [shard])], [], framework="torch")
    opts = SaveOptions(plan=PlanOptions(min_chunk_bytes=256, max_chunk_bytes=288, inner_chunk_bytes=96))
    engine().save_async(f"{root}/ck", req, default_communicator(), opts).result()
    plan = list(engine()._save._coordinator._plans.values())[-1].rank_plan
    mine = Box((lo, 0), (n, 6))
    return full, (
        plan.exchange,
        [w.chunk for w in plan.writes],
        all(mine.contains(w.chunk) for w in plan.writes),
    )


@pytest.mark.multiprocess
@pytest.mark.parametrize("sizes", [(2, 2, 2, 2), (2, 2, 4, 2)], ids=["agree", "disagree"])
def test_local_world_size_changes_nothing_and_the_save_reloads_resharded(tmp_path, sizes):
    """4 gloo ranks, hosts of 2 (LOCAL_WORLD_SIZE=2), or one rank saying 4 (no hang): every rank writes
    chunks of its own rows only (3, 3, 9, 9 rows: 3-row chunks, no exchange). The checkpoint reloads
    bit-exactly into one process (resharded from 4 uneven row blocks)."""
    results = run_distributed(_save_with_hosts, world=4, args=(str(tmp_path), sizes), timeout=180)
    for _f, (exchange, chunks, own) in results:
        assert not exchange and chunks and own
        assert all(c.lengths[0] <= 3 for c in chunks)
    full = results[0][0]
    out = {"w": torch.zeros(24, 6)}
    acp.load(tmp_path / "ck", {"model": out}, strict=False)
    assert np.array_equal(out["w"].numpy(), full)
    meta = acp.read_metadata(tmp_path / "ck")
    assert len(meta.tensors["model/w"].writers) > 1
