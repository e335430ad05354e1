"""DCP on real gloo processes: the storage plug-in (DCP saves through ``acp.dcp.Writer`` and ``acp.load``
reshards it; ``acp.save`` writes and DCP loads through ``acp.dcp.Reader`` under another world size), and DCP's
own directories as a load source (``acp.load(dcp_dir, state, allow_pickle=True)``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from dist import run_distributed

import arraycheckpoint as acp
from arraycheckpoint.dcp import Writer, entry_name, fit_chunk_grid
from arraycheckpoint.errors import PlanError
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.tools.verify import verify

pytestmark = pytest.mark.multiprocess

SHAPES = {"0.weight": (50, 12), "1.weight": (13, 12), "1.bias": (13,), "3.weight": (7, 13), "3.bias": (7,)}


def _model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 12), torch.nn.Linear(12, 13), torch.nn.Tanh(), torch.nn.Linear(13, 7)
    )


def _fsdp2(model: torch.nn.Module, world: int) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    x = torch.arange(8).reshape(2, 4) % 50
    model(x).sum().backward()
    opt.step()


def _full(model: torch.nn.Module, opt: torch.optim.Optimizer | None = None) -> dict[str, np.ndarray]:
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> np.ndarray:
        return (t.full_tensor() if isinstance(t, DTensor) else t).detach().clone().numpy()

    if opt is None:
        return {f"model/{k}": full(v) for k, v in model.state_dict().items()}
    msd, osd = get_state_dict(model, opt)
    out = {f"model/{k}": full(v) for k, v in msd.items()}
    for fqn, state in osd["state"].items():
        out.update({f"optimizer/{fqn}/{k}": full(v) for k, v in state.items() if k != "step"})
    return out


def dcp_save_body(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp2(_model(0), world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, storage_writer=acp.dcp.Writer(path))
    return _full(model, opt)


def acp_load_body(rank: int, world: int, path: str, allow_pickle: bool = False) -> dict:
    model = _fsdp2(_model(100 + rank), world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    report: dict = {}
    acp.load(path, {"model": model, "optimizer": opt}, report=report, allow_pickle=allow_pickle)
    (read,) = [p for p in report["metrics"] if p["phase"] == "read"]
    return {**_full(model, opt), "read": read}


def dcp_native_save_body(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp2(_model(0), world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optimizer": osd}, checkpoint_id=path)  # DCP's own FileSystemWriter
    return _full(model, opt)


def acp_save_body(rank: int, world: int, path: str) -> dict:
    model = _fsdp2(_model(0), world)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    _train_step(model, opt)
    acp.save(path, {"model": model, "optimizer": opt})
    return _full(model, opt)


def dcp_load_body(rank: int, world: int, path: str) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model = _fsdp2(_model(100 + rank), world)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    _train_step(model, opt)  # creates the optimizer state DCP loads into
    msd, osd = get_state_dict(model, opt)
    # in place: FSDP2's state dicts hold the parameters' and the optimizer's own DTensors. param_groups come
    # back from either kind of checkpoint: DCP's bytes (Writer) or acp.save's JSON object, served as DCP keys
    dcp.load({"model": msd, "optimizer": osd}, storage_reader=acp.dcp.Reader(path))
    return {**_full(model, opt), "lr": osd["param_groups"][0]["lr"]}


def _same(got: dict, want: dict, names) -> None:
    for n in names:
        assert got[n].dtype == want[n].dtype and np.array_equal(got[n], want[n]), n


def test_dcp_saves_through_writer_at_4_and_acp_loads_at_3(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(dcp_save_body, 4, (path,))[0]
    meta = acp.read_metadata(path)
    assert {f"model/{k}" for k in SHAPES} <= set(meta.tensors)
    assert "optimizer/1.weight/exp_avg" in meta.tensors
    for name, tm in meta.tensors.items():  # one writer per stored file
        assert len(tm.writers) == len({s.offsets for s in tm.shards}), name
    loaded = run_distributed(acp_load_body, 3, (path,))
    for r in loaded:
        _same(r, saved, sorted(saved))
    z = json.loads((Path(path) / "model" / "1.weight" / "zarr.json").read_text())
    assert z["dimension_names"] == ["1.weight.dim0", "1.weight.dim1"]


def test_acp_saves_at_3_and_dcp_loads_through_reader_at_4(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(acp_save_body, 3, (path,))[0]
    loaded = run_distributed(dcp_load_body, 4, (path,))
    for r in loaded:
        _same(r, saved, sorted(saved))
        assert r["lr"] == 1e-2  # param_groups: acp.save's JSON object, served under DCP's keys


def test_dcp_round_trip_through_writer_at_3_and_reader_at_4(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    saved = run_distributed(dcp_save_body, 3, (path,))[0]
    loaded = run_distributed(dcp_load_body, 4, (path,))
    for r in loaded:
        _same(r, saved, sorted(saved))
        assert r["lr"] == 1e-2  # param_groups: DCP's pickled value, returned to DCP as it was


def test_dcp_directory_loads_at_3_with_allow_pickle_only(tmp_path: Path) -> None:
    from arraycheckpoint.errors import PickleNotAllowedError

    path = str(tmp_path / "dcp")
    saved = run_distributed(dcp_native_save_body, 4, (path,))[0]
    with pytest.raises(PickleNotAllowedError, match="allow_pickle=True"):
        acp.load(path, {"model": _model(1)})
    loaded = run_distributed(acp_load_body, 3, (path, True))
    for r in loaded:
        _same(r, saved, sorted(saved))
        assert r["read"]["bytes"] <= 1.1 * r["read"]["wanted_bytes"]


def test_uneven_layout_fails_naming_the_tensor() -> None:
    assert fit_chunk_grid(
        "w", (10, 4), [Box((0, 0), (3, 4)), Box((3, 0), (3, 4)), Box((6, 0), (3, 4)), Box((9, 0), (1, 4))]
    ) == (3, 4)
    with pytest.raises(PlanError, match=r"'model/w'.*\[10, 4\]"):
        fit_chunk_grid("model/w", (10, 4), [Box((0, 0), (4, 4)), Box((4, 0), (2, 4)), Box((6, 0), (4, 4))])
    with pytest.raises(PlanError, match="overlap"):
        fit_chunk_grid("w", (4,), [Box((0,), (2,)), Box((0,), (2,))])
    assert (
        entry_name("optimizer.state.a.b.exp_avg", ("optimizer", "state", "a.b", "exp_avg"))
        == "optimizer/a.b/exp_avg"
    )
    assert entry_name("model.a.b", ("model", "a.b")) == "model/a.b"
    assert Writer("x").validate_checkpoint_id("x")


def _plan(items: list[tuple[str, tuple, tuple, tuple]]) -> object:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, TensorWriteData, WriteItem, WriteItemType

    out = []
    for fqn, size, offsets, sizes in items:
        chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
        data = TensorWriteData(
            chunk=chunk, properties=TensorProperties(dtype=torch.float32), size=torch.Size(size)
        )
        out.append(WriteItem(MetadataIndex(fqn, torch.Size(offsets)), WriteItemType.SHARD, tensor_data=data))
    return SavePlan(out, planner_data={i[0]: ("model", i[0].split(".", 1)[1]) for i in items})


def test_writer_global_plan_refuses_uneven_items_and_splits_big_ones(tmp_path: Path) -> None:
    w = Writer(tmp_path / "ckpt")
    w.set_up_storage_writer(True, rank=0)
    uneven = [
        _plan([("model.w", (10, 4), (0, 0), (4, 4))]),
        _plan([("model.w", (10, 4), (4, 0), (2, 4))]),
        _plan([("model.w", (10, 4), (6, 0), (4, 4))]),
    ]
    with pytest.raises(PlanError, match=r"tensor 'model/w' of shape \[10, 4\].*\[4, 0\]\+\[2, 4\]"):
        w.prepare_global_plan(uneven)
    rows = (64 << 20) // (4 * 1024)  # one 64 MiB file per item holds this many rows
    big = [_plan([("model.big", (4 * rows, 1024), (r * 2 * rows, 0), (2 * rows, 1024))]) for r in range(2)]
    plans = w.prepare_global_plan(big)
    entry, shape, dtype, chunk, inner = plans[1].storage_data["arrays"]["model.big"]
    assert entry == "model/big" and shape == [4 * rows, 1024] and dtype == "float32"
    assert chunk[0] <= rows and (2 * rows) % chunk[0] == 0 and chunk[0] % inner[0] == 0


def test_writer_encodes_split_items_from_strided_tensors_bit_exactly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Writer's own chunk files (an item cut into several files and inner chunks, a transposed source, a
    bfloat16 one) load back bit-exactly, in one process (edge chunks: the 4-rank test above)."""
    import torch.distributed.checkpoint as dcp

    import arraycheckpoint.dcp as acp_dcp
    import arraycheckpoint.interop.dcpwriter as dcp_writer
    from arraycheckpoint.planning.plan import PlanOptions

    monkeypatch.setattr(
        dcp_writer,  # the options the Writer plans its chunk grids with
        "PlanOptions",
        lambda: PlanOptions(max_chunk_bytes=1024, inner_chunk_bytes=256, min_chunk_bytes=512),
    )
    g = torch.Generator().manual_seed(0)
    sd = {
        "w": torch.randn(40, 50, generator=g),  # 200-byte rows: 8 files of 5 rows, inner chunks of 1 row
        "t": torch.randn(50, 37, generator=g).t(),  # not contiguous
        "h": torch.randn(9, 40, generator=g).to(torch.bfloat16),
        "b": torch.randn(3, generator=g),
    }
    path = tmp_path / "ckpt"
    dcp.save(sd, storage_writer=acp_dcp.Writer(path))
    assert len(list((path / "w").glob("c.*"))) == 8
    out = {k: torch.zeros(v.shape, dtype=v.dtype) for k, v in sd.items()}
    dcp.load(out, storage_reader=acp_dcp.Reader(path))
    for k, v in sd.items():
        assert torch.equal(out[k], v), k
    assert verify(str(path)).ok  # every chunk file and its checksums, by the tools


# ------------------------------------------------------------------------------- a rank's write fails
def dcp_failing_save_body(rank: int, world: int, path: str) -> str:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.state_dict import get_state_dict

    class FailingPlanner(DefaultSavePlanner):
        """Rank 1's data source fails on its third item, after its first writes were issued."""

        seen = 0

        def resolve_data(self, write_item):  # noqa: ANN001, ANN202 - DCP's signature
            FailingPlanner.seen += 1
            if FailingPlanner.seen == 3:
                raise OSError("injected: device read failed")
            return super().resolve_data(write_item)

    model = _fsdp2(_model(0), world)
    msd, _ = get_state_dict(model, [])
    planner = FailingPlanner() if rank == 1 else DefaultSavePlanner()
    try:
        dcp.save({"model": msd}, storage_writer=acp.dcp.Writer(path), planner=planner)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        return str(e)
    return ""


def test_failed_rank_leaves_no_staging_and_commits_nothing(tmp_path: Path) -> None:
    parent = tmp_path / "ckpts"
    parent.mkdir()
    errors = run_distributed(dcp_failing_save_body, 2, (str(parent / "step1"),))
    for err in errors:
        assert "rank 1" in err and "injected: device read failed" in err, err
        assert "nothing was committed" in err, err
    assert list(parent.iterdir()) == []  # no staging directory, no checkpoint
    with pytest.raises(acp.errors.CheckpointNotFoundError):
        acp.read_metadata(str(parent / "step1"))
    # the same path saves cleanly afterwards
    saved = run_distributed(dcp_save_body, 2, (str(parent / "step1"),))[0]
    loaded = run_distributed(acp_load_body, 2, (str(parent / "step1"),))
    _same(loaded[0], saved, sorted(saved))
