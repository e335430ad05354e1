"""Train a tiny PyTorch model, checkpoint it, and load the checkpoint into sharded JAX arrays.

The checkpoint is plain Zarr v3 with torch FQNs as names (``model/0.weight``). JAX loads it twice:

1. into a pytree with the same names (``{"model": {"0": {"weight": ...}}}``), sharded over an 8-device mesh;
2. into flax-style parameters (``params/dense0.kernel`` as ``[in, out]``) through ``key_map`` and a transpose
   ``transforms`` hook, in bfloat16 (``allow_cast=True``).

Run: ``python examples/torch_to_jax.py [checkpoint_dir]``
"""

from __future__ import annotations

import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before jax is imported
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import numpy as np  # noqa: E402
import torch  # noqa: E402

import arraycheckpoint as acp  # noqa: E402


def train_torch(path: str) -> torch.nn.Module:
    """A few SGD steps of a 2-layer MLP on random data, then a checkpoint."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    x, y = torch.randn(256, 16), torch.randn(256, 8)
    for _ in range(20):
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    acp.save(path, {"model": model, "optimizer": opt}, step=20)
    return model


def main() -> None:
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(tempfile.mkdtemp(), "torch_ckpt")
    model = train_torch(path)
    ref = {k: v.detach().numpy() for k, v in model.state_dict().items()}

    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from arraycheckpoint import load_jax

    mesh = jax.make_mesh((2, 4), ("data", "model"))

    # 1. the same names as torch, each tensor sharded over the mesh
    specs = {"0.weight": P("model", None), "0.bias": P("model"), "2.weight": P(None, "model"), "2.bias": P()}

    def abstract(fqn: str) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(ref[fqn].shape, np.float32, sharding=NamedSharding(mesh, specs[fqn]))

    target = {
        "model": {layer: {p: abstract(f"{layer}.{p}") for p in ("weight", "bias")} for layer in ("0", "2")}
    }
    loaded = acp.load(path, target)["model"]
    for fqn, want in ref.items():
        layer, p = fqn.split(".")
        got = loaded[layer][p]
        same = np.array_equal(np.asarray(got), want)
        print(f"model/{fqn:<9} {str(got.shape):<9} {str(got.sharding.spec):<22} bit-exact: {same}")
        assert same

    # 2. flax-style names and layouts: Dense.kernel is [in, out] where torch Linear.weight is [out, in]
    flax_target = {
        "params": {
            f"dense{i}": {
                "kernel": jax.ShapeDtypeStruct(
                    ref[f"{t}.weight"].T.shape, jnp.bfloat16, sharding=NamedSharding(mesh, P(None, "model"))
                ),
                "bias": jax.ShapeDtypeStruct(
                    ref[f"{t}.bias"].shape, jnp.bfloat16, sharding=NamedSharding(mesh, P())
                ),
            }
            for i, t in ((0, "0"), (1, "2"))
        }
    }
    key_map = {
        f"params/dense{i}.{k}": f"model/{t}.{w}"
        for i, t in ((0, "0"), (1, "2"))
        for k, w in (("kernel", "weight"), ("bias", "bias"))
    }
    transforms = {"params/dense0.kernel": np.transpose, "params/dense1.kernel": np.transpose}
    params = load_jax(path, flax_target, key_map=key_map, transforms=transforms, allow_cast=True)["params"]

    def forward(p, x):
        h = jax.nn.relu(x @ p["dense0"]["kernel"] + p["dense0"]["bias"])
        return h @ p["dense1"]["kernel"] + p["dense1"]["bias"]

    x = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    jax_out = np.asarray(forward(params, jnp.asarray(x, jnp.bfloat16)).astype(jnp.float32))
    torch_out = model(torch.from_numpy(x)).detach().numpy()
    kernel_ok = np.array_equal(np.asarray(params["dense0"]["kernel"]), ref["0.weight"].T.astype(jnp.bfloat16))
    print(
        f"flax-style dense0.kernel {params['dense0']['kernel'].shape} bfloat16 == torch weight.T: {kernel_ok}"
    )
    print(f"max |jax(bf16) - torch(fp32)| on a batch: {np.abs(jax_out - torch_out).max():.4f}")
    assert kernel_ok


if __name__ == "__main__":
    main()
