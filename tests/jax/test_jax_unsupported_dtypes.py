"""A JAX dtype the format lacks (int4, float4_e2m1fn) is refused naming the array, on save before anything is
written and for a load target (session 20 review: the message named only the dtype, raised deep in the save's
coordination)."""

from __future__ import annotations

import os

from jaxrun import run_jax


def body_int4(tmp):
    import jax
    import jax.numpy as jnp

    import arraycheckpoint as acp

    out = {}
    path = os.path.join(tmp, "c")
    try:
        acp.save(path, {"params": {"q": jnp.zeros((4,), jnp.int4), "w": jnp.ones(2)}})
    except acp.UnsupportedDTypeError as e:
        out["save"] = str(e)
    out["written"] = os.path.exists(path)
    acp.save(path, {"params": {"q": jnp.zeros((4,), jnp.int8), "w": jnp.ones(2)}})
    target = {
        "params": {"q": jax.ShapeDtypeStruct((4,), jnp.int4), "w": jax.ShapeDtypeStruct((2,), jnp.float32)}
    }
    try:
        acp.load(path, target)
    except acp.UnsupportedDTypeError as e:
        out["load"] = str(e)
    return out


def test_int4_is_refused_naming_the_array(tmp_path):
    (out,) = run_jax(__file__, "body_int4", str(tmp_path), devices=1)
    assert out["save"].startswith("params/q: ") and "int4" in out["save"], out
    assert out["written"] is False
    assert out["load"].startswith("params/q (the load target): ") and "int4" in out["load"], out
