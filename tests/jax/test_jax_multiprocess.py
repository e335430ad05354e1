"""Multi-controller JAX on CPU: 2 processes x 4 devices (``jax.distributed`` with a loopback coordinator).

The checkpoint collectives go through :class:`~arraycheckpoint.adapters.jax.JaxCommunicator` (the coordination
service's key-value store). Checked: every region is written once with writers on both processes, a
2-process save loads back under another sharding in 2 processes and in 1 process with 8 devices, bit-exact.
"""

from __future__ import annotations

from jaxrun import run_jax


def _expected():
    import ml_dtypes
    import numpy as np

    rng = np.random.default_rng(7)
    return {
        "w": rng.standard_normal((32, 64)).astype(np.float32),
        "rep": rng.standard_normal((64, 64)).astype(np.float32),
        "bf": rng.standard_normal((16, 8)).astype(ml_dtypes.bfloat16),
    }


def body_mp_save(tmp):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp
    from arraycheckpoint.adapters.jax import JaxCommunicator, jax_communicator

    assert jax.process_count() == 2 and jax.device_count() == 8 and jax.local_device_count() == 4
    comm = jax_communicator()
    assert isinstance(comm, JaxCommunicator) and comm.world_size == 2 and comm.rank == jax.process_index()
    # the communicator's collectives themselves
    gathered = comm.all_gather_json({"rank": comm.rank, "pad": "x" * (9 << 20) if comm.rank else ""})
    assert [g["rank"] for g in gathered] == [0, 1] and len(gathered[1]["pad"]) == 9 << 20
    send = [np.full(r + 3, comm.rank, np.uint8) for r in range(2)]
    got = comm.all_to_all_bytes(send, [comm.rank + 3, comm.rank + 3])
    assert [g.tolist() for g in got] == [[0] * (comm.rank + 3), [1] * (comm.rank + 3)]
    assert comm.broadcast_json({"v": comm.rank}, src=1) == {"v": 1}

    mesh = jax.make_mesh((2, 4), ("a", "b"))  # "a" spans the two processes
    vals = _expected()
    shardings = {"w": NS(mesh, P("a", "b")), "rep": NS(mesh, P()), "bf": NS(mesh, P("b", None))}
    arrs = {
        k: jax.make_array_from_callback(v.shape, shardings[k], lambda idx, v=v: v[idx])
        for k, v in vals.items()
    }
    small = acp.PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=4 << 10, inner_chunk_bytes=1 << 10)
    meta = acp.save(f"{tmp}/ck", {"model": arrs, "extra": {"step": 3}}, step=3, plan_options=small)
    if jax.process_index() == 0:
        assert meta.world_size == 2
        rep = meta.tensors["model/rep"]
        # the fully replicated tensor is held by both processes; its chunks are written by both, once each
        assert set(rep.writers) == {0, 1}, rep.writers
        assert len(rep.shards) == 1
        assert len(meta.tensors["model/w"].shards) == 8

    # load back in 2 processes under another sharding
    other = {"w": NS(mesh, P("b", "a")), "rep": NS(mesh, P(None, ("a", "b"))), "bf": NS(mesh, P("a", None))}
    target = {
        "model": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=other[k]) for k, v in vals.items()},
        "extra": {"step": 0},
    }
    out = acp.load(f"{tmp}/ck", target)
    assert out["extra"] == {"step": 3}
    for k, v in vals.items():
        arr = out["model"][k]
        assert arr.sharding == other[k] and not arr.is_fully_addressable
        for shard in arr.addressable_shards:
            assert np.array_equal(np.asarray(shard.data), v[shard.index]), k
    # a second save reuses the cached plan and the communicator
    acp.save(f"{tmp}/ck2", {"model": arrs, "extra": {"step": 4}}, step=4, plan_options=small)
    return {"rank": jax.process_index()}


def body_single_load(tmp):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    assert jax.process_count() == 1 and jax.device_count() == 8
    mesh = jax.make_mesh((8,), ("x",))
    vals = _expected()
    for ck in ("ck", "ck2"):
        target = {
            "model": {
                k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NS(mesh, P(None, "x")))
                for k, v in vals.items()
            }
        }
        out = acp.load(f"{tmp}/{ck}", target)["model"]
        for k, v in vals.items():
            assert np.array_equal(np.asarray(out[k]), v), (ck, k)
    return {"ok": True}


def test_two_process_jax_save_and_reshard(tmp_path):
    ranks = run_jax(__file__, "body_mp_save", str(tmp_path), devices=8, processes=2)
    assert ranks == [{"rank": 0}, {"rank": 1}]
    assert run_jax(__file__, "body_single_load", str(tmp_path)) == [{"ok": True}]
