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
