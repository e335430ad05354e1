"""Host maps in the save planner: owners on the host holding most of a chunk, fragments sent from the owner's
host, write balance at a few thousand simulated ranks, and the launcher's LOCAL_WORLD_SIZE agreed by every
rank of a real gloo job (a disagreement plans without a host map everywhere, it never hangs)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.groupplan import Decl, TensorRule, build_compact_plan, rank_plan
from arraycheckpoint.owners import HostMap
from arraycheckpoint.plan import PlanOptions, TensorDecl, build_global_plan
from arraycheckpoint.regions import Box
from arraycheckpoint.rules import Mesh

BIG = dict(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20, inner_chunk_bytes=64)


def _rows(world_rows: list[int], cols: int = 4) -> list[list[TensorDecl]]:
    total, local, at = sum(world_rows), [], 0
    for n in world_rows:
        boxes = (Box((at, 0), (n, cols)),) if n else ()
        local.append([TensorDecl("w", (total, cols), "float32", 4, boxes)])
        at += n
    return local


def test_a_chunk_spanning_two_hosts_is_owned_on_the_host_holding_most_of_it():
    """Ranks 0-2 (host 0) hold 2 rows each, rank 3 (host 1) holds 4: one file of 10 rows. Without a host map
    the rank holding most (3) writes it; with hosts of 3 ranks, host 0 holds 6 rows and writes it, and only
    rank 3's fragment crosses hosts. Both planners agree, and an explicit host id list says the same."""
    local = _rows([2, 2, 2, 4])
    alone = build_global_plan(local, PlanOptions(**BIG))
    assert alone.tensors["w"].writers == (3,)
    for options in (PlanOptions(**BIG, ranks_per_host=3), PlanOptions(**BIG, host_of=(7, 7, 7, 2))):
        plan = build_global_plan(local, options)
        (owner,) = plan.tensors["w"].writers
        assert owner in (0, 1, 2)
        hosts = options.host_map(4)
        crossing = [t for rp in plan.ranks for t in rp.sends if hosts.host(t.src) != hosts.host(t.dst)]
        assert [t.src for t in crossing] == [3]
        groups = [
            (Decl((), (TensorRule("w", (10, 4), "float32", 4, ("boxes", x[0].boxes)),)), [r])
            for r, x in enumerate(local)
        ]
        compact = build_compact_plan(groups, 4, options)
        assert compact.tensors["w"].writers == plan.tensors["w"].writers
        for r in range(4):
            assert rank_plan(compact, r).sends == plan.ranks[r].sends


def test_replicated_fragments_come_from_the_owners_host():
    """HSDP, 2 replicas x 4 shards, one replica per host: every fragment a writer lacks is on its own host."""
    world = 8
    mesh = Mesh((2, 4), tuple(range(world)))
    tensors = tuple(TensorRule(f"t{i}", (16, 8), "float32", 4, ("mesh", 0, (-1, 0))) for i in range(24))
    opts = PlanOptions(min_chunk_bytes=512, max_chunk_bytes=4096, inner_chunk_bytes=128, ranks_per_host=4)
    plan = build_compact_plan([(Decl((mesh,), tensors), range(world))], world, opts)
    sends = [t for r in range(world) for t in rank_plan(plan, r).sends]
    assert sends and all(t.src // 4 == t.dst // 4 for t in sends)
    writers = [w for d in plan.tensors.values() for w in d.writers]
    assert {w // 4 for w in writers} == {0, 1}  # both hosts write


def test_hostmap_forms():
    hm = HostMap(10, 4)
    assert hm.host(9) == 2 and hm.members([2]).tolist() == [8, 9]
    ids = HostMap(4, host_of=(5, 1, 5, 1))
    assert ids.hosts(np.arange(4)).tolist() == [5, 1, 5, 1] and ids.members([1]).tolist() == [1, 3]
    with pytest.raises(ValueError):
        HostMap(3, host_of=(0, 1))


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
    if layout == "ddp":
        decl = Decl((), tuple(TensorRule(n, s, d, i, ("replica",)) for n, s, d, i in tensors))
    else:
        mesh = Mesh((world,), tuple(range(world)))
        decl = Decl((mesh,), tuple(TensorRule(n, s, d, i, ("mesh", 0, (0,))) for n, s, d, i in tensors))
    return [(decl, range(world))], sum(int(np.prod(s)) * i for _n, s, _d, i in tensors)


@pytest.mark.parametrize("layout", ["fsdp2", "ddp"])
def test_write_balance_at_2048_simulated_ranks(layout):
    """2,048 ranks, ~270 KB per rank, 100 KB target files: every rank writes about as much (<= 1.1 x the
    mean; per-tensor grids gave 1.2-1.6), files stay bounded by bytes, and the plan is deterministic."""
    world = 2048
    groups, total = _scale(layout, world)
    opts = PlanOptions(
        min_chunk_bytes=100_000, max_chunk_bytes=400_000, inner_chunk_bytes=1 << 14, ranks_per_host=8
    )
    plan = build_compact_plan(groups, world, opts)
    load = np.zeros(world)
    files = 0
    for name, d in plan.tensors.items():
        for c, w in zip(plan._classes[name].chunks, d.writers):
            load[w] += c.volume * (2 if d.layout.dtype == "bfloat16" else 4)
            files += 1
    assert load.sum() == total
    assert load.max() / load.mean() <= 1.1, load.max() / load.mean()
    assert files <= 2 * world + len(plan.tensors)
    assert build_compact_plan(groups, world, opts).plan_id == plan.plan_id


def _save_with_hosts(rank, world, root, sizes):
    import os

    from arraycheckpoint.engine import engine

    os.environ["LOCAL_WORLD_SIZE"] = str(sizes[rank])
    os.environ["LOCAL_RANK"] = str(rank % sizes[rank])
    from arraycheckpoint.collectives import default_communicator
    from arraycheckpoint.engine import SaveOptions
    from arraycheckpoint.items import ArraySource, SaveRequest, SaveShard, SaveTensor

    full = (np.arange(24 * 6, dtype=np.float32).reshape(24, 6) * 1.5).copy()
    lo, n = [(0, 3), (3, 3), (6, 9), (15, 9)][rank]  # uneven: files straddle ranks and hosts
    shard = SaveShard(Box((lo, 0), (n, 6)), ArraySource(full[lo : lo + n].copy()))
    req = SaveRequest([SaveTensor("model/w", (24, 6), full.dtype, [shard])], [], framework="torch")
    opts = SaveOptions(plan=PlanOptions(min_chunk_bytes=256, max_chunk_bytes=288, inner_chunk_bytes=96))
    engine().save_async(f"{root}/ck", req, default_communicator(), opts).result()
    plans = list(engine()._save._coordinator._plans.values())
    return full, plans[-1].compact.hostmap.block


@pytest.mark.multiprocess
@pytest.mark.parametrize("sizes,agreed", [((2, 2, 2, 2), 2), ((2, 2, 4, 2), 1)], ids=["agree", "disagree"])
def test_local_world_size_is_agreed_and_the_save_reloads_resharded(tmp_path, sizes, agreed):
    """4 gloo ranks, hosts of 2 (LOCAL_WORLD_SIZE=2): the plan uses the host map on every rank; one rank
    saying 4 makes every rank plan without one (no hang). Either way the checkpoint reloads bit-exactly
    into one process (resharded from 4 uneven row blocks)."""
    results = run_distributed(_save_with_hosts, world=4, args=(str(tmp_path), sizes), timeout=180)
    assert [block for _f, block in results] == [agreed] * 4
    full = results[0][0]
    out = {"w": torch.zeros(24, 6)}
    acp.load(tmp_path / "ck", {"model": out}, strict=False)
    assert np.array_equal(out["w"].numpy(), full)
    meta = acp.read_metadata(tmp_path / "ck")
    assert len(meta.tensors["model/w"].writers) > 1
