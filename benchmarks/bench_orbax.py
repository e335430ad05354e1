"""arraycheckpoint vs Orbax (``StandardCheckpointer``, default options) on one sharded JAX pytree.

Both checkpointers save the same ~500 MiB pytree of float32 arrays laid out FSDP-style on an 8-device CPU mesh,
restore it into the same sharding, and restore it into another sharding (2-D mesh, other axes). Each
operation runs ``--repeats`` times alternating the two libraries (fresh directories, warm page cache for
both, ``os.sync()`` before every timed operation so that neither pays for the write-back of the other's
dirty pages); the table shows the median seconds and the ratio ``orbax / ours`` (> 1: we are faster). Restores are
checked bit-exact against the saved values, for both libraries.

Run::

    python benchmarks/bench_orbax.py [--mib 500] [--repeats 3] [--dir /tmp/acp-bench]
"""

from __future__ import annotations

import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import argparse  # noqa: E402
import shutil  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from typing import Any  # noqa: E402

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402


def build_tree(mib: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """A transformer-like pytree of about ``mib`` MiB: embedding plus layers of attention/MLP matrices."""
    d = 1024
    per_layer = (4 * d * d + 2 * d * 4 * d + 2 * d) * 4
    embed_rows = 16384
    layers = max(1, (mib * 2**20 - embed_rows * d * 4) // per_layer)
    mesh = jax.make_mesh((8,), ("x",))
    fsdp = NamedSharding(mesh, P("x"))
    rep = NamedSharding(mesh, P())
    rng = np.random.default_rng(0)

    def arr(shape: tuple[int, ...], sharding: NamedSharding) -> jax.Array:
        host = rng.standard_normal(shape, dtype=np.float32)
        return jax.device_put(host, sharding)

    tree = {
        "params": {
            "embed": arr((embed_rows, d), fsdp),
            "layers": [
                {
                    "attn": {k: arr((d, d), fsdp) for k in ("wq", "wk", "wv", "wo")},
                    "mlp": {"w_in": arr((d, 4 * d), fsdp), "w_out": arr((4 * d, d), fsdp)},
                    "norm": {"scale": arr((d,), rep), "bias": arr((d,), rep)},
                }
                for _ in range(int(layers))
            ],
        }
    }
    mesh2 = jax.make_mesh((2, 4), ("a", "b"))

    def other(x: jax.Array) -> jax.ShapeDtypeStruct:
        spec = P("b", "a") if x.ndim == 2 else P("b")
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh2, spec))

    return tree, jax.tree.map(other, tree)


def abstract(tree: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)


def nbytes(tree: Any) -> int:
    return sum(x.nbytes for x in jax.tree.leaves(tree))


def check(restored: Any, tree: Any, target: Any, who: str) -> None:
    for got, want, t in zip(jax.tree.leaves(restored), jax.tree.leaves(tree), jax.tree.leaves(target)):
        if got.sharding != t.sharding or not np.array_equal(np.asarray(got), np.asarray(want)):
            raise SystemExit(f"{who}: restored values or sharding differ")


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn()
    jax.block_until_ready(jax.tree.leaves(out) if out is not None else [])
    return time.perf_counter() - t0, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--verbose", action="store_true", help="print every timing")
    ap.add_argument("--dir", default=None, help="scratch directory (default: a temporary one)")
    args = ap.parse_args()

    import orbax.checkpoint as ocp

    import arraycheckpoint as acp

    tree, resharded = build_tree(args.mib)
    same = abstract(tree)
    size = nbytes(tree)
    root = args.dir or tempfile.mkdtemp(prefix="acp-bench-")
    os.makedirs(root, exist_ok=True)
    orbax = ocp.StandardCheckpointer()

    def orbax_save(path: str) -> None:
        orbax.save(path, tree)
        orbax.wait_until_finished()

    ops: dict[str, dict[str, Callable[[str], Any]]] = {
        "save": {"ours": lambda p: phases.append(acp.save(p, tree).metrics), "orbax": orbax_save},
        "restore (same sharding)": {
            "ours": lambda p: acp.load(p, same),
            "orbax": lambda p: orbax.restore(p, same),
        },
        "restore (other sharding)": {
            "ours": lambda p: acp.load(p, resharded),
            "orbax": lambda p: orbax.restore(p, resharded),
        },
    }
    phases: list[Any] = []
    times: dict[str, dict[str, list[float]]] = {op: {"ours": [], "orbax": []} for op in ops}
    for r in range(args.repeats):
        paths = {lib: os.path.join(root, f"{lib}-{r}") for lib in ("ours", "orbax")}
        order = ("ours", "orbax") if r % 2 == 0 else ("orbax", "ours")
        for op, fns in ops.items():
            for lib in order:
                os.sync()  # neither library pays for the other's dirty pages being written back
                dt, out = timed(lambda fn=fns[lib], path=paths[lib]: fn(path))
                times[op][lib].append(dt)
                if args.verbose:
                    extra = ""
                    if op == "save" and lib == "ours":
                        ph = phases[-1]["save"]["0"]["phases"]
                        extra = " ".join(f"{p['phase']}={p['seconds']:.2f}" for p in ph)
                    print(f"  repeat {r} {op:<26} {lib:<6} {dt:6.2f} s {extra}", flush=True)
                if op != "save":
                    check(out, tree, same if "same" in op else resharded, f"{lib} {op}")
                    del out
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)

    print(
        f"pytree: {size / 2**20:.0f} MiB in {len(jax.tree.leaves(tree))} arrays, {jax.device_count()} CPU devices, "
        f"{os.cpu_count()} cores, median of {args.repeats}"
    )
    print(f"{'operation':<26}{'ours (s)':>10}{'orbax (s)':>11}{'ours GiB/s':>12}{'speedup':>9}")
    for op in ops:
        ours = statistics.median(times[op]["ours"])
        theirs = statistics.median(times[op]["orbax"])
        print(f"{op:<26}{ours:>10.2f}{theirs:>11.2f}{size / 2**30 / ours:>12.2f}{theirs / ours:>8.2f}x")
    if not args.dir:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
