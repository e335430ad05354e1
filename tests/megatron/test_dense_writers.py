"""Dense towers whose worst-fit writers are stored as the cyclic rule (format 8), saved and loaded for real.

megatron's dense weights (stacked layers, split by TP, replicated over the data-parallel ranks) and norms
(replicated on every rank) have few chunks per replica set: their writers are chosen by worst fit, and where
one shift of the cyclic rule states them the metadata stores ``["cyclic", shift]`` instead of a list
(``tests/control/test_ruled_worst_fit.py``: the same plan). Here such checkpoints are written by 36 simulated
ranks (TP 2 x DP 18: replica sets of 18 and 36, a norm's wider than the 32 shifts the planner tries) and by a
real megatron-core GPTModel at TP 1 x DP 2 over gloo, and load bit-exactly under other layouts.
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

LAYERS, ROWS, COLS, NORM = 4, 8, 6, 72
OPTIONS = PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=1 << 7, inner_chunk_bytes=1 << 5)
NAMES = ("qkv", "qkv.exp_avg", "norm")


def _full(name: str) -> np.ndarray:
    shape = (LAYERS, NORM) if name == "norm" else (LAYERS, ROWS, COLS)
    return np.arange(int(np.prod(shape)), dtype=np.float32).reshape(shape) * 3 + len(name)


def _dense(rank: int, world: int, tp: int, fill: float | None = None) -> tuple[dict[str, Any], list]:
    """Rank ``rank``'s sharded dict on megatron's dense grid (tp fastest, then dp): per layer, its TP part
    of ``qkv`` and its Adam state (rows split, replicated over DP) and the whole ``norm`` (replicated on
    every rank); and its grid as megatron's process groups give it."""
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from arraycheckpoint.planning.grids import Grid

    t, d = rank % tp, rank // tp
    state = {}
    for name in NAMES:
        full = _full(name) if fill is None else np.full(_full(name).shape, fill, dtype=np.float32)
        for layer in range(LAYERS):
            if name == "norm":
                data, axes, replica = full[layer], (), rank
            else:
                part = ROWS // tp
                data, axes, replica = full[layer, t * part : (t + 1) * part], ((1, t, tp),), d
            state[f"{name}.{layer}"] = ShardedTensor.from_rank_offsets(
                name,
                torch.from_numpy(np.ascontiguousarray(data)),
                (0, layer, LAYERS),
                *axes,
                replica_id=replica,
                prepend_axis_num=1,
            )
    groups = {"tp": [d * tp + i for i in range(tp)], "dp": [i * tp + t for i in range(world // tp)]}
    grid = Grid.from_groups(rank, world, groups)
    return state, [grid] if grid is not None else []


def _loaded(state: dict[str, Any]) -> bool:
    return all(np.array_equal(st.data.numpy(), _full(st.key)[st.global_slice()]) for st in state.values())


def test_dense_worst_fit_writers_by_rule_load_bit_exactly(tmp_path: Path) -> None:
    from arraycheckpoint.adapters.torch.megatron_grid import use_grids

    path = tmp_path / "ckpt"

    def save(comm: SimCommunicator) -> None:
        state, grids = _dense(comm.rank, 36, tp=2)
        with use_grids(grids):
            acp.save(path, {"model": state}, comm=comm, framework="megatron", plan_options=OPTIONS)

    run_ranks(36, save)
    doc = json.loads((path / ".acp" / "metadata.json").read_text())
    assert doc["format_version"] == 8
    meta = acp.read_metadata(path)
    for name in NAMES:
        entry = doc["tensors"][f"model/{name}"]
        assert entry["writers"][0] == "cyclic" and len(entry["writers"]) == 2, (name, entry["writers"])
        writers = np.asarray(list(meta.tensors[f"model/{name}"].writers))
        assert 8 < len(writers) <= 64, (name, len(writers))  # placed by worst fit, not the rule
        assert len(set(writers.tolist())) == min(36, len(writers)), name  # spread over the replicas
    assert verify(path).ok
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    group = zarr.open_group(checkpoint_store(path), mode="r")
    assert all(np.array_equal(group[f"model/{n}"][...], _full(n)) for n in NAMES)

    def load(comm: SimCommunicator) -> bool:
        state, _grids = _dense(comm.rank, 4, tp=4, fill=-1.0)
        acp.load(path, {"model": state}, comm=comm)
        return _loaded(state)

    assert all(run_ranks(4, load))
    state, _grids = _dense(0, 1, tp=1, fill=-1.0)
    acp.load(path, {"model": state})
    assert _loaded(state)

    # a shift that names other holders: the chunks are not where the metadata says, and the load says so
    entry = doc["tensors"]["model/qkv"]
    entry["writers"] = ["cyclic", (entry["writers"][1] + 1) % 36]
    (path / ".acp" / "metadata.json").write_text(json.dumps(doc))
    state, _grids = _dense(0, 1, tp=1, fill=-1.0)
    with pytest.raises(acp.ArrayCheckpointError, match="qkv"):
        acp.load(path, {"model": state})


def save_dp2_load_tp2(rank: int, world: int, path: str) -> tuple:
    """Rank body: a dense GPT (4 layers) at TP 1 x DP 2 saved with small chunks, then loaded at TP 2."""
    from megatron_helpers import build_gpt, fill_model, local_shards

    model = build_gpt(1, 1, seed=rank)
    fill_model(model)
    acp.save(path, {"model": model}, framework="megatron", plan_options=OPTIONS)
    saved = local_shards(model)
    other = build_gpt(2, 1, seed=50 + rank)
    acp.load(path, {"model": other})
    return saved, local_shards(other)


def test_real_megatron_dense_writers_by_rule_load_bit_exactly(tmp_path: Path) -> None:
    """A real megatron-core GPTModel at TP 1 x DP 2 over gloo: every weight is replicated on both ranks, the
    worst fit alternates its chunks between them, and the metadata stores that as ``["cyclic", shift]``;
    loaded at TP 2 on the same ranks, bit-exactly."""
    from dist import run_distributed
    from megatron_helpers import assemble, assert_equal_tensors

    path = str(tmp_path / "gpt")
    results = run_distributed(save_dp2_load_tp2, 2, (path,))
    doc = json.loads((Path(path) / ".acp" / "metadata.json").read_text())
    ruled = [n for n, t in doc["tensors"].items() if t["writers"][0] == "cyclic"]
    assert any("linear_qkv.weight" in n for n in ruled) and any("linear_fc1.weight" in n for n in ruled), (
        ruled
    )
    meta = acp.read_metadata(path)
    for n in ruled:
        counts = np.bincount(np.asarray(list(meta.tensors[n].writers)), minlength=2)
        assert counts.min() > 0 and counts.max() - counts.min() <= 1, (n, counts)  # both replicas write
    assert_equal_tensors(assemble([a for _s, a in results]), assemble([s for s, _a in results]))
