"""Listing a checkpoint with zarr-python or xarray warns about nothing, and every tensor is found and read.

zarr-python 3.1 warns (``ZarrUserWarning: Object at ... is not recognized as a component of a Zarr
hierarchy``) for every key of a group directory that is not a zarr node. Format 2 kept ``.metadata.json``,
``.committed`` and ``.metrics*.json`` in the root; format 3 keeps them inside ``.acp``, an empty zarr array
that readers never list. Format 5 stores small arrays in packs (ZIP files under ``.acp/packs/``); format 6 puts
any small chunk file in its writer's packs, so an array may lie in several ranks' packs: a plain walk of the
directory lists the arrays stored in their own directories, ``arraycheckpoint.zarr.checkpoint_store`` lists
them all. Here every
warning is an error while zarr-python lists (``members``, ``tree``) the directory and the store, xarray opens
both trees, and zarr-python (the array's directory, or ``ZipStore`` on its pack), xarray and tensorstore (the
``file`` or ``zip`` key-value driver) read every array bit-exactly, each found from the plain-JSON metadata.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from fixtures.make_format2 import full_state

import arraycheckpoint as acp
from arraycheckpoint.format.metadata import CONTROL, CONTROL_DIR, LEGACY_CONTROL

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _same(got: object, want: np.ndarray, name: str) -> None:
    got = np.asarray(got)
    assert got.shape == want.shape and got.dtype.itemsize == want.dtype.itemsize, (name, got.dtype, got.shape)
    size = want.dtype.itemsize
    assert np.array_equal(got.view(UINT[size]), want.view(UINT[size])), name


def packed_arrays(ckpt: Path) -> dict[str, str]:
    """``name -> pack file`` of every packed array one pack holds whole (format 6: one rank created and wrote
    it; an array over several ranks' packs is read through the checkpoint store only), from plain JSON."""
    from readers import _pack_holding

    import arraycheckpoint as acp

    doc = json.loads((ckpt / CONTROL.metadata).read_text())
    out = {}
    for name, t in doc["tensors"].items():
        pack = t.get("pack")
        if pack is None:
            continue
        if not pack.endswith(".zip"):
            rank = int(pack.split("/")[-1].partition("@")[0])
            # format 7: "held" writers follow from the regions (derived by the library's reader)
            writers = (
                acp.read_metadata(ckpt).tensors[name].writers if t["writers"] == "held" else t["writers"]
            )
            if set(writers) - {rank}:
                continue
            pack = _pack_holding(str(ckpt), f"{name}/zarr.json")
        out[name] = pack
    return out


def directory_arrays(ckpt: Path) -> set[str]:
    """The arrays stored in their own directories (no ``pack`` in the plain-JSON metadata): what a plain walk
    of the checkpoint's directory lists. A packed array is in :func:`packed_arrays` when one pack holds it
    whole, else only the checkpoint store presents it."""
    doc = json.loads((ckpt / CONTROL.metadata).read_text())
    return {name for name, t in doc["tensors"].items() if t.get("pack") is None}


def _arrays(group: object) -> dict[str, object]:
    import zarr

    return {k: v for k, v in group.members(max_depth=None) if isinstance(v, zarr.Array)}  # type: ignore[attr-defined]


def check_plain_readers(ckpt: Path, expected: dict[str, np.ndarray], packed: bool) -> None:
    """List and read ``ckpt`` with zarr-python, xarray and tensorstore, every warning an error.

    ``packed``: whether the save must have packed arrays (else it must have none, and no pack directory).
    """
    import tensorstore as ts
    import xarray as xr
    import zarr

    from arraycheckpoint.zarr import checkpoint_store  # also zarr-python's bfloat16

    packs = packed_arrays(ckpt)
    assert bool(packs) == packed, packs
    assert set(packs) <= set(expected), set(packs) - set(expected)
    files = sorted(os.listdir(ckpt / CONTROL_DIR))
    control = [os.path.basename(k) for k in vars(CONTROL).values()] + (["packs"] if packed else [])
    assert files == sorted(control), files
    assert not any(os.path.exists(ckpt / k) for k in vars(LEGACY_CONTROL).values() if k)
    for name in packs:
        assert not (ckpt / name).exists(), f"{name} is packed and has a directory too"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        # a plain walk of the directory: every array stored in its own directory, and no warning
        plain = zarr.open_group(str(ckpt), mode="r")
        assert str(plain.tree())
        unpacked = directory_arrays(ckpt)
        assert unpacked <= set(expected) and not unpacked & set(packs), unpacked
        assert set(_arrays(plain)) == unpacked | {CONTROL_DIR}, set(_arrays(plain)) ^ (
            unpacked | {CONTROL_DIR}
        )
        plain_tree = xr.open_datatree(str(ckpt), engine="zarr", consolidated=False)
        # the checkpoint as one hierarchy: every array, packed or not
        store = checkpoint_store(ckpt)
        group = zarr.open_group(store, mode="r")
        members = _arrays(group)
        assert str(group.tree())
        tree = xr.open_datatree(store, engine="zarr", consolidated=False)
        assert set(members) == set(expected) | {CONTROL_DIR}, set(members) ^ (set(expected) | {CONTROL_DIR})
        control = members[CONTROL_DIR]
        assert control.shape == (0,) and control[...].size == 0
        assert "arraycheckpoint" in control.attrs
        assert tree.dataset[CONTROL_DIR].shape == (0,)
        for name, want in expected.items():
            _same(members[name][...], want, f"zarr store {name}")
            parent, var = name.rsplit("/", 1)
            _same(tree[parent].dataset[var].values, want, f"xarray store {name}")
            if name in packs:  # plain readers of the pack the metadata names
                pack = str(ckpt / packs[name])
                with zarr.storage.ZipStore(pack, mode="r") as zstore:
                    _same(zarr.open_array(zstore, path=name, mode="r")[...], want, f"zarr ZipStore {name}")
                kvstore = {"driver": "zip", "base": {"driver": "file", "path": pack}, "path": f"{name}/"}
            elif name in unpacked:
                _same(zarr.open_array(str(ckpt / name), mode="r")[...], want, f"zarr {name}")
                _same(plain_tree[parent].dataset[var].values, want, f"xarray {name}")
                kvstore = {"driver": "file", "path": f"{ckpt}/{name}/"}
            else:  # its chunks lie in several ranks' packs: read through the checkpoint store above only
                continue
            spec = {"driver": "zarr3", "kvstore": kvstore}
            _same(ts.open(spec, open=True).result().read().result(), want, f"tensorstore {name}")
        spec = {"driver": "zarr3", "kvstore": {"driver": "file", "path": f"{ckpt}/{CONTROL_DIR}/"}}
        assert ts.open(spec, open=True).result().shape == (0,)


class Mixed(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(6, 5)
        self.low = torch.nn.Linear(5, 3).to(torch.bfloat16)


@pytest.mark.parametrize("pack_array_bytes", [None, 0], ids=["packs", "directories"])
def test_single_process_checkpoint_lists_without_warnings(
    tmp_path: Path, pack_array_bytes: int | None
) -> None:
    torch.manual_seed(3)
    model = Mixed()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    (model.low(model.a(torch.randn(2, 6)).to(torch.bfloat16))).float().sum().backward()
    opt.step()
    ids = torch.arange(12, dtype=torch.int64).reshape(3, 4)
    ckpt = tmp_path / "ck"
    options = (
        acp.PlanOptions() if pack_array_bytes is None else acp.PlanOptions(pack_array_bytes=pack_array_bytes)
    )
    state = {"model": model, "optimizer": opt, "extra_state": {"ids": ids, "step": 4}}
    acp.save(ckpt, state, step=4, plan_options=options)
    acp.load(ckpt, {"model": Mixed()}, record_metrics=True)
    expected = full_state(model, opt, scalars=True)
    expected["extra_state/ids"] = ids.numpy()
    check_plain_readers(ckpt, expected, packed=pack_array_bytes is None)


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
    check_plain_readers(ckpt, expected, packed=True)


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
