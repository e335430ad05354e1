"""The save control plane at scale, simulated in one process (no processes, no I/O).

Runs the real code of a save's control plane for N ranks: each layout's per-rank declarations
(``engine.coordinate.declare`` input built the way the adapters build it), the digest agreement, the
declaration gather (``group_digests`` / ``pack_groups`` / ``unpack_groups``), the planner
(``groupplan.build_compact_plan``), each rank's work list (``groupplan.rank_plan``) and the metadata
(``build_metadata`` -> JSON -> ``CheckpointMetadata.from_json``, then every writer a reader derives from the
layout, format 7, checked against the plan: ``writers_derive_s``). A ledger stands in for the communicator: it
counts the bytes each rank would send and receive in every collective of one save (agreement, declarations,
plan, commit statuses and outcome), payload bytes only.

    python benchmarks/bench_plan_scale.py --ranks 10000 --tensors 1000 --layout fsdp2 --json

Layouts (transformer-like tensors: qkv, out, fc1, fc2 in bf16 with two fp32 optimizer states each, norms):
``fsdp2`` every tensor Shard(0) over all ranks (DTensor rule); ``ddp`` every tensor replicated;
``megatron`` TP=8 x PP=16 x DP (ranks rounded down to a multiple of 128), column/row parallel splits, every
rank declaring mesh rules on megatron's process grids, as the megatron adapter does (``planning.grids``);
``megatron-boxes`` the same layout declared as boxes (the adapter before grids: one declaration per (TP, PP)
position, every DP replica declaring its regions); ``moe`` / ``moe-boxes`` a mixture-of-experts model
(:func:`moe_tensors`: 256 experts, each local expert its own box) on TP=8 x PP=16 x DP with expert
parallelism EP (:func:`moe_world`), as rules on the grids / as boxes;
``fsdp1`` one FSDP1 flat parameter per layer over all ranks (bf16 alignment padding between parameters,
world-size padding at the end): parameters and Adam states as range rules, a state declared only by the
ranks whose range touches its parameter (as torch's optimizer holds it), so ranks differ by which states
they hold; ``jax`` a NamedSharding mesh (replica, fsdp=16, model=8 devices of one process; ranks rounded down
to a multiple of 16), P("fsdp", "model") / P("model", "fsdp") / P(), one mesh rule per tensor.
For ``fsdp1`` and ``jax`` the declarations come from ``engine.coordinate.declare`` fed what the adapters
feed it (rule plus the boxes the rank holds), for one representative rank per distinct declaration, and a
sample of other ranks is checked to produce the same digest.

``--perrank stacked`` adds a ``PerRank`` RNG state (what :func:`arraycheckpoint.rng.capture` returns with torch
imported: three arrays and a few scalars) on every rank, built by the real ``stateful.save_items``: stacked
into one ``[N, *shape]`` array per slot (the form saved when every rank's rows agree), its JSON document split
into one template (stored once, from the coordinator's request) and rows of numeric leaves (format 4,
:mod:`arraycheckpoint.format.rankdoc`); ``--perrank per-rank`` declares the fallback instead (one array per rank per
slot, as format 2 stored it before stacking, and every rank's JSON document in its commit status and in the
metadata). Each rank's RNG state differs in its numbers (numpy's ``pos`` and cached gaussian), as real ones do.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import resource
import sys
import time
import zlib
from typing import Any

import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0])

from arraycheckpoint.codecs import numpy_dtype
from arraycheckpoint.engine.coordinate import (
    METRICS_SAMPLE,
    build_metadata,
    declare,
    group_digests,
    pack_groups,
    unpack_groups,
)
from arraycheckpoint.format.metadata import CheckpointMetadata
from arraycheckpoint.planning.groupplan import Decl, TensorRule, build_compact_plan, rank_plan
from arraycheckpoint.planning.items import SaveObject, SaveRequest, SaveShard, SaveTensor
from arraycheckpoint.planning.owners import fragment_source
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.planning.rules import Mesh, chunk_bounds, digest, rule_boxes
from arraycheckpoint.runtime.monitoring import PhaseRecorder


class HostMap:
    """Hosts as contiguous blocks of ``per_host`` ranks (to count the bytes that would cross hosts)."""

    def __init__(self, world: int, per_host: int = 1) -> None:
        self.block = max(1, per_host)

    def host(self, r: int) -> int:
        return r // self.block

    def hosts(self, rs: np.ndarray) -> np.ndarray:
        return rs // self.block


ZARR_JSON_BYTES = 1024  # about one array's zarr.json (it goes into its creator's packs)


def count_files(plan, min_chunk_bytes: int) -> dict[str, int]:
    """Files of a save under per-rank packs: every chunk file of at least ``min_chunk_bytes`` is one file;
    each rank's smaller chunk files plus the zarr.json of the arrays it creates fill packs of about
    ``min_chunk_bytes`` (``ceil(bytes / min_chunk_bytes)`` per rank). Group documents and control files (a
    few) are not counted."""
    small = np.zeros(plan.world, dtype=np.int64)
    own = 0
    for name, d in plan.tensors.items():
        nb = plan._classes[name].nbytes
        ws = np.asarray(d.writers, dtype=np.int64)
        big = nb >= min_chunk_bytes
        own += int(big.sum())
        small += np.bincount(ws[~big], weights=nb[~big], minlength=plan.world).astype(np.int64)
        small[d.creator] += ZARR_JSON_BYTES
    packs = int((-(-small // max(1, min_chunk_bytes))).sum())
    return {"files": own + packs, "chunk_files": own, "packs": packs}


H, FFN, HEADS_KV = 8192, 28672, 10240
_BF16 = np.dtype("uint16")  # placeholder numpy dtype of itemsize 2 (replaced below when ml_dtypes exists)
try:
    import ml_dtypes

    _BF16 = np.dtype(ml_dtypes.bfloat16)
except ImportError:  # pragma: no cover
    pass


def model_tensors(count: int) -> list[tuple[str, tuple[int, ...], str, int, str]]:
    """(name, shape, dtype, itemsize, tp_split) for ``count`` tensors: params and their two Adam states."""
    kinds = [
        ("qkv", (HEADS_KV, H), "col"),
        ("out", (H, H), "row"),
        ("fc1", (FFN, H), "col"),
        ("fc2", (H, FFN), "row"),
        ("norm", (H,), "rep"),
    ]
    return _layers(kinds, count)


def _layers(
    kinds: list[tuple[str, tuple[int, ...], str]], count: int
) -> list[tuple[str, tuple[int, ...], str, int, str]]:
    """``count`` tensors of layers made of ``kinds``: each a bfloat16 parameter and its two Adam states."""
    out = []
    layer = 0
    while len(out) < count:
        for kind, shape, split in kinds:
            base = f"layers.{layer}.{kind}"
            out.append((f"model/{base}", shape, "bfloat16", 2, split))
            out.append((f"optimizer/{base}/exp_avg", shape, "float32", 4, split))
            out.append((f"optimizer/{base}/exp_avg_sq", shape, "float32", 4, split))
        layer += 1
    return out[:count]


EXPERTS, FFN_E = 256, 2048  # mixture of experts (DeepSeek-V3-like counts, hidden size H)
MOE_TP, MOE_PP = 8, 16


def moe_tensors(count: int) -> list[tuple[str, tuple[int, ...], str, int, str]]:
    """Like :func:`model_tensors` for a mixture-of-experts transformer: per layer qkv, out, norm, the router
    (replicated) and the experts' fc1 (gated: ``2 * FFN_E`` rows) and fc2, the expert index first."""
    kinds = [
        ("qkv", (HEADS_KV, H), "col"),
        ("out", (H, H), "row"),
        ("norm", (H,), "rep"),
        ("router", (EXPERTS, H), "rep"),
        ("experts.fc1", (EXPERTS, 2 * FFN_E, H), "efc1"),
        ("experts.fc2", (EXPERTS, H, FFN_E), "efc2"),
    ]
    return _layers(kinds, count)


MOE_EP: int | None = None  # --ep: expert parallelism instead of moe_world's choice
VP = 2  # --vp: virtual pipeline stages of the vpp layout


def moe_world(ranks: int) -> tuple[int, int]:
    """(world, EP) of the MoE layout: TP=8 x PP=16 x DP, experts over EP (``--ep``, else the largest of 64,
    32, 16, 8 up to a stage's ranks; expert TP 1), ranks rounded down to a multiple of PP x max(TP, EP)."""
    stage = max(MOE_TP, ranks // MOE_PP)
    ep = MOE_EP or next((e for e in (64, 32, 16, 8) if stage >= e), MOE_TP)
    stage -= stage % max(MOE_TP, ep)
    return stage * MOE_PP, ep


def moe_boxes(
    rank: int, world: int, ep: int, s: tuple[int, ...], split: str, experts: int = EXPERTS
) -> list[Box]:
    """The boxes megatron gives ``rank`` of a tensor: dense rank generator (tp-cp-dp-pp: tp = rank % TP),
    expert one (etp-ep-edp-pp with expert TP 1: ep = rank in stage % EP); each local expert is its own
    ShardedTensor (box), as megatron's SequentialMLP declares them."""
    stage = world // MOE_PP
    t, e = rank % MOE_TP, (rank % stage) % ep
    if split == "rep":
        return [Box.full(s)]
    if split in ("col", "row"):
        dim = 0 if split == "col" else 1
        off, length = chunk_bounds(s[dim], MOE_TP)[t]
        offs, lens = [0, 0], list(s)
        offs[dim], lens[dim] = off, length
        return [Box(tuple(offs), tuple(lens))]
    local = experts // ep
    return [Box((x,) + (0,) * (len(s) - 1), (1, *s[1:])) for x in range(e * local, (e + 1) * local)]


def moe_grids(rank: int, world: int, ep: int) -> list:
    """The dense and expert grids of ``rank`` as :func:`megatron_grid.process_grids` rebuilds them from
    megatron's process groups (here from the same rank generators as :func:`moe_boxes`)."""
    from arraycheckpoint.planning.grids import Grid

    stage = world // MOE_PP
    p, q = divmod(rank, stage)
    t, d = q % MOE_TP, q // MOE_TP
    e, ed = q % ep, q // ep
    dense = {
        "tp": [p * stage + d * MOE_TP + i for i in range(MOE_TP)],
        "dp": [p * stage + i * MOE_TP + t for i in range(stage // MOE_TP)],
        "pp": [i * stage + q for i in range(MOE_PP)],
    }
    expert = {
        "ep": [p * stage + ed * ep + i for i in range(ep)],
        "edp": [p * stage + i * ep + e for i in range(stage // ep)],
        "pp": dense["pp"],
    }
    return [g for g in (Grid.from_groups(rank, world, dense), Grid.from_groups(rank, world, expert)) if g]


def moe_groups(
    ranks: int, tensors, rules: bool, dense: bool = False
) -> tuple[list[tuple[Decl, list[int]]], int]:
    """MoE over TP=8 x PP=16 x DP with EP (:func:`moe_world`). ``rules=False``: boxes, as the megatron adapter
    declared them before grids (one declaration per (PP, TP, EP) position); ``rules=True``: the adapter's
    mesh rules on megatron's grids (``planning.grids``), declared by ``declare()`` for one rank per stage,
    and a sample of other ranks checked to produce the same digest."""
    world, ep = moe_world(ranks)
    if dense:  # no experts: TP=8 x PP=16 x DP, ranks rounded down to a multiple of 128
        world, ep = max(1, ranks // (MOE_TP * MOE_PP)) * MOE_TP * MOE_PP, MOE_TP
    stage = world // MOE_PP
    stage_of = {n: (k * MOE_PP) // len(tensors) for k, (n, *_r) in enumerate(tensors)}
    if not rules:
        groups: dict[tuple[int, ...], tuple[Decl, list[int]]] = {}
        for r in range(world):
            key = (r // stage, r % MOE_TP, (r % stage) % ep)
            if key not in groups:
                own = [
                    TensorRule(
                        n,
                        s,
                        d,
                        i,
                        ("replica",)
                        if split == "rep"
                        else ("boxes", tuple(moe_boxes(r, world, ep, s, split))),
                    )
                    for n, s, d, i, split in tensors
                    if stage_of[n] == r // stage
                ]
                groups[key] = (Decl((), tuple(own)), [])
            groups[key][1].append(r)
        return list(groups.values()), world
    from arraycheckpoint.planning.grids import GridRules

    def build(rank: int) -> Decl:
        finder = GridRules(moe_grids(rank, world, ep))
        items = []
        for n, s, d, _i, split in tensors:
            if stage_of[n] != rank // stage:
                continue
            boxes = moe_boxes(rank, world, ep, s, split)
            dt = np.dtype("float32") if d == "float32" else _BF16
            items.append(SaveTensor(n, s, dt, [SaveShard(b, None) for b in boxes], finder.rule(s, boxes)))
        return declare(items, rank)

    out = []
    rng = random.Random(3)
    for p in range(MOE_PP):
        members = list(range(p * stage, (p + 1) * stage))
        decl = build(members[0])
        for r in rng.sample(members[1:], min(3, len(members) - 1)):
            _same_digest(decl, r, build)
        out.append((decl, members))
    return out, world


STACK_H, STACK_F, STACK_KV, STACK_E = 2048, 1024, 2560, 64  # stacked layouts: per-layer sizes, experts
STACK_CHUNK = 2  # layers per (virtual) pipeline chunk


def stacked_tensors(count: int, vp: int) -> list[tuple[str, tuple[int, ...], str, int, str]]:
    """A stacked-layer MoE transformer as megatron's ``sharded_state_dict`` declares it: every tensor has the
    layer axis first (``MOE_PP * vp * STACK_CHUNK`` layers, every stage holding some), the experts' index
    second (``STACK_E`` experts: every stacked tensor holds layers x experts boxes, so the chunks a plan
    makes grow with both); ``count`` tensors as towers of the six kinds (param and two Adam states each)."""
    layers = MOE_PP * vp * STACK_CHUNK
    kinds = [
        ("qkv", (layers, STACK_KV, STACK_H), "col"),
        ("out", (layers, STACK_H, STACK_H), "row"),
        ("norm", (layers, STACK_H), "rep"),
        ("router", (layers, STACK_E, STACK_H), "rep"),
        ("experts.fc1", (layers, STACK_E, 2 * STACK_F, STACK_H), "efc1"),
        ("experts.fc2", (layers, STACK_E, STACK_H, STACK_F), "efc2"),
    ]
    out = []
    tower = 0
    while len(out) < count:
        for kind, shape, split in kinds:
            base = f"tower{tower}.layers.{kind}"
            out.append((f"model/{base}", shape, "bfloat16", 2, split))
            out.append((f"optimizer/{base}/exp_avg", shape, "float32", 4, split))
            out.append((f"optimizer/{base}/exp_avg_sq", shape, "float32", 4, split))
        tower += 1
    return out[:count]


def stacked_boxes(rank: int, world: int, ep: int, vp: int, s: tuple[int, ...], split: str) -> list[Box]:
    """``rank``'s boxes of a stacked tensor: one per layer it holds (stage ``p`` holds chunk ``v * PP + p`` of
    every virtual stage ``v``: interleaved, non-contiguous) times its per-layer boxes (:func:`moe_boxes`)."""
    p = rank // (world // MOE_PP)
    layers = [(v * MOE_PP + p) * STACK_CHUNK + j for v in range(vp) for j in range(STACK_CHUNK)]
    per_layer = moe_boxes(rank, world, ep, s[1:], split, STACK_E)
    return [Box((x, *b.offsets), (1, *b.lengths)) for x in layers for b in per_layer]


def stacked_groups(ranks: int, tensors, vp: int) -> tuple[list[tuple[Decl, list[int]]], int]:
    """Stacked MoE (``vp`` interleaved virtual stages) as the megatron adapter declares it: its boxes, as
    mesh rules on the grids where :class:`GridRules` finds them (``declare()`` keeps a rule only when it
    states the rank's boxes). Ranks with the same (PP, TP, EP) coordinates hold the same boxes: one
    declaration is built per such position (a sample of other ranks checked to match) and equal ones are
    merged; when a sample of the whole world agrees with rank 0, one declaration stands for all."""
    from arraycheckpoint.planning.grids import GridRules

    world, ep = moe_world(ranks)
    stage = world // MOE_PP

    def build(rank: int) -> Decl:
        finder = GridRules(moe_grids(rank, world, ep))
        items = []
        for n, s, d, _i, split in tensors:
            boxes = stacked_boxes(rank, world, ep, vp, s, split)
            dt = np.dtype("float32") if d == "float32" else _BF16
            rule = finder.rule(s, boxes, 2 if split.startswith("e") else 1)
            items.append(SaveTensor(n, s, dt, [SaveShard(b, None) for b in boxes], rule))
        return declare(items, rank)

    rng = random.Random(5)
    first = build(0)
    try:
        for r in rng.sample(range(1, world), min(8, world - 1)):
            _same_digest(first, r, build)
        return [(first, list(range(world)))], world
    except AssertionError:
        pass
    keys: dict[tuple[int, int, int], list[int]] = {}
    for r in range(world):
        keys.setdefault((r // stage, r % MOE_TP, (r % stage) % ep), []).append(r)
    merged: dict[bytes, tuple[Decl, list[int]]] = {}
    for members in keys.values():
        decl = build(members[0])
        if len(members) > 1:
            _same_digest(decl, rng.choice(members[1:]), build)
        merged.setdefault(digest(decl.to_json()), (decl, []))[1].extend(members)
    return [(d, sorted(rs)) for d, rs in merged.values()], world


def blocks_groups(ranks: int, tensors) -> tuple[list[tuple[Decl, list[int]]], int]:
    """A sharded dict built by hand, no process grid: every rank holds its ``torch.chunk`` part of every
    tensor's first axis (a different box per rank), declared by ``declare()`` with the world size (a mesh
    rule on the world's 1-D grid where the box is the rank's part; boxes before that). Declarations are
    built for a sample of ranks; when they all agree one stands for every rank, else each rank's own."""
    import inspect

    world_arg = "world" in inspect.signature(declare).parameters

    def build(rank: int) -> Decl:
        items = []
        for n, s, d, _i, _split in tensors:
            off, length = chunk_bounds(s[0], ranks)[rank]
            box = Box((off,) + (0,) * (len(s) - 1), (length, *s[1:]))
            dt = np.dtype("float32") if d == "float32" else _BF16
            items.append(SaveTensor(n, s, dt, [SaveShard(box, None)] if length else [], None))
        return declare(items, rank, ranks) if world_arg else declare(items, rank)

    first = build(0)
    try:
        for r in random.Random(6).sample(range(1, ranks), min(8, ranks - 1)):
            _same_digest(first, r, build)
        return [(first, list(range(ranks)))], ranks
    except AssertionError:
        return [(build(r), [r]) for r in range(ranks)], ranks


def groups_for(layout: str, ranks: int, tensors) -> tuple[list[tuple[Decl, list[int]]], int]:
    """The distinct declarations of ``layout`` and which ranks made each; returns (groups, world)."""
    if layout in ("moe", "moe-boxes"):
        return moe_groups(ranks, tensors, rules=layout == "moe")
    if layout in ("moe-stacked", "vpp"):
        return stacked_groups(ranks, tensors, VP if layout == "vpp" else 1)
    if layout == "blocks":
        return blocks_groups(ranks, tensors)
    if layout == "megatron":  # as the adapter declares now: mesh rules on megatron's grids
        return moe_groups(ranks, tensors, rules=True, dense=True)
    if layout == "ddp":
        decl = Decl((), tuple(TensorRule(n, s, d, i, ("replica",)) for n, s, d, i, _ in tensors))
        return [(decl, list(range(ranks)))], ranks
    if layout == "fsdp2":
        mesh = Mesh((ranks,), tuple(range(ranks)))
        decl = Decl((mesh,), tuple(TensorRule(n, s, d, i, ("mesh", 0, (0,))) for n, s, d, i, _ in tensors))
        return [(decl, list(range(ranks)))], ranks
    if layout == "fsdp1":
        return fsdp1_groups(ranks, tensors), ranks
    if layout == "jax":
        return jax_groups(ranks, tensors)
    tp, pp = 8, 16
    dp = max(1, ranks // (tp * pp))
    world = tp * pp * dp
    stage_of = {n: (k * pp) // len(tensors) for k, (n, *_r) in enumerate(tensors)}
    groups = []
    for p in range(pp):
        for t in range(tp):
            rules = []
            for n, s, d, i, split in tensors:
                if stage_of[n] != p:
                    continue
                if split == "rep":
                    rules.append(TensorRule(n, s, d, i, ("replica",)))
                    continue
                dim = 0 if split == "col" else 1
                off, length = chunk_bounds(s[dim], tp)[t]
                offs, lens = [0, 0], list(s)
                offs[dim], lens[dim] = off, length
                rules.append(TensorRule(n, s, d, i, ("boxes", (Box(tuple(offs), tuple(lens)),))))
            decl = Decl((), tuple(rules))
            # every DP replica declares its (TP, PP) position's regions, as the megatron adapter does
            groups.append((decl, [t + tp * (q + dp * p) for q in range(dp)]))
    return groups, world


def _declared(rank: int, tensors, rules: dict[str, tuple], meshes: tuple[Mesh, ...], held=None) -> Decl:
    """``declare()`` fed what an adapter feeds it: each tensor's rule and the boxes this rank holds."""
    items = []
    for n, s, d, _i, _split in tensors:
        if held is not None and not held(n):
            continue
        rule = rules[n]
        local = (rule[0], meshes.index(rule[1]), *rule[2:])
        boxes = rule_boxes(s, local, meshes, rank)
        shards = [SaveShard(b, None) for b in boxes]  # declare() reads boxes only
        items.append(SaveTensor(n, s, np.dtype("float32") if d == "float32" else _BF16, shards, rule))
    return declare(items, rank)


def _same_digest(decl: Decl, rank: int, build) -> None:
    if digest(build(rank).to_json()) != digest(decl.to_json()):
        raise AssertionError(f"rank {rank} declares differently from its group's representative")


def fsdp1_groups(ranks: int, tensors) -> list[tuple[Decl, list[int]]]:
    """FSDP1: one flat parameter per layer; distinct declarations differ only by which states a rank holds."""
    mesh = Mesh((ranks,), tuple(range(ranks)))
    layers: dict[str, list[tuple[str, tuple[int, ...]]]] = {}  # layer -> its parameters, in flat order
    for n, s, _d, _i, _split in tensors:
        if n.startswith("model/"):
            base = n[len("model/") :]
            layers.setdefault(base.rsplit(".", 1)[0], []).append((base, s))
    rules: dict[str, tuple] = {}
    touched = []  # per parameter: the ranks whose range touches it (a bool row over ranks)
    param_of: dict[str, int] = {}
    for params in layers.values():
        offsets, total = [], 0
        for _base, s in params:
            total += -total % 8  # FSDP1 aligns each parameter to 16 bytes (8 bf16 elements)
            offsets.append(total)
            total += int(np.prod(s))
        total += -total % ranks  # and pads the flat parameter to a multiple of the world size
        size = -(-total // ranks)
        for (base, s), off in zip(params, offsets):
            row = np.zeros(ranks, dtype=bool)
            row[off // size : (off + int(np.prod(s)) - 1) // size + 1] = True
            param_of[base] = len(touched)
            touched.append(row)
            for n in (f"model/{base}", f"optimizer/{base}/exp_avg", f"optimizer/{base}/exp_avg_sq"):
                rules[n] = ("range", mesh, off, total)  # states follow their parameter's range
    mask = np.stack(touched)  # params x ranks
    keys = np.packbits(mask, axis=0).T  # one byte string per rank: which parameters it holds state for
    patterns: dict[bytes, list[int]] = {}
    for r in range(ranks):
        patterns.setdefault(keys[r].tobytes(), []).append(r)

    def build(rank: int) -> Decl:
        def held(n: str) -> bool:
            return n.startswith("model/") or bool(mask[param_of[n.split("/")[1]], rank])

        return _declared(rank, tensors, rules, (mesh,), held)

    groups = []
    rng = random.Random(1)
    for members in patterns.values():
        decl = build(members[0])
        for r in rng.sample(members, min(2, len(members) - 1)) if len(members) > 1 else []:
            _same_digest(decl, r, build)
        groups.append((decl, members))
    return groups


def jax_groups(ranks: int, tensors) -> tuple[list[tuple[Decl, list[int]]], int]:
    """JAX: mesh (replica, fsdp=16, model=8 devices of one process), the device -> process map affine."""
    fsdp, model = 16, 8
    replica = max(1, ranks // fsdp)
    world = replica * fsdp
    mesh = Mesh((replica, fsdp, model), tuple(int(x) for x in np.repeat(np.arange(world), model)))
    spec = {"col": (-1, 0, 1), "row": (-1, 1, 0), "rep": (-1, -1, -1)}
    rules = {n: ("mesh", mesh, spec[split]) for n, _s, _d, _i, split in tensors}

    def build(rank: int) -> Decl:
        return _declared(rank, tensors, rules, (mesh,))

    decl = build(0)
    for r in random.Random(2).sample(range(1, world), min(2, world - 1)):
        _same_digest(decl, r, build)
    return [(decl, list(range(world)))], world


def status_bytes() -> int:
    """A typical commit status: no error, no per-rank objects, five recorded phases."""
    rec = PhaseRecorder()
    for phase in ("snapshot", "plan", "exchange", "write", "flush"):
        with rec.phase(phase) as r:
            r["bytes"] = 123456789
    return len(
        json.dumps(
            {"kind": "commit", "plan_id": "0" * 16, "error": None, "objects": {}, "metrics": rec.to_json()},
            separators=(",", ":"),
        )
    )


class FakeLoader:
    """A small reshardable loader: per worker a read position, an epoch, a seed, per-source offsets (JSON)
    and a fixed-size positions array (stacked, as when every rank's arrays agree)."""

    WORKERS = 2

    def __init__(self, dp_rank: int, dp_size: int) -> None:
        self.dp_rank, self.dp_size = dp_rank, dp_size

    def checkpoint_state(self, step: int | None = None) -> Any:
        from arraycheckpoint.data import LoaderState, ShardState

        d = self.dp_rank
        shards = {
            (d, w): ShardState(
                {"position": 4096 * d + w, "epoch": 1, "seed": 1234 + d, "offsets": [d * 7, d * 11, w]},
                {"positions": np.arange(3, dtype=np.int64) + d},
            )
            for w in range(self.WORKERS)
        }
        return LoaderState(
            {"seq": 4096, "sources": ["web", "code"]}, d, self.dp_size, self.WORKERS, shards, step
        )

    def shards_to_load(self, saved: Any) -> list:
        return saved.ordered_keys()

    def load_checkpoint_state(self, saved: Any) -> None:
        return None


def rank_items(
    r: int, world: int, perrank: str, dataloader: str, rng_state: dict | None
) -> tuple[list, list]:
    """Rank ``r``'s special items: its PerRank RNG state (``perrank``) and a DP dataloader (``dataloader``;
    its DP rank is ``r`` over ``world`` DP ranks), each in template form or the per-rank fallback. Built by the
    real save path: ``stateful.save_items``, ``data.checkpoint.save_items`` and ``rankdoc.fall_back``."""
    from types import SimpleNamespace

    from arraycheckpoint.adapters.base import AdapterOptions
    from arraycheckpoint.data.checkpoint import save_items as loader_items
    from arraycheckpoint.format import rankdoc
    from arraycheckpoint.format.perrank import PerRank
    from arraycheckpoint.stateful import save_items

    tensors: list = []
    objects: list = []
    if perrank != "none":
        assert rng_state is not None
        own = {**rng_state, "numpy": {**rng_state["numpy"], "pos": r % 624, "cached_gaussian": r / 7}}
        comm = SimpleNamespace(rank=r, world_size=world)
        t, o = save_items("extra_state", {"rng": PerRank(own)}, comm, AdapterOptions())
        t, o = rankdoc.fall_back(t, o) if perrank != "stacked" else (t, o)
        tensors, objects = tensors + t, objects + o
    if dataloader != "none":
        t, o = loader_items("dataloader", FakeLoader(r, world), 1, r, world)
        t, o = rankdoc.fall_back(t, o) if dataloader != "template" else (t, o)
        tensors, objects = tensors + t, objects + o
    return tensors, objects


def with_perrank(
    groups: list[tuple[Decl, list[int]]], world: int, form: str, dataloader: str = "none"
) -> tuple[list[tuple[Decl, list[int]]], list, list, list[dict]]:
    """``groups`` with every rank's per-rank items added (:func:`rank_items`; the arrays stacked unless
    ``form`` is ``per-rank``).

    Returns the new groups, rank 0's save tensors and objects (the coordinator's request) and every rank's
    per-rank objects (its commit status payload). Built by the real save path (:func:`rank_items` and
    ``declare``).
    """
    from arraycheckpoint.engine.coordinate import declare
    from arraycheckpoint.format import perrank

    rng_state = None
    if form != "none":
        import torch  # noqa: F401 - rng.capture() records torch's generator when torch is imported

        from arraycheckpoint import rng

        rng_state = rng.capture()
    objects: list[dict] = []
    rank0: list = []
    rank0_objects: list = []
    extra: list[tuple[Decl, list[int]]] = []  # per-rank form: one declaration per rank
    stacked_rules: Decl | None = None
    stacked = form != "per-rank"
    for r in range(world):
        tensors, objs = rank_items(r, world, form, dataloader, rng_state)
        objects.append({o.name: o.value for o in objs if o.scope == "rank" and o.rows is None})
        if r == 0:
            rank0, rank0_objects = tensors, objs
        if stacked:
            if stacked_rules is None:
                stacked_rules = declare(tensors, r)  # identical on every rank: declared once
        else:
            extra.append((declare(perrank.fall_back(tensors), r), [r]))
    out = []
    for decl, rs in groups:
        if stacked:
            assert stacked_rules is not None
            meshes = list(decl.meshes)
            m = stacked_rules.meshes[0]
            idx = meshes.index(m) if m in meshes else len(meshes)
            meshes[idx:idx] = [] if idx < len(meshes) else [m]
            rules = tuple(
                TensorRule(t.name, t.shape, t.dtype, t.itemsize, ("mesh", idx, (0,)))
                for t in stacked_rules.tensors
            )
            out.append((Decl(tuple(meshes), decl.tensors + rules), rs))
        else:
            for r in rs:
                own = extra[r][0]
                out.append((Decl(decl.meshes, decl.tensors + own.tensors), [r]))
    return out, rank0, rank0_objects, objects


def run(
    ranks: int,
    count: int,
    layout: str,
    options: PlanOptions,
    sample: int,
    per_host: int = 8,
    perrank: str = "none",
    dataloader: str = "none",
) -> dict:
    if layout in ("moe-stacked", "vpp"):
        tensors = stacked_tensors(count, VP if layout == "vpp" else 1)
    else:
        tensors = moe_tensors(count) if layout.startswith("moe") else model_tensors(count)
    groups, world = groups_for(layout, ranks, tensors)
    rank0_tensors: list = []
    rank0_objects: list = []
    rank_objects: list[dict] = [{} for _ in range(world)]
    if perrank != "none" or dataloader != "none":
        groups, rank0_tensors, rank0_objects, rank_objects = with_perrank(groups, world, perrank, dataloader)
    send = np.zeros(world, dtype=np.int64)
    recv = np.zeros(world, dtype=np.int64)
    t0 = time.process_time()
    # agreement: one all-reduce of fifteen int64 (payload counted once each way per rank)
    send += 120
    recv += 120
    group_of_rank = np.zeros(world, dtype=np.int64)
    for g, (_d, rs) in enumerate(groups):
        group_of_rank[rs] = g
    digests = [digest(d.to_json()) for d, _r in groups]
    if len(groups) > 1:
        # declarations: digests (16 B + 8 B size) to rank 0, representatives' declarations, one broadcast
        send += 24
        recv[0] += 24 * world
        reps, group_of = group_digests([digests[g] for g in group_of_rank])
        recv[1:] += 4 * len(reps)
        payloads = [
            zlib.compress(json.dumps(groups[group_of_rank[r]][0].to_json(), separators=(",", ":")).encode())
            for r in reps
        ]
        for r, p in zip(reps, payloads):
            send[r] += len(p)
            recv[0] += len(p)
        blob = pack_groups(payloads, group_of)
        recv[1:] += len(blob)
        send[0] += len(blob) * (world - 1)
        decoded = unpack_groups(blob)
    else:
        decoded = [(groups[0][0], tuple(groups[0][1]))]
    decode_s = time.process_time() - t0
    t1 = time.process_time()
    plan = build_compact_plan(decoded, world, options)
    plan_s = time.process_time() - t1
    # commit: an all-reduce of three int64, every rank's payload size (8 B) to rank 0, status text from the
    # metrics sample (METRICS_SAMPLE ranks), outcome broadcast
    sb = status_bytes()
    send += 24 + 8
    recv += 24
    recv[0] += 8 * world
    step = max(1, world // METRICS_SAMPLE)
    sampled = np.arange(0, world, step)
    send[sampled] += sb
    recv[0] += sb * len(sampled)
    obj_bytes = np.asarray([len(json.dumps(o, separators=(",", ":"))) if o else 0 for o in rank_objects])
    send += obj_bytes  # per-rank JSON values ride in every rank's status
    recv[0] += int(obj_bytes.sum())
    recv[1:] += 16
    # each rank's own work list and fragment traffic (a sample of ranks; every rank at small worlds)
    hostmap = HostMap(world, per_host)  # hosts of ranks, to count what would cross them
    rng = random.Random(0)
    picks = sorted(
        set(range(world)) if world <= sample else {0, world - 1, *rng.sample(range(world), sample)}
    )
    derive = []
    frag_out = frag_in = cross_in = 0
    isz = {n: numpy_dtype(d.layout.dtype).itemsize for n, d in plan.tensors.items()}
    for r in picks:
        t = time.process_time()
        rp = rank_plan(plan, r)
        derive.append(time.process_time() - t)
        frag_out = max(frag_out, sum(x.box.volume * isz[x.name] for x in rp.sends))
        frag_in = max(frag_in, sum(x.box.volume * isz[x.name] for x in rp.recvs))
        far = [x for x in rp.recvs if hostmap.host(x.src) != hostmap.host(r)]
        cross_in = max(cross_in, sum(x.box.volume * isz[x.name] for x in far))
    t2 = time.process_time()
    objs = [SaveObject("extra_state", {"step": 1})]
    objs += [o for o in rank0_objects if o.scope == "rank" or o.name != "extra_state"]
    request = SaveRequest(rank0_tensors, objs, framework=layout, step=1)
    statuses = [
        {**({"metrics": {}} if r % step == 0 else {}), **({"objects": o} if o else {})}
        for r, o in enumerate(rank_objects)
    ]
    meta = build_metadata(plan, request, statuses)
    text = meta.to_json()
    meta_s = time.process_time() - t2
    t3 = time.perf_counter()
    parsed = CheckpointMetadata.from_json(text)
    parse_s = time.perf_counter() - t3
    # format 7: writers a reader derives from the layout (every one, as a load of every array would), and
    # they must be the plan's
    t4 = time.process_time()
    derived = [n for n, t in parsed.tensors.items() if getattr(t.writers, "derived", False)]
    for n in derived:
        got = parsed.tensors[n].writers.array
        assert np.array_equal(got, plan.tensors[n].writers), f"derived writers of {n} differ"
    derive_s = time.process_time() - t4
    counted = count_files(plan, options.min_chunk_bytes)
    files = counted["files"]
    total = sum(int(np.prod(d.layout.shape)) * isz[n] for n, d in plan.tensors.items())
    per_rank = np.zeros(world, dtype=np.int64)
    max_chunk = 0
    for n, d in plan.tensors.items():
        nb = plan._classes[n].nbytes
        per_rank += np.bincount(np.asarray(d.writers, dtype=np.int64), weights=nb, minlength=world).astype(
            np.int64
        )
        max_chunk = max(max_chunk, int(nb.max()) if len(nb) else 0)
    extra_names = [n for n in plan.tensors if n.startswith(("extra_state/", "dataloader/"))]
    ex = exchange_totals(plan, hostmap)
    return {
        "layout": layout,
        "perrank": perrank,
        "dataloader": dataloader,
        "ranks": world,
        "tensors": len(plan.tensors),
        "groups": len(decoded),
        "perrank_arrays": len(extra_names),
        "perrank_files": sum(len(plan.tensors[n].writers) for n in extra_names),
        "perrank_status_bytes_max": int(obj_bytes.max()),
        "state_bytes": total,
        "coordinator_s": round(decode_s + plan_s, 3),
        "decode_s": round(decode_s, 3),
        "plan_s": round(plan_s, 3),
        "rank_plan_s_max": round(max(derive), 4),
        "metadata_build_s": round(meta_s, 3),
        "max_rank_recv_bytes": int(recv.max()),
        "max_rank_send_bytes": int(send.max()),
        "coordinator_recv_bytes": int(recv[0]),
        "other_rank_recv_bytes_max": int(recv[1:].max()) if world > 1 else 0,
        "metadata_bytes": len(text),
        "metadata_parse_s": round(parse_s, 3),
        "derived_writer_tensors": len(derived),
        "cyclic_writer_tensors": sum(
            getattr(t.writers, "shift", None) is not None for t in parsed.tensors.values()
        ),
        "writers_derive_s": round(derive_s, 3),
        "files": files,
        "chunk_files": counted["chunk_files"],
        "packs": counted["packs"],
        "chunks": int(sum(len(d.writers) for d in plan.tensors.values())),
        "max_chunk_bytes": max_chunk,
        "files_per_tb": round(files * 1e12 / total),
        "write_balance_max_over_mean": round(float(per_rank.max() / per_rank.mean()), 3),
        "exchange_bytes_total": ex["total"],
        "exchange_fraction_of_state": round(ex["total"] / total, 5),
        "exchange_recv_bytes_max": ex["recv_max"],
        "exchange_send_bytes_max": ex["send_max"],
        "cross_host_bytes_total": ex["cross_total"],
        "cross_host_recv_bytes_max": ex["cross_recv_max"],
        "cross_host_send_bytes_max": ex["cross_send_max"],
        "fragment_send_bytes_max_sampled": int(frag_out),
        "fragment_recv_bytes_max_sampled": int(frag_in),
        "cross_host_recv_bytes_max_sampled": int(cross_in),
        "sampled_ranks": len(picks),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def exchange_totals(plan, hostmap: HostMap) -> dict[str, int]:
    """Every rank's fragment traffic of ``plan`` (bytes received and sent, all and crossing hosts), computed
    from the compact plan per chunk (what ``rank_plan`` would list for every rank, without deriving 10,000
    work lists): a piece travels when the chunk's writer does not hold its region."""
    world = plan.world
    recv = np.zeros(world, dtype=np.int64)
    send = np.zeros(world, dtype=np.int64)
    crecv = np.zeros(world, dtype=np.int64)
    csend = np.zeros(world, dtype=np.int64)
    per_class: dict[int, tuple] = {}
    for name, d in plan.tensors.items():
        c = plan._classes[name]
        isz = numpy_dtype(d.layout.dtype).itemsize
        if id(c) not in per_class:  # flat arrays of the straddling pieces (only those can travel)
            chunk_of = np.asarray([ci for ci, ps in c.straddle.items() for _ in ps], dtype=np.int64)
            region = np.asarray([g for ps in c.straddle.values() for _, g in ps], dtype=np.int64)
            nbytes = np.asarray([b.volume * isz for ps in c.straddle.values() for b, _ in ps], dtype=np.int64)
            single = np.asarray([h[0] if len(h) == 1 else -1 for h in c.holders], dtype=np.int64)[region]
            per_class[id(c)] = (chunk_of, region, nbytes, single)
        chunk_of, region, nbytes, single = per_class[id(c)]
        if not len(chunk_of):
            continue
        w = np.asarray(d.writers, dtype=np.int64)[chunk_of]
        src = single.copy()
        for i in np.nonzero(single < 0)[0].tolist():  # replicated regions: the writer, or a holder sends
            hs = c.holders[int(region[i])]
            src[i] = w[i] if w[i] in hs else fragment_source(hs, int(w[i]))
        moved = src != w
        if not moved.any():
            continue
        srcs, dsts, nb = src[moved], w[moved], nbytes[moved]
        np.add.at(recv, dsts, nb)
        np.add.at(send, srcs, nb)
        far = hostmap.hosts(srcs) != hostmap.hosts(dsts)
        np.add.at(crecv, dsts[far], nb[far])
        np.add.at(csend, srcs[far], nb[far])
    return {
        "total": int(recv.sum()),
        "recv_max": int(recv.max()),
        "send_max": int(send.max()),
        "cross_total": int(crecv.sum()),
        "cross_recv_max": int(crecv.max()),
        "cross_send_max": int(csend.max()),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=512)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument(
        "--layout",
        choices=[
            "fsdp2",
            "megatron",
            "megatron-boxes",
            "ddp",
            "fsdp1",
            "jax",
            "moe",
            "moe-boxes",
            "moe-stacked",
            "vpp",
            "blocks",
        ],
        default="fsdp2",
    )
    ap.add_argument("--min-chunk-mib", type=float, default=16.0, help="PlanOptions.min_chunk_bytes in MiB")
    ap.add_argument("--ranks-per-host", type=int, default=8, help="hosts are blocks of this many ranks")
    ap.add_argument("--max-chunk-mib", type=float, default=64.0, help="PlanOptions.max_chunk_bytes in MiB")
    ap.add_argument("--sample", type=int, default=64, help="ranks whose work lists are derived and timed")
    ap.add_argument(
        "--perrank",
        choices=["none", "stacked", "per-rank"],
        default="none",
        help="add a PerRank RNG state on every rank: stacked (one array per slot) or per-rank (the fallback)",
    )
    ap.add_argument(
        "--dataloader",
        choices=["none", "template", "per-rank"],
        default="none",
        help="add a DP dataloader's shard index on every rank (DP rank = rank): template (one template and rows "
        "of numbers) or per-rank (every rank's index in its commit status and the metadata)",
    )
    ap.add_argument(
        "--write-balance", type=float, default=None, help="PlanOptions.write_balance (default: the library's)"
    )
    ap.add_argument("--ep", type=int, default=None, help="moe layouts: expert parallelism (divides 256)")
    ap.add_argument("--vp", type=int, default=2, help="vpp layout: virtual pipeline stages")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    global MOE_EP, VP
    MOE_EP, VP = a.ep, a.vp
    opts = PlanOptions(
        min_chunk_bytes=int(a.min_chunk_mib * (1 << 20)), max_chunk_bytes=int(a.max_chunk_mib * (1 << 20))
    )
    if a.write_balance is not None:
        opts = dataclasses.replace(opts, write_balance=a.write_balance)
    out = run(a.ranks, a.tensors, a.layout, opts, a.sample, a.ranks_per_host, a.perrank, a.dataloader)
    if a.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()
