"""DCP's FileSystemWriter keeps a tensor's strides (a channels_last convolution weight, a ``.t()`` parameter and
its Adam state are saved as their permuted storage): ``acp.load``, ``acp.dcp.Reader`` and ``arraycheckpoint
import`` give back exactly what DCP's own FileSystemReader does, also for regions of such a tensor, and a
layout that is not dense is refused naming the tensor, never read as C-order."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

import arraycheckpoint as acp
from arraycheckpoint.errors import MetadataError
from arraycheckpoint.planning.items import LoadShard, LoadTensor
from arraycheckpoint.planning.regions import Box
from arraycheckpoint.runtime.monitoring import PhaseRecorder
from arraycheckpoint.sources.dcp import DcpSource
from arraycheckpoint.sources.dcpzip import dense_order
from arraycheckpoint.storage import storage_for

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.conv2 = torch.nn.Conv2d(4, 5, (2, 3))
        self.lin = torch.nn.Linear(6, 5)
        self.register_buffer("pad", torch.zeros(2, 1, 3, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (
            self.conv2(self.conv(x)).mean() + self.lin(x.flatten()[:6]).sum()
        )  # a gradient of distinct values


def _trained(seed: int) -> tuple[_Net, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    net = _Net().to(memory_format=torch.channels_last)
    with torch.no_grad():  # a .t() parameter: its Adam states get the same strides
        net.lin.weight = torch.nn.Parameter(torch.randn(6, 5).t())
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    net(torch.randn(1, 3, 8, 8).to(memory_format=torch.channels_last)).backward()
    opt.step()
    return net, opt


def _state(net: torch.nn.Module, opt: torch.optim.Optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(net, opt)
    return {"model": msd, "optimizer": {"state": osd["state"]}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, dict]:
    path = str(tmp_path_factory.mktemp("dcp") / "fsw")
    net, opt = _trained(0)
    state = _state(net, opt)
    assert state["model"]["conv.weight"].stride() == (27, 1, 9, 3)
    assert state["model"]["lin.weight"].stride() == (1, 5)
    assert state["optimizer"]["state"]["lin.weight"]["exp_avg"].stride() == (1, 5)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(
            {**state, "view": torch.arange(40.0).reshape(8, 5)[3:, 1:]}, storage_writer=FileSystemWriter(path)
        )
    net2, opt2 = _trained(1)
    want = {**_state(net2, opt2), "view": torch.zeros(5, 4)}
    dcp.load(want, storage_reader=FileSystemReader(path))  # DCP's own reader: the reference
    return path, want


def _flat(state: dict, prefix: str = "") -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif isinstance(v, torch.Tensor):
            out[prefix + k] = v
    return out


def _same(got: dict, want: dict) -> None:
    g, w = _flat(got), _flat(want)
    assert sorted(g) == sorted(w)
    for k in w:
        assert torch.equal(g[k], w[k]), k


def test_reference_is_the_saved_model(saved: tuple[str, dict]) -> None:
    _path, want = saved
    net, opt = _trained(0)
    _same({k: v for k, v in want.items() if k != "view"}, _state(net, opt))
    assert torch.equal(want["view"], torch.arange(40.0).reshape(8, 5)[3:, 1:])


def test_dcp_reader_over_the_directory_matches_filesystemreader(saved: tuple[str, dict]) -> None:
    path, want = saved
    net, opt = _trained(2)
    got = {**_state(net, opt), "view": torch.zeros(5, 4)}
    dcp.load(got, storage_reader=acp.dcp.Reader(path, allow_pickle=True))
    _same(got, want)


def test_acp_load_matches_filesystemreader(saved: tuple[str, dict]) -> None:
    path, want = saved
    net, opt = _trained(3)
    acp.load(path, {"model": net, "optimizer": opt}, allow_pickle=True, strict=False)
    _same(_state(net, opt), {k: v for k, v in want.items() if k != "view"})
    view = acp.load(path, {"view": torch.zeros(5, 4)}, allow_pickle=True, strict=False)["view"]
    assert torch.equal(view, want["view"])


def test_import_matches_filesystemreader(saved: tuple[str, dict], tmp_path: Path) -> None:
    from arraycheckpoint.tools.importer import import_checkpoint

    path, want = saved
    import_checkpoint(path, str(tmp_path / "imported"), allow_pickle=True)
    flat = _flat(want)
    meta = acp.read_metadata(str(tmp_path / "imported"))
    got = acp.load(
        str(tmp_path / "imported"),
        {"model": {k: torch.zeros(v.shape) for k, v in want["model"].items()}},
        strict=False,
    )
    for k, v in got["model"].items():
        assert torch.equal(v, flat[f"model.{k}"]), k
    assert "model/conv.weight" in meta.tensors


@pytest.mark.parametrize("name", ["model/conv.weight", "model/conv2.weight", "optimizer/lin.weight/exp_avg"])
def test_regions_of_a_permuted_tensor_are_read_bit_exactly(saved: tuple[str, dict], name: str) -> None:
    path, want = saved
    full = _flat(want)[name.replace("/", ".").replace("optimizer.", "optimizer.state.")].numpy()
    storage, root = storage_for(path)
    source = DcpSource.open(storage, root, allow_pickle=True)
    rng = np.random.default_rng(0)
    for _ in range(6):
        offsets = tuple(int(rng.integers(0, s)) for s in full.shape)
        lengths = tuple(int(rng.integers(1, s - o + 1)) for s, o in zip(full.shape, offsets))
        box = Box(offsets, lengths)
        got: list[np.ndarray] = []
        source.read([LoadTensor(name, [LoadShard(box, got.append)])], 1 << 20, PhaseRecorder())
        assert np.array_equal(got[0], full[box.slices()]), (name, box)


@pytest.mark.parametrize(
    ("size", "stride", "offset"),
    [((4, 3), (1, 3), 1), ((4, 3), (3, 2), 0), ((4, 3), (6, 1), 0), ((2, 2), (1, 1), 0), ((3,), (2,), 0)],
)
def test_layouts_that_are_not_dense_are_refused(size: tuple, stride: tuple, offset: int) -> None:
    with pytest.raises(MetadataError, match="tensor 'w'.*not a dense"):
        dense_order(size, stride, offset, "tensor 'w'")


def test_dense_orders() -> None:
    assert dense_order((4, 3, 3, 3), (27, 1, 9, 3), 0, "w") == (0, 2, 3, 1)
    assert dense_order((6, 5), (1, 6), 0, "w") == (1, 0)
    assert dense_order((2, 1, 3, 1), (3, 3, 1, 1), 0, "w") == (0, 1, 2, 3)
    assert dense_order((2, 1, 3, 1), (3, 1, 1, 3), 0, "w") == (0, 1, 2, 3)
    assert dense_order((0, 3), (1, 0), 0, "w") == (0, 1)
    assert dense_order((), (), 0, "w") == ()


def test_a_permuted_tensor_larger_than_the_zip_tail_read(tmp_path: Path) -> None:
    torch.manual_seed(5)
    big = torch.randn(40, 33, 17, 9).to(
        memory_format=torch.channels_last
    )  # ~800 KiB: data.pkl not in the tail
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"big": big, "bt": big[:, :, 0, 0].t()}, storage_writer=FileSystemWriter(str(tmp_path)))
    want = {"big": torch.zeros(big.shape), "bt": torch.zeros(33, 40)}
    dcp.load(want, storage_reader=FileSystemReader(str(tmp_path)))
    got = acp.load(
        str(tmp_path), {"big": torch.zeros(big.shape), "bt": torch.zeros(33, 40)}, allow_pickle=True
    )
    assert torch.equal(want["big"], big) and torch.equal(got["big"], big)
    assert torch.equal(got["bt"], want["bt"])
