"""Format 3: listing a checkpoint with zarr-python or xarray warns about nothing (control files live in ``.acp/``).

zarr-python 3.1 warns (``ZarrUserWarning: Object at ... is not recognized as a component of a Zarr
hierarchy``) for every key of a group directory that is not a zarr node. Format 2 kept ``.metadata.json``,
``.committed`` and ``.metrics*.json`` in the root; format 3 keeps them inside ``.acp``, an empty zarr array
that readers never list. Here every warning is an error while zarr-python lists (``members``, ``tree``),
xarray opens the tree, and zarr-python, xarray and tensorstore read every array bit-exactly.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import numpy as np
import torch
from fixtures.make_format2 import full_state

import arraycheckpoint as acp
from arraycheckpoint.metadata import CONTROL, CONTROL_DIR, LEGACY_CONTROL

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _same(got: object, want: np.ndarray, name: str) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype.itemsize == want.dtype.itemsize, (name, got.dtype, got.shape)
    size = want.dtype.itemsize
    assert np.array_equal(got.view(UINT[size]), want.view(UINT[size])), name


def check_plain_readers(ckpt: Path, expected: dict[str, np.ndarray]) -> None:
    """List and read ``ckpt`` with zarr-python, xarray and tensorstore, every warning an error."""
    import tensorstore as ts
    import xarray as xr
    import zarr

    import arraycheckpoint.zarr  # noqa: F401 - zarr-python's bfloat16

    files = sorted(os.listdir(ckpt / CONTROL_DIR))
    assert files == sorted(os.path.basename(k) for k in vars(CONTROL).values()), files
    assert not any(os.path.exists(ckpt / k) for k in vars(LEGACY_CONTROL).values() if k)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        group = zarr.open_group(str(ckpt), mode="r")
        members = dict(group.members(max_depth=None))
        assert str(group.tree())
        tree = xr.open_datatree(str(ckpt), engine="zarr", consolidated=False)
        arrays = {k for k, v in members.items() if isinstance(v, zarr.Array)}
        assert arrays == set(expected) | {CONTROL_DIR}, arrays ^ (set(expected) | {CONTROL_DIR})
        control = members[CONTROL_DIR]
        assert control.shape == (0,) and control[...].size == 0
        assert "arraycheckpoint" in control.attrs
        assert tree.dataset[CONTROL_DIR].shape == (0,)
        for name, want in expected.items():
            _same(members[name][...], want, f"zarr {name}")
            parent, var = name.rsplit("/", 1)
            _same(tree[parent].dataset[var].values, want, f"xarray {name}")
            spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{ckpt}/{name}/"}}
            _same(ts.open(spec, open=True).result().read().result(), want, f"tensorstore {name}")
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{ckpt}/{CONTROL_DIR}/"}}
        assert ts.open(spec, open=True).result().shape == (0,)


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.low = torch.nn.Linear(5, 3).to(torch.bfloat16)


def test_single_process_checkpoint_lists_without_warnings(tmp_path: Path) -> None:
    torch.manual_seed(3)
    model = Mixed()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    (model.low(model.a(torch.randn(2, 6)).to(torch.bfloat16))).float().sum().backward()
    opt.step()
    ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    ckpt = tmp_path / "ck"
    acp.save(ckpt, {"model": model, "optimizer": opt, "extra_state": {"ids": ids, "step": 4}}, step=4)
    acp.load(ckpt, {"model": Mixed()}, record_metrics=True)
    expected = full_state(model, opt, scalars=True)
    expected["extra_state/ids"] = ids.numpy()
    check_plain_readers(ckpt, expected)


def _fsdp2_save(rank: int, world: int, path: str) -> dict[str, np.ndarray]:
    import torch.distributed as dist
    from fixtures.make_format2 import fsdp2_trained

    model, opt = fsdp2_trained(rank, world)
    acp.save(path, {"model": model, "optimizer": opt}, step=1)
    out = full_state(model, opt, scalars=True)
    dist.barrier()
    return out


def test_two_process_fsdp2_checkpoint_lists_without_warnings(tmp_path: Path) -> None:
    from dist import run_distributed

    ckpt = tmp_path / "ck"
    expected = run_distributed(_fsdp2_save, world=2, args=(str(ckpt),))[0]
    acp.load(
        ckpt,
        {"model": torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.Linear(5, 3))},
        record_metrics=True,
    )
    assert acp.read_metadata(ckpt).world_size == 2
    check_plain_readers(ckpt, expected)


def test_verify_reports_a_missing_control_node(tmp_path: Path) -> None:
    """Without ``.acp/zarr.json`` the checkpoint still loads, but listings would warn: verify says so."""
    from arraycheckpoint.tools.verify import verify

    ckpt = tmp_path / "ck"
    model = torch.nn.Linear(3, 2)
    acp.save(ckpt, {"model": model})
    assert verify(ckpt).ok
    assert CONTROL.node is not None
    os.remove(ckpt / CONTROL.node)
    report = verify(ckpt)
    assert not report.ok and any(CONTROL.node in p.message for p in report.problems), report.problems
    target = torch.nn.Linear(3, 2)
    acp.load(ckpt, {"model": target})
    assert torch.equal(target.weight, model.weight)
