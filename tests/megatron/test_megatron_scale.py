"""A strict megatron load at 64 simulated ranks over 4 pipeline stages: what a rank receives is bounded.

A strict load of pipeline-split state judges "unexpected" stored keys on the union of every rank's names. It
all-gathered every rank's name list, so each rank received world size x its stage's names (at 1,000 ranks
and a few thousand names, hundreds of MB per rank). Ranks of one stage hold the same list: the check now
sends each distinct list once. Counted, not timed: the payload bytes each simulated rank receives. And an
array split 64 ways (a pack per saving rank) loads resharded at 16 ranks and whole at one, bit-exactly.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("megatron.core")

from simworld import SimCommunicator, SimWorld, run_ranks  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.errors import StateMismatchError  # noqa: E402

WORLD, STAGES, PER_STAGE = 64, 4, 40


def _names(stage: int) -> list[str]:
    return [f"decoder.layers.{stage * PER_STAGE + i}.mlp.linear_fc1.weight" for i in range(PER_STAGE)]


def _stage_dict(rank: int, filled: bool, stages: int = STAGES) -> dict:
    """Rank ``rank`` holds stage ``rank % stages``; the first rank of each stage holds its main replica."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    stage = rank % stages
    out = {}
    for i, name in enumerate(_names(stage)):
        data = torch.full((3,), float(stage * PER_STAGE + i)) if filled else torch.zeros(3)
        out[name] = ShardedTensor.from_rank_offsets(name, data, replica_id=int(rank >= stages))
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("megatron_scale") / "ck"

    def save(comm: SimCommunicator) -> None:
        acp.save(path, {"model": _stage_dict(comm.rank, True)}, comm=comm, framework="megatron")

    run_ranks(WORLD, save)
    return path


def test_strict_pipeline_load_receives_each_stage_once(saved: Path) -> None:
    world = SimWorld(WORLD)

    def load(comm: SimCommunicator) -> bool:
        state = _stage_dict(comm.rank, False)
        acp.load(saved, {"model": state}, comm=comm, framework="megatron")
        stage = comm.rank % STAGES
        return all(bool((st.data == stage * PER_STAGE + i).all()) for i, st in enumerate(state.values()))

    assert all(run_ranks(WORLD, load, world=world))
    every_name = len(json.dumps([n for s in range(STAGES) for n in _names(s)]))
    # each stage's names once, plus a fixed-size record per rank (digest, sizes): not WORLD x a stage's names
    assert max(world.received) <= 2 * every_name + 64 * WORLD, world.received[:4]


def test_strict_pipeline_load_names_keys_no_rank_loads(saved: Path) -> None:
    """Loaded with 2 stages' ranks only, the other stages' keys are named on every rank."""

    def load(comm: SimCommunicator) -> str:
        with pytest.raises(StateMismatchError) as e:
            acp.load(saved, {"model": _stage_dict(comm.rank, False, 2)}, comm=comm, framework="megatron")
        return str(e.value)

    messages = run_ranks(16, load)
    assert all(f"model/{_names(3)[0]}" in m and "no rank loads" in m for m in messages)
    assert not any(f"model/{_names(0)[0]}," in m for m in messages)
    assert np.unique(messages).size == 1


def _split(full: np.ndarray, rank: int, world: int, filled: bool) -> dict:
    """This rank's rows of ``full`` as a ShardedTensor split ``world`` ways along dim 0."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    rows = full.shape[0] // world
    data = torch.from_numpy(full[rank * rows : (rank + 1) * rows].copy()) if filled else torch.zeros(rows, 8)
    return {"w": ShardedTensor.from_rank_offsets("w", data, (0, rank, world), replica_id=0)}


def test_sharded_64_ways_loads_at_16_and_1(tmp_path: Path) -> None:
    """Every one of 64 ranks writes its rows (its own pack); 16 ranks load 4 savers' rows each, one rank
    loads the whole array into numpy: bit-exact."""
    full = np.random.default_rng(3).standard_normal((WORLD * 4, 8)).astype(np.float32)
    path = tmp_path / "ck"
    run_ranks(WORLD, lambda c: acp.save(path, {"model": _split(full, c.rank, WORLD, True)}, comm=c))
    assert len(list((path / ".acp" / "packs").glob("*.zip"))) == WORLD

    def load(comm: SimCommunicator) -> bool:
        state = _split(full, comm.rank, comm.world_size, False)
        acp.load(path, {"model": state}, comm=comm)
        return np.array_equal(
            state["w"].data.numpy(), _split(full, comm.rank, comm.world_size, True)["w"].data
        )

    assert all(run_ranks(16, load))
    whole = {"w": np.zeros_like(full)}
    acp.load(path, {"model": whole})
    assert np.array_equal(whole["w"], full)
