"""Openness against Orbax: its default (OCDBT) output is not a Zarr hierarchy zarr-python can open; ours is.

Both checkpoints are written from the same sharded pytree on 8 CPU devices; zarr-python (a real, independent
reader) then tries to open the tensor in each.
"""

from __future__ import annotations

from jaxrun import run_jax


def body_zarr_opens_ours_not_orbax(tmp):
    import os

    import jax
    import ml_dtypes
    import numpy as np
    import orbax.checkpoint as ocp
    import zarr
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    mesh = jax.make_mesh((2, 4), ("a", "b"))
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    b = np.random.default_rng(1).standard_normal((32,)).astype(ml_dtypes.bfloat16)
    tree = {
        "model": {"w": jax.device_put(w, NS(mesh, P("a", "b"))), "b": jax.device_put(b, NS(mesh, P("b")))}
    }

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(f"{tmp}/orbax", tree)
    ckptr.wait_until_finished()
    files = {f for _, _, fs in os.walk(f"{tmp}/orbax") for f in fs}
    assert "manifest.ocdbt" in files, files  # Orbax's default format is OCDBT
    refused = 0
    for path in (f"{tmp}/orbax/model.w", f"{tmp}/orbax/model/w", f"{tmp}/orbax"):
        try:
            zarr.open_array(path, mode="r")
        except Exception:  # noqa: BLE001 - FileNotFoundError / ArrayNotFoundError
            refused += 1
    assert refused == 3
    try:
        zarr.open_group(f"{tmp}/orbax", mode="r")
    except Exception:  # noqa: BLE001
        refused += 1
    assert refused == 4

    acp.save(f"{tmp}/ours", tree)
    # zarr-python 3.1.x collects the zarr.data_type entry points (our bfloat16) but never loads them itself
    from zarr.core.dtype import data_type_registry

    data_type_registry._lazy_load()
    # both tensors are small, so they sit in a pack: a plain ZipStore reads each one where the
    # metadata (plain JSON) says, and arraycheckpoint's store shows the whole checkpoint as one hierarchy
    import json

    from arraycheckpoint.zarr import checkpoint_store

    with open(f"{tmp}/ours/.acp/metadata.json") as f:
        tensors = json.load(f)["tensors"]
    pack = tensors["model/w"]["pack"]
    if not pack.endswith(".zip"):  # format 6: the rank whose packs hold it; one process wrote it all
        pack = pack.partition("@")[0] + ".0.zip"
    packed = zarr.storage.ZipStore(f"{tmp}/ours/{pack}", mode="r")
    arr = zarr.open_array(packed, path="model/w", mode="r")
    assert arr.shape == (64, 32) and np.array_equal(arr[...], w)
    store = checkpoint_store(f"{tmp}/ours")
    assert np.array_equal(
        zarr.open_array(store, path="model/b", mode="r")[...].view(np.uint16), b.view(np.uint16)
    )
    assert zarr.open_array(store, path="model/w", mode="r")[8:40, 5:9].tolist() == w[8:40, 5:9].tolist()
    group = zarr.open_group(store, mode="r")
    assert sorted(k for k, _ in group["model"].members()) == ["b", "w"]
    # and Orbax's checkpoint itself is sound: it restores through Orbax
    restored = ckptr.restore(
        f"{tmp}/orbax",
        jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree),
    )
    assert np.array_equal(np.asarray(restored["model"]["w"]), w)
    return {"ok": True}


def test_zarr_python_opens_ours_but_not_orbax_ocdbt(tmp_path):
    assert run_jax(__file__, "body_zarr_opens_ours_not_orbax", str(tmp_path)) == [{"ok": True}]
