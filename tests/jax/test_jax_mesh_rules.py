"""JAX ``NamedSharding`` declared as a mesh rule over processes (2 processes x 4 CPU devices).

Each process states the rule (device mesh -> owning process, partition spec), never its shard boxes, so
both processes declare the same thing: one digest, no planning collective, one rule per tensor in the
metadata. Specs cover one and both mesh axes, a dimension split over two axes in and against mesh order,
a replicated array and a transposed mesh. The checkpoint loads bit-exactly in one process with 8 devices.
"""

from __future__ import annotations

from jaxrun import run_jax

SPECS = {
    "ab": (("a", "b"), (32, 16)),
    "rep": ((), (8, 8)),
    "b_only": (("b", None), (16, 4)),
    "ba_joint": ((("b", "a"), None), (24, 3)),  # against mesh order: the rule mesh is transposed
    "ab_joint": ((None, ("a", "b")), (2, 16)),
    "a_cols": ((None, "a"), (5, 6)),
}


def _values():
    import numpy as np

    rng = np.random.default_rng(3)
    return {k: rng.standard_normal(shape).astype(np.float32) for k, (_s, shape) in SPECS.items()}


def body_save(tmp):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp
    from arraycheckpoint.adapters.jax.arrays import save_tensor
    from arraycheckpoint.engine import engine
    from arraycheckpoint.engine.coordinate import declare
    from arraycheckpoint.planning.rules import digest

    assert jax.process_count() == 2 and jax.local_device_count() == 4
    mesh = jax.make_mesh((2, 4), ("a", "b"))  # "a" spans the processes
    vals = _values()
    arrs = {
        k: jax.make_array_from_callback(v.shape, NS(mesh, P(*SPECS[k][0])), lambda idx, v=v: v[idx])
        for k, v in vals.items()
    }
    decl = declare([save_tensor(f"model/{k}", a) for k, a in arrs.items()], jax.process_index())
    small = acp.PlanOptions(min_chunk_bytes=64, max_chunk_bytes=256, inner_chunk_bytes=64)
    acp.save(f"{tmp}/ck", {"model": arrs}, plan_options=small)
    meta = acp.read_metadata(f"{tmp}/ck")
    return {
        "digest": digest(decl.to_json()).hex(),
        "kinds": {t.name: t.rule[0] for t in decl.tensors},
        "meshes": decl.to_json()["meshes"],
        "mode": engine()._save._last_mode,
        "groups": len(meta.layout_groups),
        "regions": {n: [r[1][0] for r in t.regions] for n, t in meta.tensors.items()},
        "shards": {n: len(t.shards) for n, t in meta.tensors.items()},
        "writers": sorted({w for t in meta.tensors.values() for w in t.writers}),
        "equal": all(
            np.array_equal(np.asarray(s.data), vals[k][s.index])
            for k, a in arrs.items()
            for s in a.addressable_shards
        ),
    }


def body_load(tmp):
    import jax
    import numpy as np
    from jax.sharding import NamedSharding as NS
    from jax.sharding import PartitionSpec as P

    import arraycheckpoint as acp

    mesh = jax.make_mesh((8,), ("x",))
    vals = _values()
    target = {
        "model": {k: jax.ShapeDtypeStruct(v.shape, v.dtype, sharding=NS(mesh, P())) for k, v in vals.items()}
    }
    out = acp.load(f"{tmp}/ck", target)["model"]
    return {k: bool(np.array_equal(np.asarray(out[k]), v)) for k, v in vals.items()}


def test_named_shardings_are_one_declaration_of_mesh_rules(tmp_path):
    results = run_jax(__file__, "body_save", str(tmp_path), devices=8, processes=2)
    assert len({r["digest"] for r in results}) == 1, "processes declared differently"
    r = results[0]
    assert set(r["kinds"].values()) == {"mesh"}, r["kinds"]
    # the device -> process map travels compactly (no per-device list)
    assert all(m[1][0] in ("affine", "arange") for m in r["meshes"]), r["meshes"]
    assert {x["mode"] for x in results} == {"local"}
    assert r["groups"] == 1 and all(kinds == ["mesh"] for kinds in r["regions"].values())
    assert r["shards"]["model/ab"] == 8 and r["shards"]["model/rep"] == 1
    assert r["writers"] == [0, 1] and all(x["equal"] for x in results)
    assert run_jax(__file__, "body_load", str(tmp_path)) == [{k: True for k in SPECS}]
