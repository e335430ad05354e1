"""The data plane at the world sizes users run: real saves by 64 (slow: 256) simulated ranks, read back.

Every rank of a :class:`simworld.SimWorld` runs ``acp.save`` in its own thread with its own communicator, so
the checkpoint has the files a 64-rank job writes (a pack per rank, chunk files spread by worst fit); it is
then loaded at 1 rank and at another world size, bit-exactly, verified, and read through the zarr store in a
process allowed fewer descriptors than the checkpoint has packs.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from simworld import SimCommunicator, SimWorld, run_ranks

import arraycheckpoint as acp
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.tools.verify import verify

SAVERS, LOADERS = 64, 16
#: small chunk and pack sizes so that a small state makes as many files as a large one at the default sizes
OPTIONS = PlanOptions(
    min_chunk_bytes=32 << 10, max_chunk_bytes=64 << 10, inner_chunk_bytes=16 << 10, pack_array_bytes=8 << 10
)


def _replicated() -> dict[str, np.ndarray]:
    """150 small arrays (packed) and 2 of 256 KiB (cut into chunk files written by different ranks)."""
    rng = np.random.default_rng(7)
    state = {f"s{i}": rng.standard_normal(20 + i % 13).astype(np.float32) for i in range(150)}
    state.update({f"big{i}": rng.standard_normal((128, 512)).astype(np.float32) for i in range(2)})
    return state


def _save(path: Path, world: int) -> dict[str, np.ndarray]:
    state = _replicated()

    def save(comm: SimCommunicator) -> None:
        acp.save(path, {"model": state}, comm=comm, plan_options=OPTIONS)

    run_ranks(world, save)
    return state


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("simworld") / "ck"
    return path, _save(path, SAVERS)


def _zeros(state: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, -1) for k, v in state.items()}


def _round_trip(path: Path, want: dict[str, np.ndarray], loaders: int) -> None:
    """Load at 1 rank and at ``loaders`` simulated ranks, bit-exactly; verify reads every chunk."""
    got = _zeros(want)
    acp.load(path, {"model": got})
    assert all(np.array_equal(got[k], v) for k, v in want.items())

    def load(comm: SimCommunicator) -> bool:
        mine = _zeros(want)
        acp.load(path, {"model": mine}, comm=comm)
        return all(np.array_equal(mine[k], v) for k, v in want.items())

    assert all(run_ranks(loaders, load))
    report = verify(path)
    assert report.ok, report.problems[:3]
    assert report.tensors == len(want)


def test_saved_by_64_ranks_loads_at_1_and_16(saved: tuple[Path, dict[str, np.ndarray]]) -> None:
    path, want = saved
    packs = {p.name.split(".")[0] for p in (path / ".acp" / "packs").glob("*.zip")}
    assert packs == {str(r) for r in range(SAVERS)}  # every rank wrote small arrays into its own packs
    assert acp.read_metadata(path).world_size == SAVERS
    _round_trip(path, want, LOADERS)


def test_store_and_load_with_fewer_descriptors_than_packs(saved: tuple[Path, dict[str, np.ndarray]]) -> None:
    """In a process allowed 48 descriptors, the zarr store, a load and verify read a checkpoint of 64 packs
    bit-exactly. The store kept up to 64 packs open whatever the process's limit and failed with EMFILE."""
    path, _ = saved
    script = textwrap.dedent(
        f"""
        import resource, sys
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import numpy as np, zarr
        import arraycheckpoint as acp
        from arraycheckpoint.tools.verify import verify
        from arraycheckpoint.zarr import checkpoint_store
        from test_simworld_scale import _replicated
        want = _replicated()
        resource.setrlimit(resource.RLIMIT_NOFILE, (48, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
        store = checkpoint_store({str(path)!r})
        group = zarr.open_group(store, mode="r")
        assert all(np.array_equal(group[f"model/{{k}}"][...], v) for k, v in want.items())
        got = {{k: np.zeros_like(v) for k, v in want.items()}}
        acp.load({str(path)!r}, {{"model": got}})
        assert all(np.array_equal(got[k], v) for k, v in want.items())
        assert verify({str(path)!r}).ok
        print("read")
        """
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), *sys.path])}
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and "read" in out.stdout, out.stderr[-2000:]


@pytest.mark.slow
def test_saved_by_256_ranks_loads_at_1_and_64(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    _round_trip(path, _save(path, 256), 64)


def test_shared_reads_send_each_distinct_request_list_once(
    saved: tuple[Path, dict[str, np.ndarray]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``dedup_reads=True`` at 32 ranks: bit-exact, and a rank receives the bytes others read for it plus
    the replicas' (equal) request list once, and parses it once. Every rank received every rank's list (world
    size x regions), and then parsed each of the 32 equal lists again."""
    import threading

    from arraycheckpoint.engine import load as engine_load

    path, want = saved
    world = SimWorld(32)
    lock, made = threading.Lock(), [0]

    class CountedBox(engine_load.Box):  # type: ignore[misc,name-defined]
        def __init__(self, *args: object, **kwargs: object) -> None:
            with lock:
                made[0] += 1
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(engine_load, "Box", CountedBox)

    def load(comm: SimCommunicator) -> bool:
        mine = _zeros(want)
        acp.load(path, {"model": mine}, comm=comm, dedup_reads=True)
        return all(np.array_equal(mine[k], v) for k, v in want.items())

    assert all(run_ranks(world.size, load, world=world))
    requests = len(json.dumps([[f"model/{k}", [0] * v.ndim, list(v.shape)] for k, v in want.items()]))
    state = sum(v.nbytes for v in want.values())
    assert max(world.received) <= state + 2 * requests + 64 * world.size, (world.received[:4], requests)
    assert made[0] <= 2 * world.size * len(want), made  # each rank parses the one distinct list once


def test_all_gather_distinct_json_sends_each_value_once() -> None:
    """16 ranks holding 2 distinct values: every rank gets every rank's value, equal ones as one object, and
    receives each distinct value once (plus a digest and a size per rank), not 16 values."""
    world = SimWorld(16)
    values = [{"v": [r % 2] * 100} for r in range(16)]
    got = run_ranks(16, lambda c: c.all_gather_distinct_json(values[c.rank]), world=world)
    assert all(g == values for g in got)
    assert all(g[0] is g[2] is g[14] and g[1] is g[15] and g[1] is not g[0] for g in got)
    distinct = 2 * len(json.dumps(values[0], separators=(",", ":")))
    assert max(world.received) <= 2 * distinct + 32 * 16, world.received


# ------------------------------------------------------------------ megatron expert parallelism, simulated
MOE_L, MOE_E, MOE_H, MOE_F, MOE_V = 8, 8, 8, 4, 16  # stacked layers, experts, hidden, expert ffn, vocab


def _moe_value(key: str, shape: tuple[int, ...]) -> np.ndarray:
    """The full tensor of ``key``: distinct integers (exact in float32), different per key."""
    base = (sum(key.encode()) % 97) * 4096
    return (base + np.arange(int(np.prod(shape)))).astype(np.float32).reshape(shape)


def _moe_layout(
    rank: int, world: int, tp: int, pp: int, ep: int, vp: int = 1
) -> tuple[dict[str, Any], list[Any]]:
    """Rank ``rank``'s megatron sharded state dict of a stacked-layer MoE transformer, as megatron-core lays it
    out (dense ranks tp-dp-pp, expert ranks ep-edp-pp, expert TP 1, local experts one ShardedTensor each, the
    layer axis and the expert axis prepended; with ``vp`` virtual stages a stage holds ``vp`` interleaved
    chunks of layers), and the grids megatron's process groups give that rank. ``embed`` is split over the
    product TP x DP (rows ``d * tp + t``: the rank order of megatron's TP-DP group), a split megatron-core 0.16
    itself does not make but sharded dicts may."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from arraycheckpoint.planning.grids import Grid

    stage = world // pp
    p, q = divmod(rank, stage)
    t, d, e, ed = q % tp, q // tp, q % ep, q // ep
    chunk, local = MOE_L // (pp * vp), MOE_E // ep
    layers = [(v * pp + p) * chunk + j for v in range(vp) for j in range(chunk)]
    shapes = {
        "qkv": (MOE_L, 3 * MOE_H, MOE_H),
        "router": (MOE_L, MOE_E, MOE_H),
        "fc1": (MOE_L, MOE_E, 2 * MOE_F, MOE_H),
        "fc2": (MOE_L, MOE_E, MOE_H, MOE_F),
    }
    dps = stage // tp
    rows = MOE_V // (tp * dps)
    embed = torch.from_numpy(_moe_value("embed", (MOE_V, MOE_H)))[(d * tp + t) * rows :][:rows].clone()
    state: dict[str, Any] = {
        "embed": ShardedTensor.from_rank_offsets("embed", embed, (0, d * tp + t, tp * dps), replica_id=p)
    }
    for kind, shape in shapes.items():
        full = torch.from_numpy(_moe_value(kind, shape))
        for layer in layers:
            if kind == "qkv":
                rows = shape[1] // tp
                data = full[layer, t * rows : (t + 1) * rows].clone()
                st = ShardedTensor.from_rank_offsets(
                    kind, data, (0, layer, MOE_L), (1, t, tp), replica_id=d, prepend_axis_num=1
                )
                state[f"{kind}.{layer}"] = st
            elif kind == "router":
                state[f"{kind}.{layer}"] = ShardedTensor.from_rank_offsets(
                    kind, full[layer].clone(), (0, layer, MOE_L), replica_id=(t, d), prepend_axis_num=1
                )
            else:
                for x in range(e * local, (e + 1) * local):
                    state[f"{kind}.{layer}.{x}"] = ShardedTensor.from_rank_offsets(
                        kind,
                        full[layer, x].clone(),
                        (0, layer, MOE_L),
                        (1, x, MOE_E),
                        replica_id=ed,
                        prepend_axis_num=2,
                    )
    dense = {
        "tp": [p * stage + d * tp + i for i in range(tp)],
        "dp": [p * stage + i * tp + t for i in range(stage // tp)],
        "pp": [i * stage + q for i in range(pp)],
    }
    expert = {
        "ep": [p * stage + ed * ep + i for i in range(ep)],
        "edp": [p * stage + i * ep + e for i in range(stage // ep)],
        "pp": dense["pp"],
    }
    grids = [g for g in (Grid.from_groups(rank, world, dense), Grid.from_groups(rank, world, expert)) if g]
    assert len(grids) == 2
    return state, grids


def _save_moe(path: Path, world: int, with_grids: bool) -> SimWorld:
    from arraycheckpoint.adapters.torch.megatron_grid import use_grids

    sim = SimWorld(world)

    def save(comm: SimCommunicator) -> None:
        state, grids = _moe_layout(comm.rank, world, tp=2, pp=2, ep=4, vp=2)
        with use_grids(grids if with_grids else []):
            acp.save(path, {"model": state}, comm=comm, framework="megatron", plan_options=OPTIONS)

    run_ranks(world, save, world=sim)
    return sim


def test_expert_parallel_layout_saves_as_rules_and_loads_under_another(tmp_path: Path) -> None:
    """16 simulated ranks, TP 2 x PP 2 (2 interleaved virtual stages) x DP 4 with EP 4: the expert weights'
    boxes depend on the EP rank, the dense ones on TP and PP, the layers of a stage are two non-contiguous
    chunks and ``embed`` is split over TP x DP, so without rules every rank makes its own declaration (each
    gathered and broadcast); on megatron's grids they make one, nothing is gathered, the metadata holds
    rules, and the checkpoint loads bit-exactly under TP 1 x PP 4 x EP 2 (8 ranks) and at 1 rank."""
    pytest.importorskip("megatron.core")
    world = 16
    ruled, boxed = tmp_path / "ruled", tmp_path / "boxed"
    with_rules = _save_moe(ruled, world, True)
    without = _save_moe(boxed, world, False)
    meta, before = acp.read_metadata(ruled), acp.read_metadata(boxed)
    assert len(meta.layout_groups) == 1 and len(before.layout_groups) == world  # embed: (TP, DP) per rank
    assert {r[0] for t in meta.tensors.values() for _g, r in t.regions} <= {"mesh", "replica"}
    # the same plan either way: every chunk written by the same rank
    for name, t in meta.tensors.items():
        assert list(t.writers) == list(before.tensors[name].writers), name
    # control traffic: the declarations no longer travel (counted as gloo moves them)
    # (rank 0 also receives every rank's commit status and metrics, the same either way)
    got, was = with_rules.received, without.received
    assert max(got[1:]) * 4 < max(was[1:]) and got[0] < was[0], (got, was)

    def load(comm: SimCommunicator) -> bool:
        state, _grids = _moe_layout(comm.rank, 8, tp=1, pp=4, ep=2)
        for st in state.values():
            st.data.fill_(-1)
        acp.load(ruled, {"model": state}, comm=comm)
        return all(
            np.array_equal(st.data.numpy(), _moe_value(st.key, st.global_shape)[st.global_slice()])
            for st in state.values()
        )

    assert all(run_ranks(8, load))
    report = verify(ruled)
    assert report.ok and report.tensors == 5, report.problems[:3]
    state, _grids = _moe_layout(0, 1, tp=1, pp=1, ep=1)
    for st in state.values():
        st.data.fill_(-1)
    acp.load(ruled, {"model": state})
    assert all(
        np.array_equal(st.data.numpy(), _moe_value(st.key, st.global_shape)[st.global_slice()])
        for st in state.values()
    )


# ------------------------------------------------------------------ hand-built blocks, no process grid
def _blocks(rank: int, parts: int, world: int, fill: float | None = None) -> dict[str, Any]:
    """A sharded dict built by hand (no parallel_state, no grids), shapes as a save by ``world`` ranks makes
    them: this rank holds its ``torch.chunk`` part of ``parts`` of ``w`` (rows) and ``v`` (columns), and all
    of ``b`` (every element ``fill`` if given, else the source values)."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    full = {
        "w": _moe_value("w", (2 * world, 8)),
        "v": _moe_value("v", (4, 3 * world)),
        "b": _moe_value("b", (5,)),
    }
    if fill is not None:
        full = {k: np.full_like(a, fill) for k, a in full.items()}
    rows, cols = 2 * world // parts, 3 * world // parts
    return {
        "w": ShardedTensor.from_rank_offsets("w", _torch(full["w"][rows * rank :][:rows]), (0, rank, parts)),
        "v": ShardedTensor.from_rank_offsets(
            "v", _torch(full["v"][:, cols * rank :][:, :cols]), (1, rank, parts)
        ),
        "b": ShardedTensor.from_rank_offsets("b", _torch(full["b"])),
    }


def _torch(a: np.ndarray) -> Any:
    import torch

    return torch.from_numpy(np.ascontiguousarray(a))


def test_hand_built_blocks_declare_one_rule_and_control_bytes_stay_flat(tmp_path: Path) -> None:
    """Every rank's block is its part of the world along one axis: declared as a mesh rule on the world's 1-D
    grid, so all ranks declare the same (one layout group, nothing gathered) and what a rank receives stays
    flat from 16 to 64 ranks; the checkpoint loads bit-exactly at 4 ranks (other blocks)."""
    pytest.importorskip("megatron.core")
    received = {}
    for world in (16, 64):
        sim, path = SimWorld(world), tmp_path / f"w{world}"

        def save(comm: SimCommunicator, world: int = world, path: Path = path) -> None:
            acp.save(path, {"model": _blocks(comm.rank, world, world)}, comm=comm, framework="megatron")

        run_ranks(world, save, world=sim)
        meta = acp.read_metadata(path)
        assert len(meta.layout_groups) == 1
        assert {n: {r[0] for _g, r in t.regions} for n, t in meta.tensors.items()} == {
            "model/w": {"mesh"},
            "model/v": {"mesh"},
            "model/b": {"replica"},
        }
        received[world] = sim.received
    # what grows is the gathers' 8-byte size per rank (Communicator.gather_sizes, an all-gather), not the
    # declarations: declared as boxes every rank would receive every rank's declaration
    assert max(received[64][1:]) - max(received[16][1:]) <= 8 * (64 - 16), received

    def load(comm: SimCommunicator) -> bool:
        state = _blocks(comm.rank, 4, 64, fill=-1)
        acp.load(tmp_path / "w64", {"model": state}, comm=comm)
        want = _blocks(comm.rank, 4, 64)
        return all(np.array_equal(state[k].data.numpy(), want[k].data.numpy()) for k in want)

    assert all(run_ranks(4, load))
