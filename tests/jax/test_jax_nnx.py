"""flax ``nnx.State`` targets: saved and loaded by the variable's path (``model/dense.kernel``), bit-exact,
sharded; torch weights into an nnx model; checkpoints saved with the older ``<path>.value`` names."""

from __future__ import annotations

from jaxrun import run_jax


def _model(seed):
    from flax import nnx

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(8, 16, rngs=rngs)
            self.bn = nnx.BatchNorm(16, rngs=rngs)

    return Net(nnx.Rngs(seed))


def body_nnx_state(tmp):
    import jax
    import numpy as np
    import torch
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    mesh = jax.make_mesh((4,), ("x",), devices=jax.devices()[:4])
    src = _model(0)
    state = nnx.state(src)
    # shard the kernel over the mesh (a real sharded nnx state)
    state["dense"]["kernel"].value = jax.device_put(
        state["dense"]["kernel"].value, NamedSharding(mesh, P(None, "x"))
    )
    acp.save(f"{tmp}/nnx", {"model": state})
    names = sorted(acp.read_metadata(f"{tmp}/nnx").tensors)
    assert "model/dense.kernel" in names and not any(n.endswith(".value") for n in names), names

    dst = _model(1)
    target = nnx.state(dst)
    target["dense"]["kernel"].value = jax.device_put(
        target["dense"]["kernel"].value, NamedSharding(mesh, P("x", None))
    )
    restored = acp.load(f"{tmp}/nnx", {"model": target})["model"]
    assert isinstance(restored, nnx.State)
    nnx.update(dst, restored)
    want = jax.tree.leaves(nnx.state(src))
    got = jax.tree.leaves(nnx.state(dst))
    assert len(want) == len(got) == 6
    for a, b in zip(want, got):
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert restored["dense"]["kernel"].value.sharding.spec == P("x", None)

    # torch Linear weights into the nnx model: names by key_map, layout by transforms
    lin = torch.nn.Linear(8, 16)
    acp.save(f"{tmp}/torch", {"model": torch.nn.ModuleDict({"dense": lin})})
    fresh = _model(2)
    out = acp.load(
        f"{tmp}/torch",
        {"model": nnx.state(fresh, nnx.Param)},
        key_map={"model/dense.kernel": "model/dense.weight", "model/bn.scale": None, "model/bn.bias": None},
        transforms={"model/dense.kernel": np.transpose},
    )["model"]
    assert np.array_equal(np.asarray(out["dense"]["kernel"].value), lin.weight.detach().numpy().T)
    assert np.array_equal(np.asarray(out["dense"]["bias"].value), lin.bias.detach().numpy())

    # a checkpoint that stored the variables as ``<path>.value`` still loads
    legacy = {
        k: {"value": np.asarray(v)}
        for k, v in {"kernel": src.dense.kernel.value, "bias": src.dense.bias.value}.items()
    }
    acp.save(f"{tmp}/legacy", {"model": jax.tree.map(jax.numpy.asarray, legacy)})
    old = acp.load(f"{tmp}/legacy", {"model": nnx.state(_model(3).dense)})["model"]
    assert np.array_equal(np.asarray(old["kernel"].value), np.asarray(src.dense.kernel.value))
    return {"ok": True}


def test_nnx_state_roundtrip_torch_and_legacy_names(tmp_path):
    assert run_jax(__file__, "body_nnx_state", str(tmp_path)) == [{"ok": True}]
