"""The JAX adapter on one process with 8 CPU devices: shardings, names, load targets, errors.

Each test body runs in a JAX interpreter with 8 CPU devices (see ``jaxrun``); bodies return JSON and assert inside.
"""

from __future__ import annotations

import subprocess
import sys

from jaxrun import run_jax

# ---------------------------------------------------------------------------------------------- bodies


def _setup():
    import jax
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    assert jax.device_count() == 8, jax.devices()
    mesh1 = jax.make_mesh((8,), ("x",))
    mesh2 = jax.make_mesh((2, 4), ("a", "b"))
    return jax, np, NamedSharding, P, mesh1, mesh2


def _values(np, seed=0):
    import ml_dtypes

    rng = np.random.default_rng(seed)
    return {
        "w2d": rng.standard_normal((16, 24)).astype(np.float32),
        "bf": rng.standard_normal((8, 32)).astype(ml_dtypes.bfloat16),
        "v": rng.integers(-1000, 1000, (40,)).astype(np.int32),
        "s": np.float32(rng.standard_normal()),
        "big": rng.standard_normal((64, 16)).astype(np.float32),
    }


def body_roundtrip_shardings(tmp):
    """Save arrays in many shardings; load each into a different sharding; bit-exact."""
    import typing

    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp

    vals = _values(np)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[3])

    class OptState(typing.NamedTuple):
        count: typing.Any
        mu: typing.Any

    saved_shardings = {
        "w2d": NS(mesh2, P("a", "b")),  # 2-D, fully sharded
        "bf": NS(mesh2, P(None, "b")),  # partially replicated over "a"
        "v": NS(mesh1, P("x")),  # 1-D mesh
        "s": NS(mesh1, P()),  # fully replicated scalar
        "big": single,  # one device
    }
    arrs = {k: jax.device_put(vals[k], s) for k, s in saved_shardings.items()}
    state = {
        "model": {"layers": [{"w": arrs["w2d"], "bf": arrs["bf"]}, {"v": arrs["v"]}], "big": arrs["big"]},
        "opt": OptState(count=arrs["s"], mu={"w": arrs["w2d"]}),
        "meta": {"step": 12, "lr": 0.5, "name": "run", "none": None, "tup": (1, "a")},
    }
    acp.save(f"{tmp}/ck", state, step=12)
    meta = acp.read_metadata(f"{tmp}/ck")
    assert meta.framework == "jax" and meta.step == 12
    assert sorted(meta.tensors) == [
        "model/big",
        "model/layers.0.bf",
        "model/layers.0.w",
        "model/layers.1.v",
        "opt/count",
        "opt/mu.w",
    ], sorted(meta.tensors)
    # every distinct region is recorded once: 8 for the 2-D sharding, 4 for the partly replicated one
    assert len(meta.tensors["model/layers.0.w"].shards) == 8
    assert len(meta.tensors["model/layers.0.bf"].shards) == 4
    assert len(meta.tensors["opt/count"].shards) == 1
    assert meta.tensors["model/layers.0.bf"].dtype == "bfloat16"

    load_shardings = {
        "w2d": NS(mesh1, P(None, "x")),
        "bf": NS(mesh2, P("a", "b")),
        "v": NS(mesh2, P(("a", "b"))),
        "s": single,
        "big": NS(mesh2, P("b", "a")),
    }

    def sd(k):
        return jax.ShapeDtypeStruct(vals[k].shape, vals[k].dtype, sharding=load_shardings[k])

    target = {
        "model": {"layers": [{"w": sd("w2d"), "bf": sd("bf")}, {"v": sd("v")}], "big": sd("big")},
        "opt": OptState(count=sd("s"), mu={"w": sd("w2d")}),
        "meta": {"step": 0, "lr": 0.0, "name": "", "none": None, "tup": (0, "")},
    }
    out = acp.load(f"{tmp}/ck", target)
    m = out["model"]
    pairs = [
        (m["layers"][0]["w"], "w2d"),
        (m["layers"][0]["bf"], "bf"),
        (m["layers"][1]["v"], "v"),
        (m["big"], "big"),
        (out["opt"].count, "s"),
        (out["opt"].mu["w"], "w2d"),
    ]
    for arr, k in pairs:
        assert isinstance(arr, jax.Array)
        assert arr.sharding == load_shardings[k], (k, arr.sharding)
        assert arr.dtype == vals[k].dtype
        assert np.array_equal(np.asarray(arr), vals[k]), k
        for shard in arr.addressable_shards:  # each device holds exactly its region
            assert np.array_equal(np.asarray(shard.data), vals[k][shard.index]), k
    assert isinstance(out["opt"], OptState)
    assert out["meta"] == {"step": 12, "lr": 0.5, "name": "run", "none": None, "tup": (1, "a")}, out["meta"]

    # concrete arrays as targets: their shardings are used
    conc = {
        "model": {
            "layers": [
                {
                    "w": jax.device_put(np.zeros_like(vals["w2d"]), NS(mesh2, P("b", None))),
                    "bf": jax.device_put(np.zeros_like(vals["bf"]), NS(mesh1, P())),
                },
                {"v": np.zeros(40, np.int32)},
            ],
            "big": jax.device_put(np.zeros_like(vals["big"]), NS(mesh1, P("x"))),
        }
    }
    got = acp.load(f"{tmp}/ck", conc)["model"]
    assert got["layers"][0]["w"].sharding == NS(mesh2, P("b", None))
    assert np.array_equal(np.asarray(got["layers"][0]["w"]), vals["w2d"])
    assert np.array_equal(np.asarray(got["layers"][0]["bf"]), vals["bf"])
    assert isinstance(got["layers"][1]["v"], np.ndarray) and np.array_equal(got["layers"][1]["v"], vals["v"])
    assert np.array_equal(np.asarray(got["big"]), vals["big"])
    return {"ok": True}


def body_load_reads_only_own_regions(tmp):
    """The load job asks the engine for exactly the distinct regions of this process's devices."""
    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp
    from arraycheckpoint.adapters.base import AdapterOptions
    from arraycheckpoint.adapters.jax import JaxAdapter
    from arraycheckpoint.planning.regions import Box

    x = np.arange(16 * 24, dtype=np.float32).reshape(16, 24)
    acp.save(f"{tmp}/ck", {"model": {"w": jax.device_put(x, NS(mesh1, P("x")))}})
    meta = acp.read_metadata(f"{tmp}/ck")
    target = {"model": {"w": jax.ShapeDtypeStruct((16, 24), np.float32, sharding=NS(mesh2, P("b", None)))}}
    job = JaxAdapter().load_job(meta, target, AdapterOptions())
    (t,) = job.targets
    boxes = sorted(s.box for s in t.shards)
    # 4 distinct row blocks, each replicated on 2 devices: read once each
    assert boxes == [Box((4 * i, 0), (4, 24)) for i in range(4)], boxes
    # save side: one shard per distinct region; on CPU the source offers a zero-copy view of the buffer
    from arraycheckpoint.adapters.jax.arrays import save_tensor

    y = jax.device_put(x, NS(mesh2, P("b", None)))
    item = save_tensor("model/y", y)
    assert sorted(s.box for s in item.shards) == boxes
    for s in item.shards:
        view = s.source.stable_view()
        dev = next(d for d in y.addressable_shards if d.index[0].start == s.box.offsets[0])
        assert np.shares_memory(view, np.asarray(dev.data)) and np.array_equal(view, x[s.box.slices()])
    return {"ok": True}


def body_transform_cast_keymap(tmp):
    """A torch-style [out, in] weight loads as a flax-style [in, out] kernel in bfloat16, renamed."""
    jax, np, NS, P, mesh1, mesh2 = _setup()
    import ml_dtypes

    import arraycheckpoint as acp
    from arraycheckpoint import load_jax

    w = np.random.default_rng(1).standard_normal((24, 16)).astype(np.float32)  # [out, in]
    b = np.arange(24, dtype=np.float32)
    acp.save(
        f"{tmp}/ck",
        {"model": {"fc": {"weight": jax.device_put(w, NS(mesh1, P("x"))), "bias": jax.device_put(b)}}},
    )
    target = {
        "model": {
            "dense": {
                "kernel": jax.ShapeDtypeStruct((16, 24), ml_dtypes.bfloat16, sharding=NS(mesh2, P("a", "b"))),
                "bias": jax.ShapeDtypeStruct((24,), ml_dtypes.bfloat16, sharding=NS(mesh1, P("x"))),
            }
        }
    }
    key_map = {"model/dense.kernel": "model/fc.weight", "model/dense.bias": "model/fc.bias"}
    out = load_jax(
        f"{tmp}/ck", target, key_map=key_map, transforms={"model/dense.kernel": np.transpose}, allow_cast=True
    )["model"]["dense"]
    assert out["kernel"].dtype == ml_dtypes.bfloat16 and out["kernel"].sharding == NS(mesh2, P("a", "b"))
    assert np.array_equal(np.asarray(out["kernel"]), w.T.astype(ml_dtypes.bfloat16))
    assert np.array_equal(np.asarray(out["bias"]), b.astype(ml_dtypes.bfloat16))
    # a dtype change without allow_cast is refused, naming the tensor
    try:
        acp.load(
            f"{tmp}/ck",
            {
                "model": {
                    "fc": {
                        "bias": jax.ShapeDtypeStruct((24,), ml_dtypes.bfloat16),
                        "weight": jax.ShapeDtypeStruct((24, 16), np.float32),
                    }
                }
            },
        )
    except acp.StateMismatchError as e:
        assert "model/fc.bias" in str(e) and "allow_cast" in str(e), e
    else:
        raise AssertionError("dtype mismatch was not refused")
    # a transform returning the wrong shape is refused
    try:
        load_jax(
            f"{tmp}/ck",
            target,
            key_map=key_map,
            allow_cast=True,
            transforms={"model/dense.kernel": lambda a: a},
        )
    except acp.ArrayCheckpointError as e:
        assert "model/dense.kernel" in str(e) and "[16, 24]" in str(e), e
    else:
        raise AssertionError("wrong transform shape was not refused")
    return {"ok": True}


def body_indivisible(tmp):
    """DTensor-style uneven shapes: a clear error naming tensor and axis, or a replicated load on request."""
    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp
    from arraycheckpoint import load_jax

    x = np.arange(10 * 6, dtype=np.float32).reshape(10, 6)
    acp.save(f"{tmp}/ck", {"model": {"w": jax.device_put(x, NS(mesh2, P(None, "a")))}})
    target = {"model": {"w": jax.ShapeDtypeStruct((10, 6), np.float32, sharding=NS(mesh2, P("b", "a")))}}
    try:
        acp.load(f"{tmp}/ck", target)
    except acp.ArrayCheckpointError as e:
        msg = str(e)
        assert "model/w" in msg and "dimension 0" in msg and "mesh axis b" in msg and "replicate" in msg, msg
    else:
        raise AssertionError("indivisible sharding was not refused")
    out = load_jax(f"{tmp}/ck", target, indivisible="replicate")["model"]["w"]
    assert out.sharding == NS(mesh2, P(None, "a")), out.sharding
    assert np.array_equal(np.asarray(out), x)
    return {"ok": True}


def body_strict(tmp):
    """Strict loads list missing/unexpected/mismatched names; non-strict loads the intersection."""
    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp

    a = np.arange(16, dtype=np.float32)
    acp.save(f"{tmp}/ck", {"model": {"a": jax.device_put(a, NS(mesh1, P("x"))), "b": jax.device_put(a * 2)}})
    sd = jax.ShapeDtypeStruct((16,), np.float32, sharding=NS(mesh1, P("x")))
    target = {"model": {"a": sd, "c": sd, "b": jax.ShapeDtypeStruct((8,), np.float32)}}
    try:
        acp.load(f"{tmp}/ck", target)
    except acp.StateMismatchError as e:
        msg = str(e)
        assert "model/c" in msg and "model/b" in msg and "[16]" in msg, msg
    else:
        raise AssertionError("strict load accepted a mismatching target")
    report: dict = {}
    out = acp.load(f"{tmp}/ck", target, strict=False, report=report)["model"]
    assert report["missing"] == ["model/c"] and len(report["mismatched"]) == 1, report
    assert np.array_equal(np.asarray(out["a"]), a)
    assert out["c"] is sd  # not in the checkpoint: returned unchanged
    # numpy-only targets of per-tensor entries load whole on the host (nothing to detect jax from: say so)
    host = acp.load(
        f"{tmp}/ck",
        {"model": {"a": np.zeros(16, np.float32), "b": np.zeros(16, np.float32)}},
        framework="jax",
    )
    assert isinstance(host["model"]["a"], np.ndarray) and np.array_equal(host["model"]["b"], a * 2)
    return {"ok": True}


def body_save_async_and_abstract_refused(tmp):
    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp

    x = jax.device_put(np.ones((8, 8), np.float32), NS(mesh1, P("x")))
    fut = acp.save_async(f"{tmp}/ck", {"model": {"w": x}}, step=1)
    fut.staged.result()
    fut.result()
    assert acp.read_metadata(f"{tmp}/ck").step == 1
    try:
        acp.save(f"{tmp}/ck2", {"model": {"w": jax.ShapeDtypeStruct((8, 8), np.float32), "x": x}})
    except acp.ArrayCheckpointError as e:
        assert "model/w" in str(e) and "ShapeDtypeStruct" in str(e)
    else:
        raise AssertionError("abstract leaf was saved")
    return {"ok": True}


def body_restore_adopts_aligned_host_buffers(tmp):
    """A restore with the saved sharding reads into 64-byte-aligned host buffers that jax adopts (no copy)."""
    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp

    vals = _values(np)
    shardings = {"w2d": NS(mesh2, P("a", "b")), "big": NS(mesh1, P("x")), "bf": NS(mesh2, P(None, "b"))}
    tree = {k: jax.device_put(vals[k], s) for k, s in shardings.items()}
    acp.save(f"{tmp}/ck", {"model": tree})
    from arraycheckpoint.adapters.jax import adapter

    ours = set()
    allocate = adapter.aligned_empty

    def recording(*args, **kwargs):
        buf = allocate(*args, **kwargs)
        ours.add(buf.ctypes.data)
        return buf

    adapter.aligned_empty = recording
    abstract = {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=v.sharding) for k, v in tree.items()}
    out = acp.load(f"{tmp}/ck", {"model": abstract})["model"]
    for k, v in out.items():
        assert np.array_equal(np.asarray(v), vals[k]), k
        assert v.sharding == shardings[k], k
    # one device per region: every device buffer is the aligned host buffer the engine read into
    for k in ("w2d", "big"):
        assert all(s.data.unsafe_buffer_pointer() in ours for s in out[k].addressable_shards), k
    # replicated regions ("bf" over "a") are copied per device instead of aliased
    assert not any(s.data.unsafe_buffer_pointer() in ours for s in out["bf"].addressable_shards)
    return {"ok": True}


# ----------------------------------------------------------------------------------------------- tests


def test_roundtrip_many_shardings(tmp_path):
    assert run_jax(__file__, "body_roundtrip_shardings", str(tmp_path)) == [{"ok": True}]


def test_load_reads_only_own_regions(tmp_path):
    assert run_jax(__file__, "body_load_reads_only_own_regions", str(tmp_path)) == [{"ok": True}]


def test_transform_cast_and_key_map(tmp_path):
    assert run_jax(__file__, "body_transform_cast_keymap", str(tmp_path)) == [{"ok": True}]


def test_indivisible_sharding_error_or_replicate(tmp_path):
    assert run_jax(__file__, "body_indivisible", str(tmp_path)) == [{"ok": True}]


def test_strict_and_non_strict(tmp_path):
    assert run_jax(__file__, "body_strict", str(tmp_path)) == [{"ok": True}]


def test_save_async_and_abstract_leaf_refused(tmp_path):
    assert run_jax(__file__, "body_save_async_and_abstract_refused", str(tmp_path)) == [{"ok": True}]


def test_import_does_not_import_jax():
    code = "import sys, arraycheckpoint; assert 'jax' not in sys.modules, 'jax imported'"
    subprocess.run([sys.executable, "-c", code], check=True)


def body_registered_nodes(tmp):
    """Registered dataclasses (flax.struct-like) and optax-like tuples of NamedTuples flatten to FQN names."""
    import dataclasses
    import typing

    jax, np, NS, P, mesh1, mesh2 = _setup()
    import arraycheckpoint as acp

    @jax.tree_util.register_dataclass
    @dataclasses.dataclass
    class TrainState:
        step: typing.Any
        params: typing.Any
        opt_state: typing.Any

    class Adam(typing.NamedTuple):
        count: typing.Any
        mu: typing.Any
        nu: typing.Any

    class Empty(typing.NamedTuple):
        pass

    w = np.arange(32 * 8, dtype=np.float32).reshape(32, 8)
    put = lambda a: jax.device_put(a, NS(mesh1, P("x")))  # noqa: E731
    state = TrainState(
        step=jax.device_put(np.int32(5)),
        params={"dense": {"kernel": put(w)}},
        opt_state=(
            Adam(
                jax.device_put(np.int32(5)),
                {"dense": {"kernel": put(w + 1)}},
                {"dense": {"kernel": put(w * 2)}},
            ),
            Empty(),
        ),
    )
    acp.save(f"{tmp}/ck", {"train": state})
    names = sorted(acp.read_metadata(f"{tmp}/ck").tensors)
    assert names == [
        "train/opt_state.0.count",
        "train/opt_state.0.mu.dense.kernel",
        "train/opt_state.0.nu.dense.kernel",
        "train/params.dense.kernel",
        "train/step",
    ], names
    target = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NS(mesh2, P("b")) if x.ndim else x.sharding
        ),
        state,
    )
    out = acp.load(f"{tmp}/ck", {"train": target})["train"]
    assert (
        isinstance(out, TrainState)
        and isinstance(out.opt_state[0], Adam)
        and isinstance(out.opt_state[1], Empty)
    )
    assert int(out.step) == 5 and np.array_equal(np.asarray(out.opt_state[0].nu["dense"]["kernel"]), w * 2)
    assert out.params["dense"]["kernel"].sharding == NS(mesh2, P("b"))
    return {"ok": True}


def test_registered_dataclass_and_optax_like_states(tmp_path):
    assert run_jax(__file__, "body_registered_nodes", str(tmp_path)) == [{"ok": True}]


def test_restore_adopts_aligned_host_buffers(tmp_path):
    assert run_jax(__file__, "body_restore_adopts_aligned_host_buffers", str(tmp_path)) == [{"ok": True}]


def body_scalar_saved_as_array_or_value(tmp):
    """A leaf saved as a jax array and loaded into a Python scalar, or the other way round, kept the target's
    own value silently, even under strict (a TrainState saved from a jitted step holds ``step`` as a 0-d
    array; ``TrainState.create`` makes it the int 0: a resume restarted at step 0), and an abstract target
    came back as the ``ShapeDtypeStruct`` itself. Each loads what was saved, in the target's kind."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    w = jnp.ones(3)
    acp.save(f"{tmp}/array", {"model": {"w": w, "step": jnp.asarray(3, jnp.int32), "lr": jnp.asarray(0.5)}})
    acp.save(f"{tmp}/value", {"model": {"w": w, "step": 3, "lr": 0.5}})

    got = acp.load(f"{tmp}/array", {"model": {"w": w, "step": 0, "lr": 1.0}})["model"]
    assert got["step"] == 3 and type(got["step"]) is int and got["lr"] == 0.5 and type(got["lr"]) is float

    mesh = jax.make_mesh((2,), ("x",), devices=jax.devices()[:2])
    target = {
        "w": w,
        "step": jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())),
        "lr": jnp.asarray(1.0),
    }
    got = acp.load(f"{tmp}/value", {"model": target})["model"]
    assert isinstance(got["step"], jax.Array) and got["step"].dtype == jnp.int32 and int(got["step"]) == 3
    assert got["step"].sharding == NamedSharding(mesh, P())
    assert isinstance(got["lr"], jax.Array) and float(got["lr"]) == 0.5
    got = acp.load(f"{tmp}/value", {"model": {"w": w, "step": np.zeros((), np.int64), "lr": 0.0}})["model"]
    assert isinstance(got["step"], np.ndarray) and int(got["step"]) == 3

    # what cannot be the target's: an error naming the entry, never the target's value kept
    for bad, what in (
        ({"step": jnp.zeros(2, jnp.int32)}, "shape"),
        ({"lr": jnp.asarray(0, jnp.int32)}, "0.5"),
    ):
        try:
            acp.load(f"{tmp}/value", {"model": {"w": w, "step": 0, "lr": 0.0, **bad}})
        except acp.ArrayCheckpointError as e:
            assert "model/" in str(e) and what in str(e), e
        else:
            raise AssertionError(f"{bad} loaded")
    # a plain number given an array of another shape, or a value it cannot hold exactly, under either strict
    # (the array came back as itself; 2**53 + 1 came back as 2**53 in a float)
    acp.save(f"{tmp}/big", {"model": {"w": w, "n": np.asarray(2**53 + 1, np.int64), "v": np.arange(3)}})
    for target, what in (
        ({"n": 0, "v": 0}, "shape [3]"),
        ({"n": 0.0, "v": np.zeros(3, np.int64)}, "exactly"),
    ):
        for strict in (True, False):
            try:
                acp.load(f"{tmp}/big", {"model": {"w": w, **target}}, strict=strict)
            except acp.ArrayCheckpointError as e:
                assert what in str(e), e
            else:
                raise AssertionError(f"{target} loaded (strict={strict})")
    # a key the checkpoint does not hold, strict=False: the target's key stays (it crashed in wrap_key_data)
    key = jax.random.key(7)
    got = acp.load(f"{tmp}/value", {"model": {"w": w, "step": 0, "lr": 0.0, "rng": key}}, strict=False)[
        "model"
    ]
    assert jnp.array_equal(jax.random.key_data(got["rng"]), jax.random.key_data(key)) and got["step"] == 3
    return {"ok": True}


def test_scalar_saved_as_array_or_value_loads_either_way(tmp_path):
    assert run_jax(__file__, "body_scalar_saved_as_array_or_value", str(tmp_path)) == [{"ok": True}]
