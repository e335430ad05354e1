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


def body_nnx_rng_state(tmp):
    """A model with dropout keeps its RNG streams in ``nnx.state``: typed PRNG key arrays (``key<fry>``).
    ``acp.save`` of such a state raised ``TypeError: Cannot interpret 'key<fry>' as a data type``; keys are
    stored as their key data (uint32) and come back as keys of the target's implementation, concrete or
    abstract (``nnx.eval_shape``), sharded like the target."""
    import jax
    import numpy as np
    import optax
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    class Net(nnx.Module):
        def __init__(self, rngs):
            self.dense = nnx.Linear(4, 8, rngs=rngs)
            self.drop = nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x):
            return self.drop(self.dense(x))

    src = Net(nnx.Rngs(0))
    opt = nnx.Optimizer(src, optax.adamw(1e-2), wrt=nnx.Param)
    x = jax.numpy.ones((2, 4))
    opt.update(src, nnx.grad(lambda m: m(x).sum())(src))  # advances the dropout stream
    acp.save(f"{tmp}/ck", {"model": nnx.state(src), "optimizer": nnx.state(opt)})

    dst = Net(nnx.Rngs(1))
    opt2 = nnx.Optimizer(dst, optax.adamw(1e-2), wrt=nnx.Param)
    out = acp.load(f"{tmp}/ck", {"model": nnx.state(dst), "optimizer": nnx.state(opt2)})
    nnx.update(dst, out["model"])
    nnx.update(opt2, out["optimizer"])
    for a, b in zip(jax.tree.leaves(nnx.state(src)), jax.tree.leaves(nnx.state(dst))):
        if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key):
            assert b.dtype == a.dtype
            a, b = jax.random.key_data(a), jax.random.key_data(b)
        assert np.array_equal(np.asarray(a), np.asarray(b))
    assert np.array_equal(np.asarray(src(x)), np.asarray(dst(x)))  # the same dropout mask: streams resumed

    # an abstract target (nnx.eval_shape), its key sharded over a mesh
    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    keys = jax.device_put(jax.random.split(jax.random.key(3), 4), NamedSharding(mesh, P("x")))
    acp.save(f"{tmp}/keys", {"model": {"k": keys}})
    abstract = jax.ShapeDtypeStruct(keys.shape, keys.dtype, sharding=NamedSharding(mesh, P("x")))
    got = acp.load(f"{tmp}/keys", {"model": {"k": abstract}})["model"]["k"]
    assert got.dtype == keys.dtype and got.sharding.spec == P("x")
    assert np.array_equal(np.asarray(jax.random.key_data(got)), np.asarray(jax.random.key_data(keys)))
    shape = acp.read_metadata(f"{tmp}/keys").tensors["model/k"].shape
    assert tuple(shape) == (4, 2)  # the key data: readable by any zarr reader
    return {"ok": True}


def test_nnx_state_with_rng_streams_roundtrips(tmp_path):
    assert run_jax(__file__, "body_nnx_rng_state", str(tmp_path)) == [{"ok": True}]
