"""Checkpoints written by the format-4 code keep loading bit-exactly, and every reader still reads them.

The fixtures under ``tests/fixtures/format4/`` were written by the last code of format_version 4 (commit
892434b, see ``tests/fixtures/make_format4.py``): every array in its own zarr v3 directory, control files under
``.acp/``, no packs. The expected tensors beside them were written by safetensors. They load bit-exactly in one
process and into FSDP2 at 2 and 3 gloo ranks, ``verify`` passes them (and finds a damaged chunk),
zarr-python reads every tensor through :func:`arraycheckpoint.zarr.checkpoint_store`, and a state loaded from
one saves again in the current format, with packs.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch
from fixtures import compat
from fixtures.compat import bits as _bits
from fixtures.compat import check_single_extra as _check_single_extra
from fixtures.compat import load_single as _load_single
from fixtures.compat import same as _same
from fixtures.compat import single_state as _single_state
from fixtures.make_format2 import fsdp_model, full_state
from safetensors.numpy import load_file

import arraycheckpoint as acp
from arraycheckpoint.cli import main as cli
from arraycheckpoint.format.metadata import FORMAT_VERSION

FIXTURES = compat.fixtures(4)
NAMES = ("single", "fsdp2")


def _copy(tmp_path, name: str):
    return compat.copy(tmp_path, FIXTURES, name)


def _expected(name: str) -> dict[str, np.ndarray]:
    return compat.expected(FIXTURES, name)


def test_format4_fixture_is_format4_without_packs() -> None:
    for name, step, shards in (("single", 3, 1), ("fsdp2", 12, 2)):
        root = os.path.join(FIXTURES, name)
        for f in ("metadata.json", "committed", "metrics.json"):
            assert os.path.isfile(os.path.join(root, ".acp", f)), (name, f)
        assert not os.path.exists(os.path.join(root, ".acp", "packs"))
        with open(os.path.join(root, ".acp", "metadata.json")) as f:
            doc = json.load(f)
        assert doc["format_version"] == 4 and not any("pack" in t for t in doc["tensors"].values())
        meta = acp.read_metadata(root)
        assert meta.format_version == 4 and meta.step == step
        assert all(t.pack is None for t in meta.tensors.values()), name
        assert (
            len(meta.tensors["model/" + ("body.weight" if name == "single" else "0.weight")].shards) == shards
        )
        for t in meta.tensors:  # every array in its own directory
            assert os.path.isfile(os.path.join(root, t, "zarr.json")), (name, t)


def test_format4_single_process_loads_bit_exactly(tmp_path) -> None:
    model, opt, extra = _load_single(_copy(tmp_path, "single"))
    _same(full_state(model, opt), _expected("single"))
    assert model.head.weight is model.emb.weight
    assert opt.param_groups[0]["lr"] == 0.01
    assert model.low.weight.dtype == torch.bfloat16 and model.body.weight.dtype == torch.float32
    _check_single_extra(extra)


def test_format4_fsdp2_checkpoint_loads_into_plain_model(tmp_path) -> None:
    model = fsdp_model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    out = acp.load(_copy(tmp_path, "fsdp2"), {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), _expected("fsdp2"))
    assert out["extra_state"]["step"] == 12


def _fsdp2_load_body(rank, world, path, expected_path):
    from fixtures.make_format2 import fsdp2_trained

    model, opt = fsdp2_trained(rank + 7, world)  # other values than the saved ones, optimizer state present
    out = acp.load(path, {"model": model, "optimizer": opt, "extra_state": {"step": 0}})
    _same(full_state(model, opt), load_file(expected_path))
    assert out["extra_state"]["step"] == 12
    return True


@pytest.mark.parametrize("world", [2, 3])
def test_format4_fsdp2_checkpoint_loads_into_fsdp2(tmp_path, world) -> None:
    from dist import run_distributed

    path = _copy(tmp_path, "fsdp2")
    expected_path = os.path.join(FIXTURES, "fsdp2.expected.safetensors")
    assert run_distributed(_fsdp2_load_body, world=world, args=(str(path), expected_path)) == [True] * world


@pytest.mark.parametrize("name", NAMES)
def test_format4_verify(tmp_path, capsys, name) -> None:
    """verify passes a format-4 checkpoint (reading every chunk) and names a chunk damaged in a copy."""
    path = _copy(tmp_path, name)
    meta = acp.read_metadata(path)
    assert cli(["verify", str(path)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("OK") and f"{len(meta.tensors)} tensors" in out, out
    assert cli(["verify", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["ok"] is True and doc["problems"] == [] and doc["tensors"] == len(meta.tensors)
    assert doc["bytes"] > 0
    assert cli(["inspect", "--json", str(path)]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["committed"] is True and doc["format_version"] == 4 and doc["step"] == meta.step
    victim = "model/body.weight" if name == "single" else "model/0.weight"
    chunk = path / victim / "c.0.0"
    raw = bytearray(chunk.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    chunk.write_bytes(bytes(raw))
    assert cli(["verify", str(path)]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD")]
    assert bad and any(victim in line for line in bad), bad


@pytest.mark.parametrize("name", NAMES)
def test_format4_zarr_python_reads_every_tensor(tmp_path, name) -> None:
    """zarr-python reads every tensor of the checkpoint bit-exactly through the checkpoint store."""
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    path = _copy(tmp_path, name)
    meta = acp.read_metadata(path)
    # the reference: the safetensors file, the 0-d Adam steps (1.0 after the one step) and the extra arrays
    want = dict(_expected(name))
    for t in meta.tensors:
        if t.startswith("optimizer/") and t.endswith("/step"):
            want[t] = np.asarray(1.0, dtype=np.float32)
    if name == "single":
        want["extra_state/a/b"] = np.arange(6, dtype=np.int64).reshape(2, 3)
        want["extra_state/arr"] = np.linspace(0, 1, 7, dtype=np.float32)
        # the tied head is stored once, as the embedding
        assert np.array_equal(want.pop("model/head.weight"), want["model/emb.weight"])
    assert sorted(meta.tensors) == sorted(want)
    store = checkpoint_store(path)
    assert store.packed == {} and store.metadata.format_version == 4
    root = zarr.open_group(store, mode="r")
    arrays = {k: v for k, v in root.members(max_depth=None) if isinstance(v, zarr.Array)}
    assert set(meta.tensors) <= set(arrays), sorted(arrays)
    for t, tm in meta.tensors.items():
        arr = arrays[t]
        assert tuple(arr.shape) == tuple(tm.shape), t
        got = arr[...]
        assert np.dtype(got.dtype).itemsize == np.dtype(want[t].dtype).itemsize, t
        assert np.asarray(got).shape == want[t].shape and np.array_equal(_bits(got), _bits(want[t])), t
    if name == "single":  # bfloat16 comes back as ml_dtypes' bfloat16, float32 as float32
        assert str(arrays["model/low.weight"][...].dtype) == "bfloat16"
        assert arrays["model/body.weight"][...].dtype == np.float32


def test_format4_state_saves_again_with_packs(tmp_path) -> None:
    """A state loaded from the format-4 fixture saves in the current format (chunk files packed) and loads
    back."""
    model, opt, extra = _load_single(_copy(tmp_path, "single"))
    new = tmp_path / "resaved"
    acp.save(new, {"model": model, "optimizer": opt, "extra_state": extra}, step=4)
    meta = acp.read_metadata(new)
    assert meta.format_version == FORMAT_VERSION and meta.step == 4
    packed = {n: t.pack_rank for n, t in meta.tensors.items() if t.pack is not None}
    assert packed and set(packed.values()) == {0} and os.path.isfile(new / ".acp" / "packs" / "0.0.zip")
    assert sorted(meta.tensors) == sorted(acp.read_metadata(os.path.join(FIXTURES, "single")).tensors)
    model2, opt2, extra2 = _single_state(seed=321)
    out = acp.load(new, {"model": model2, "optimizer": opt2, "extra_state": extra2})
    _same(full_state(model2, opt2), _expected("single"))
    _same(full_state(model2, opt2, scalars=True), full_state(model, opt, scalars=True))
    assert model2.head.weight is model2.emb.weight and opt2.param_groups[0]["lr"] == 0.01
    es = out["extra_state"]
    assert es["step"] == 3 and es["cfg"]["name"] == "tied"
    assert torch.equal(es["a"]["b"], torch.arange(6).reshape(2, 3))
    assert np.array_equal(np.asarray(es["arr"]), np.linspace(0, 1, 7, dtype=np.float32))
    assert cli(["verify", str(new)]) == 0
