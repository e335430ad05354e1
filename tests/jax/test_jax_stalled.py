"""A JAX process that stalls (SIGSTOP) inside a save (issue 12): the other process fails within the save's
``timeout=`` with StalledRankError naming it (not the key-value store's 30-minute default wait), the stalled
one fails when it resumes, and the next save on the same communicator is bit-exact. Two real JAX processes
(``jax.distributed`` on loopback); the checkpoint collectives run over the coordination service's store."""

from __future__ import annotations

from jaxrun import run_jax


def body_stall(tmp):
    import os
    import signal

    import jax
    import numpy as np
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P
    from stalling import register_stalling_scheme

    import arraycheckpoint as acp
    from arraycheckpoint.adapters.jax import jax_communicator

    assert "ACP_LIVENESS_TIMEOUT" not in os.environ
    comm = jax_communicator()
    me = jax.process_index()
    pids = comm.all_gather_json(os.getpid())
    stall = register_stalling_scheme("jaxstall")
    mesh = jax.make_mesh((2,), ("a",))
    values = np.arange(64 * 16, dtype=np.float32).reshape(64, 16)
    sharding = NS(mesh, P("a", None))
    arr = jax.make_array_from_callback(values.shape, sharding, lambda idx: values[idx])
    acp.save(f"jaxstall://{tmp}/warm", {"model": {"w": arr}})  # default bound (300 s)
    stall["armed"] = me == 1
    error = None
    try:
        acp.save(f"jaxstall://{tmp}/first", {"model": {"w": arr}}, timeout=3)
    except acp.StalledRankError as e:
        error = str(e)
    if me == 0:
        os.kill(pids[1], signal.SIGCONT)
    values2 = values + 1
    arr2 = jax.make_array_from_callback(values.shape, sharding, lambda idx: values2[idx])
    acp.save(f"jaxstall://{tmp}/second", {"model": {"w": arr2}})  # a fresh key space, default bound
    target = {"model": {"w": jax.ShapeDtypeStruct(values.shape, values.dtype, sharding=sharding)}}
    out = acp.load(f"{tmp}/second", target)["model"]["w"]
    same = all(np.array_equal(np.asarray(s.data), values2[s.index]) for s in out.addressable_shards)
    return {"error": error, "same": same}


def test_stalled_jax_process_is_named_within_the_timeout(tmp_path):
    r0, r1 = run_jax(__file__, "body_stall", str(tmp_path), devices=2, processes=2, timeout=200)
    assert r0["error"] is not None and "rank 1" in r0["error"] and "liveness timeout is 3 s" in r0["error"], (
        r0
    )
    assert r1["error"] is not None and "stalled" in r1["error"], r1
    assert r0["same"] and r1["same"]
    assert not (tmp_path / "first").exists()
    assert (tmp_path / "warm").exists() and (tmp_path / "second").exists()


def body_kvstore(port):
    import jax
    from jax._src import distributed

    from arraycheckpoint.adapters.jax.communicator import _KvStore

    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{port}", num_processes=1, process_id=0)
    store = _KvStore(distributed.global_state.client)
    for r in range(0, 12, 2):  # every other rank has beaten
        store.set(f"live/s/hb/{r}", f"{r}:0.5")
    store.set("live/s/hb/4", "9:0.5")  # overwritten
    keys = [f"live/s/hb/{r}" for r in range(12)]
    many = store.multi_get(keys)  # rank 0's view: one directory read
    few = [store.multi_get([k])[0] for k in keys]  # the others' view: one read per key
    out = {
        "many": [v.decode() for v in many],
        "few": [v.decode() for v in few],
        "added": [store.add("live/s/rebuild/1", 1), store.add("live/s/rebuild/1", 0)],
        "check": [store.check(["live/s/hb/0"]), store.check(["live/s/abort/0"])],
    }
    jax.distributed.shutdown()
    return out


def test_kv_store_of_the_liveness_checks():
    from dist import free_port

    (out,) = run_jax(__file__, "body_kvstore", free_port(), devices=1)
    want = ["" if r % 2 else ("9:0.5" if r == 4 else f"{r}:0.5") for r in range(12)]
    assert out["many"] == want and out["few"] == want
    assert out["added"] == [1, 1] and out["check"] == [True, False]
