"""Expert-parallel layouts at scale, saved and loaded for real by simulated ranks (:mod:`simworld`: real saves
and loads, one thread per rank, megatron ``ShardedTensor``s built by hand on megatron's expert grid).

* Replicated expert chunks whose writers follow the cyclic rule (format 8): 8 ranks hold a stacked expert
  weight as megatron-core lays it out (layer and expert axes prepended, one ``ShardedTensor`` per layer and
  local expert, EP 4 x expert DP 2): 128 chunks, each held by its two expert data-parallel replicas. The
  metadata stores ``["cyclic", shift]`` instead of 128 writers, every rank writes 16 chunks, and the
  checkpoint loads bit-exactly at EP 2 (4 ranks) and at 1 rank, ``verify`` passes it and zarr-python reads it
  through ``checkpoint_store``.
* A tensor split over three grid dimensions at once (expert TP x EP x expert DP, the flattened rank order of
  the expert grid, as a distributed optimizer shards an expert's state; replicated over PP): 16 ranks declare
  one mesh rule, the metadata holds no boxes, and it loads bit-exactly at 4 ranks in another split.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from simworld import SimCommunicator, run_ranks

import arraycheckpoint as acp
from arraycheckpoint.planning.plan import PlanOptions
from arraycheckpoint.tools.verify import verify

pytest.importorskip("megatron.core")

LAYERS, EXPERTS = 16, 8
SHAPE = (LAYERS, EXPERTS, 4, 4)
OPTIONS = PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=1 << 12, inner_chunk_bytes=1 << 6)


def _full() -> np.ndarray:
    return np.arange(int(np.prod(SHAPE)), dtype=np.float32).reshape(SHAPE) + 0.5


def _experts(rank: int, world: int, ep: int, fill: float | None = None) -> tuple[dict[str, Any], list]:
    """Rank ``rank``'s sharded dict of the stacked expert weight (EP ``ep``, expert DP ``world // ep``) and
    its expert grid as megatron's process groups give it."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from arraycheckpoint.planning.grids import Grid

    e, ed = rank % ep, rank // ep
    local = EXPERTS // ep
    full = torch.from_numpy(_full() if fill is None else np.full(SHAPE, fill, dtype=np.float32))
    state = {
        f"fc1.{layer}.{x}": ShardedTensor.from_rank_offsets(
            "fc1",
            full[layer, x].clone(),
            (0, layer, LAYERS),
            (1, x, EXPERTS),
            replica_id=ed,
            prepend_axis_num=2,
        )
        for layer in range(LAYERS)
        for x in range(e * local, (e + 1) * local)
    }
    groups = {
        "ep": [ed * ep + i for i in range(ep)],
        "edp": [i * ep + e for i in range(world // ep)],
    }
    grid = Grid.from_groups(rank, world, groups)
    return state, [grid] if grid is not None else []


def _loaded(state: dict[str, Any]) -> bool:
    return all(np.array_equal(st.data.numpy(), _full()[st.global_slice()]) for st in state.values())


def test_replicated_expert_chunks_are_written_by_rule_and_load_bit_exactly(tmp_path: Path) -> None:
    from arraycheckpoint.adapters.torch.megatron_grid import use_grids

    path = tmp_path / "ckpt"

    def save(comm: SimCommunicator) -> None:
        state, grids = _experts(comm.rank, 8, ep=4)
        with use_grids(grids):
            acp.save(path, {"model": state}, comm=comm, framework="megatron", plan_options=OPTIONS)

    run_ranks(8, save)
    doc = json.loads((path / ".acp" / "metadata.json").read_text())
    assert doc["format_version"] == 8
    entry = doc["tensors"]["model/fc1"]
    assert entry["writers"][0] == "cyclic" and len(entry["writers"]) == 2, entry["writers"]
    writers = acp.read_metadata(path).tensors["model/fc1"].writers
    assert len(writers) == LAYERS * EXPERTS  # one chunk per (layer, expert) box
    assert np.bincount(np.asarray(list(writers)), minlength=8).tolist() == [16] * 8
    assert verify(path).ok
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    # zarr-python finds each packed chunk in its derived writer's packs
    assert np.array_equal(zarr.open_group(checkpoint_store(path), mode="r")["model/fc1"][...], _full())

    def load(comm: SimCommunicator) -> bool:
        state, _grids = _experts(comm.rank, 4, ep=2, fill=-1.0)
        acp.load(path, {"model": state}, comm=comm)
        return _loaded(state)

    assert all(run_ranks(4, load))
    state, _grids = _experts(0, 1, ep=1, fill=-1.0)
    acp.load(path, {"model": state})
    assert _loaded(state)


def _three_way(rank: int, fill: float | None = None) -> tuple[dict[str, Any], list]:
    """16 ranks on the expert grid etp 2 x ep 2 x edp 2 x pp 2 (strides 1, 2, 4, 8): rank ``rank``'s rows of
    ``state`` (16 x 3), split over the flattened etp-ep-edp order ``(ed * ep + e) * etp + t``, replicated
    over PP; and its grid."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from arraycheckpoint.planning.grids import Grid

    t, e, ed, p = rank % 2, (rank // 2) % 2, (rank // 4) % 2, rank // 8
    part = (ed * 2 + e) * 2 + t
    full = _state_value() if fill is None else np.full((16, 3), fill, dtype=np.float32)
    data = torch.from_numpy(np.ascontiguousarray(full[2 * part : 2 * part + 2]))
    state = {"state": ShardedTensor.from_rank_offsets("state", data, (0, part, 8), replica_id=p)}
    base = rank - t - 2 * e - 4 * ed - 8 * p
    groups = {
        "etp": [base + 2 * e + 4 * ed + 8 * p + i for i in range(2)],
        "ep": [base + t + 2 * i + 4 * ed + 8 * p for i in range(2)],
        "edp": [base + t + 2 * e + 4 * i + 8 * p for i in range(2)],
        "pp": [base + t + 2 * e + 4 * ed + 8 * i for i in range(2)],
    }
    grid = Grid.from_groups(rank, 16, groups)
    assert grid is not None
    return state, [grid]


def _state_value() -> np.ndarray:
    return np.arange(48, dtype=np.float32).reshape(16, 3) * 3 + 1


def test_split_over_three_grid_dimensions_is_one_rule_and_loads_in_another_split(tmp_path: Path) -> None:
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from arraycheckpoint.adapters.torch.megatron_grid import use_grids

    path = tmp_path / "ckpt"

    def save(comm: SimCommunicator) -> None:
        state, grids = _three_way(comm.rank)
        with use_grids(grids):
            acp.save(path, {"model": state}, comm=comm, framework="megatron", plan_options=OPTIONS)

    run_ranks(16, save)
    meta = acp.read_metadata(path)
    assert len(meta.layout_groups) == 1  # every rank declared the same rule: nothing gathered
    assert {r[0] for _g, r in meta.tensors["model/state"].regions} == {"mesh"}
    assert verify(path).ok

    def load(comm: SimCommunicator) -> bool:
        import torch

        rows = slice(4 * comm.rank, 4 * comm.rank + 4)
        data = torch.full((4, 3), -1.0)
        st = ShardedTensor.from_rank_offsets("state", data, (0, comm.rank, 4))
        acp.load(path, {"model": {"state": st}}, comm=comm)
        return np.array_equal(data.numpy(), _state_value()[rows])

    assert all(run_ranks(4, load))
