"""PyTorch <-> JAX through one checkpoint: FSDP2 saves, JAX loads (and back), under other shardings.

torch parts run on real gloo processes (``dist.run_distributed``) with FSDP2 over a CPU DeviceMesh; JAX parts
run in a fresh interpreter with 8 CPU devices (``jax/jaxrun.py``). Values cross between the two through
files of raw bits, and every comparison is bit-exact on the full tensors.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "jax"))
from dist import run_distributed  # noqa: E402
from jaxrun import run_jax  # noqa: E402

pytestmark = pytest.mark.multiprocess

DTYPES = ("float32", "bfloat16")
SHAPES = {"0.weight": (40, 24), "0.bias": (40,), "2.weight": (10, 40), "2.bias": (10,)}


def _model(dtype_name: str, seed: int):
    import torch

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.ReLU(), torch.nn.Linear(40, 10))
    return model.to(getattr(torch, dtype_name))


def _fsdp2(model, world: int):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if list(layer.parameters()):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def _write_bits(path: str, name: str, arr: np.ndarray) -> None:
    np.save(os.path.join(path, f"{name}.npy"), arr.view(np.uint16) if arr.dtype.itemsize == 2 else arr)


def _read_bits(path: str, name: str, dtype_name: str) -> np.ndarray:
    import ml_dtypes

    raw = np.load(os.path.join(path, f"{name}.npy"))
    return raw.view(ml_dtypes.bfloat16) if dtype_name == "bfloat16" else raw


# ------------------------------------------------------------------------------------- torch -> jax
def fsdp2_save(rank: int, world: int, root: str) -> dict:
    return {d: _fsdp2_save_one(rank, world, os.path.join(root, d), d) for d in DTYPES}


def _fsdp2_save_one(rank: int, world: int, tmp: str, dtype_name: str) -> dict:
    import torch

    import arraycheckpoint as acp

    model = _fsdp2(_model(dtype_name, seed=0), world)
    acp.save(f"{tmp}/ck", {"model": model, "extra_state": {"step": 5, "lr": 0.25, "tag": "torch"}}, step=5)
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    if rank == 0:
        ref = os.path.join(tmp, "ref")
        os.makedirs(ref, exist_ok=True)
        for n, t in full.items():
            bits = t.view(torch.int16) if t.dtype == torch.bfloat16 else t
            _write_bits(ref, n, bits.numpy())
    return {n: list(t.shape) for n, t in full.items()}


def jax_load_from_torch(root: str) -> dict:
    return {d: _jax_load_one(os.path.join(root, d), d) for d in DTYPES}


def _jax_load_one(tmp: str, dtype_name: str) -> bool:
    import jax
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp
    from arraycheckpoint import load_jax

    assert jax.device_count() == 8
    mesh = jax.make_mesh((2, 4), ("a", "b"))
    specs = {"0.weight": P("b", "a"), "0.bias": P(("a", "b")), "2.weight": P("a", "b"), "2.bias": P("a")}
    meta = acp.read_metadata(f"{tmp}/ck")
    assert meta.framework in ("torch", "fsdp2") and meta.world_size == 4, (meta.framework, meta.world_size)
    jdtype = np.dtype(np.float32)
    if dtype_name == "bfloat16":
        import ml_dtypes

        jdtype = np.dtype(ml_dtypes.bfloat16)
    assert meta.tensors["model/0.weight"].dtype == dtype_name
    target = {
        "model": {
            layer: {
                p: jax.ShapeDtypeStruct(
                    SHAPES[f"{layer}.{p}"], jdtype, sharding=NS(mesh, specs[f"{layer}.{p}"])
                )
                for p in ("weight", "bias")
            }
            for layer in ("0", "2")
        }
    }
    target["extra_state"] = {"step": 0, "lr": 0.0, "tag": ""}
    loaded = acp.load(f"{tmp}/ck", target)
    assert loaded["extra_state"] == {"step": 5, "lr": 0.25, "tag": "torch"}, loaded["extra_state"]
    out = loaded["model"]
    for fqn in SHAPES:
        layer, p = fqn.split(".")
        arr = out[layer][p]
        ref = _read_bits(os.path.join(tmp, "ref"), fqn, dtype_name)
        assert arr.dtype == ref.dtype and arr.sharding == NS(mesh, specs[fqn])
        assert np.array_equal(np.asarray(arr).view(np.uint8), ref.view(np.uint8)), fqn
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data).view(np.uint8), ref[shard.index].view(np.uint8)), fqn
    # 10 rows do not split over 4 devices: refused by name, or loaded replicated on request
    bad = {"model": {"2": {"bias": jax.ShapeDtypeStruct((10,), jdtype, sharding=NS(mesh, P("b")))}}}
    try:
        acp.load(f"{tmp}/ck", bad, strict=False)
    except acp.ArrayCheckpointError as e:
        assert "model/2.bias" in str(e) and "axis b" in str(e), e
    else:
        raise AssertionError("indivisible target was accepted")
    rep = load_jax(f"{tmp}/ck", bad, strict=False, indivisible="replicate")["model"]["2"]["bias"]
    ref = _read_bits(os.path.join(tmp, "ref"), "2.bias", dtype_name)
    assert rep.sharding.is_fully_replicated and np.array_equal(
        np.asarray(rep).view(np.uint8), ref.view(np.uint8)
    )
    return True


def test_fsdp2_4_ranks_to_jax_8_devices_float32_and_bfloat16(tmp_path):
    shapes = run_distributed(fsdp2_save, world=4, args=(str(tmp_path),))
    assert shapes[0] == {d: {k: list(v) for k, v in SHAPES.items()} for d in DTYPES}
    assert run_jax(__file__, "jax_load_from_torch", str(tmp_path)) == [{d: True for d in DTYPES}]


# ------------------------------------------------------------------------------------- jax -> torch
def jax_save(root: str) -> dict:
    return {d: _jax_save_one(os.path.join(root, d), d) for d in DTYPES}


def _jax_save_one(tmp: str, dtype_name: str) -> bool:
    import jax
    import ml_dtypes
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    mesh = jax.make_mesh((8,), ("x",))
    mesh2 = jax.make_mesh((4, 2), ("a", "b"))
    specs = {
        "0.weight": NS(mesh, P("x", None)),
        "0.bias": NS(mesh2, P("b")),
        "2.weight": NS(mesh, P(None, "x")),
        "2.bias": NS(mesh, P()),
    }
    rng = np.random.default_rng(3)
    dtype = ml_dtypes.bfloat16 if dtype_name == "bfloat16" else np.float32
    tree: dict = {"0": {}, "2": {}}
    os.makedirs(os.path.join(tmp, "ref"), exist_ok=True)
    for fqn, shape in SHAPES.items():
        v = rng.standard_normal(shape).astype(dtype)
        _write_bits(os.path.join(tmp, "ref"), fqn, v)
        layer, p = fqn.split(".")
        tree[layer][p] = jax.device_put(v, specs[fqn])
    extra = {"step": 9, "tokens": np.arange(5, dtype=np.int64), "tag": "jax"}
    acp.save(f"{tmp}/ck", {"model": tree, "extra_state": extra}, step=9)
    return True


def fsdp2_load(rank: int, world: int, root: str) -> bool:
    return all(_fsdp2_load_one(rank, world, os.path.join(root, d), d) for d in DTYPES)


def _fsdp2_load_one(rank: int, world: int, tmp: str, dtype_name: str) -> bool:
    import torch

    import arraycheckpoint as acp

    model = _fsdp2(_model(dtype_name, seed=1), world)
    extra: dict = {}
    acp.load(f"{tmp}/ck", {"model": model, "extra_state": extra})
    assert extra["step"] == 9 and extra["tag"] == "jax", extra
    assert torch.equal(extra["tokens"], torch.arange(5)), extra
    for n, p in model.named_parameters():
        assert p.to_local().shape[0] in (14, 13, 12, 4, 3, 2), (n, p.to_local().shape)  # uneven shards
        full = p.full_tensor().detach()
        ref = _read_bits(os.path.join(tmp, "ref"), n, dtype_name)
        expected = torch.from_numpy(ref.view(np.int16) if dtype_name == "bfloat16" else ref)
        got = full.view(torch.int16) if dtype_name == "bfloat16" else full
        assert torch.equal(got, expected), n
    return True


def test_jax_8_devices_to_fsdp2_3_ranks_float32_and_bfloat16(tmp_path):
    assert run_jax(__file__, "jax_save", str(tmp_path)) == [{d: True for d in DTYPES}]
    assert run_distributed(fsdp2_load, world=3, args=(str(tmp_path),)) == [True] * 3
