"""Write balance of Megatron-like layouts (TP x PP x DP, pipeline stages holding a few percent more or less
than the mean): every chunk is written by one of the data-parallel replicas holding it (nothing moves),
replicated regions are cut to at most (write_balance - 1) of a holder's share so the worst fit evens them.
Simulated at a few thousand ranks, and the rule path compared with the expanded regions."""

from __future__ import annotations

import numpy as np
import pytest
from test_groupplan import _expand, check_plan, count_files

from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan, rank_plan
from arraycheckpoint.planning.owners import replica_caps
from arraycheckpoint.planning.plan import PlanOptions, build_global_plan
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.planning.rules import Mesh, chunk_bounds

H, FFN = 1024, 3584
STATES = (("bfloat16", 2), ("float32", 4), ("float32", 4))  # a parameter and its two Adam states


def _megatron(tp: int, pp: int, dp: int, layers: int, h: int = H, ffn: int = FFN) -> tuple[list, int]:
    """Groups of a TP x PP x DP Megatron job (rank = t + tp * (q + dp * p): a TP group per host of ``tp``
    ranks), column/row-parallel tensors, a vocabulary embedding on stage 0 (that stage holds ~4% more)."""
    kinds = [("qkv", (h + h // 4, h), 0), ("out", (h, h), 1), ("fc1", (ffn, h), 0), ("fc2", (h, ffn), 1)]
    per_stage: list[list[tuple[str, tuple[int, int], int]]] = [[] for _ in range(pp)]
    for layer in range(layers):
        per_stage[layer * pp // layers] += [(f"l{layer}.{k}", s, d) for k, s, d in kinds]
    per_stage[0].append(("embed", (2 * h, h), 0))
    groups = []
    for p in range(pp):
        for t in range(tp):
            rules = []
            for base, shape, dim in per_stage[p]:
                off, length = chunk_bounds(shape[dim], tp)[t]
                offs, lens = [0, 0], list(shape)
                offs[dim], lens[dim] = off, length
                box = Box(tuple(offs), tuple(lens))
                for state, (dt, isz) in enumerate(STATES):
                    rules.append(TensorRule(f"{base}.{state}", shape, dt, isz, ("boxes", (box,))))
                rules.append(TensorRule(f"{base}.norm", (shape[0],), "float32", 4, ("replica",)))
            groups.append((Decl((), tuple(rules)), [t + tp * (q + dp * p) for q in range(dp)]))
    return groups, tp * pp * dp


def _loads(plan) -> np.ndarray:
    """Bytes written per rank."""
    load = np.zeros(plan.world)
    for name, d in plan.tensors.items():
        np.add.at(load, list(d.writers), plan._classes[name].nbytes)
    return load


@pytest.mark.parametrize("dp", [16, pytest.param(64, marks=pytest.mark.slow)])
def test_megatron_balance_at_simulated_scale(dp):
    """TP=8 x PP=4 x DP (512 and 2,048 ranks), ~770 KB per rank. The stage holding the embedding has ~4%
    more than the mean, and no byte leaves its stage: every rank writes within 1.1 x the mean, nothing
    travels, every chunk is at most ``max_chunk_bytes``, files under per-rank packs stay bounded by bytes
    plus ranks, and the plan is deterministic."""
    groups, world = _megatron(8, 4, dp, 16)
    opts = PlanOptions(
        min_chunk_bytes=100_000, max_chunk_bytes=400_000, inner_chunk_bytes=1 << 14, ranks_per_host=8
    )
    plan = build_compact_plan(groups, world, opts)
    assert check_plan(plan, opts) == 0
    load = _loads(plan)
    assert load.max() / load.mean() <= 1.1, load.max() / load.mean()
    assert count_files(plan, opts.min_chunk_bytes) <= load.sum() / opts.min_chunk_bytes + world
    assert build_compact_plan(groups, world, opts).plan_id == plan.plan_id


def test_replica_caps():
    """A replicated region's chunks hold at most (balance - 1) of what each of its holders writes from its
    holder set (all regions of that set together), within [min_bytes, max_bytes]."""
    regions = [(16_000, [0, 1, 2, 3]), (16_000, [0, 1, 2, 3]), (100, [4, 5]), (10**9, [6, 7])]
    caps = replica_caps(regions, 64, 1.05, 1 << 20)
    assert caps == {(0, 1, 2, 3): 400, (4, 5): 64, (6, 7): 1 << 20}


@pytest.mark.parametrize("per_host", [0, 2, 4])
def test_both_planners_agree_on_a_stage_balanced_megatron_layout(per_host):
    """TP=2 x PP=4 x DP=4 (32 ranks), replicated regions cut for balance: the rule path and the expanded
    regions give every rank the same work, none of it received from another rank."""
    groups, world = _megatron(2, 4, 4, 4, h=16, ffn=40)
    opts = PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=1 << 12, inner_chunk_bytes=256)
    opts = PlanOptions(**{**opts.__dict__, "ranks_per_host": per_host, "write_balance": 1.02})
    ref = build_global_plan(_expand(groups, world), opts)
    new = build_compact_plan(groups, world, opts)
    assert check_plan(new, opts) == 0
    assert any(len(d.writers) > 1 for d in new.tensors.values())  # replicas cut into several chunks
    for name, tp in ref.tensors.items():
        assert tuple(new.tensors[name].writers.tolist()) == tp.writers, name
        assert new.tensors[name].layout == tp.layout, name
    for r in range(world):
        a, b = ref.ranks[r], rank_plan(new, r)
        assert (a.writes, a.sends, a.recvs, a.create) == (b.writes, b.sends, b.recvs, b.create), r


def _bench_fsdp2(world: int, count: int = 1000) -> list:
    """The 414 GB state of benchmarks/bench_plan_scale.py (qkv, out, fc1, fc2 in bf16 with two fp32 Adam
    states, norms), Shard(0) over ``world`` ranks."""
    h, ffn, qkv = 8192, 28672, 10240
    kinds = [((qkv, h),), ((h, h),), ((ffn, h),), ((h, ffn),), ((h,),)]
    rules = []
    for layer in range(-(-count // 15)):
        for k, (shape,) in enumerate(kinds):
            for state, (dt, isz) in enumerate(STATES):
                rules.append(TensorRule(f"l{layer}.{k}.{state}", shape, dt, isz, ("mesh", 0, (0,))))
    mesh = Mesh((world,), tuple(range(world)))
    return [(Decl((mesh,), tuple(rules[:count])), range(world))]


@pytest.mark.parametrize("world", [32, 48, 64])
def test_no_chunk_above_max_chunk_bytes_at_the_sizes_that_made_70_mib_files(world):
    """FSDP2 over 32-64 ranks of the benchmark's 414 GB state made 70 MiB chunk files (grids rounded to shard
    boundaries without the cap). Every chunk now holds at most ``max_chunk_bytes`` (64 MiB), lies inside its
    writer's shard, and nothing travels."""
    opts = PlanOptions()
    plan = build_compact_plan(_bench_fsdp2(world), world, opts)
    assert max(int(c.nbytes.max()) for c in plan._classes.values()) <= opts.max_chunk_bytes
    assert check_plan(plan, opts) == 0
