"""Checkpoints opened by plain readers: zarr-python (with ``import arraycheckpoint.zarr``), xarray and dask.

Every reader runs in a fresh interpreter that imports neither torch nor jax; the expected values travel as
raw bits in ``.npy`` files written by the test process, and every comparison is bit-exact. Each test runs on
a default save, whose small arrays are packed (format 5: ZIP files under ``.acp/packs/``, read through
``arraycheckpoint.zarr.checkpoint_store`` as one hierarchy, and plainly through ``zarr.storage.ZipStore`` on
the pack the metadata names), and on a save with ``PlanOptions(pack_array_bytes=0)``, every array in its own
directory, which plain paths open as before.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

import arraycheckpoint as acp

DTYPES = [
    torch.bool,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.uint8,
    torch.float16,
    torch.float32,
    torch.float64,
    torch.complex64,
    torch.bfloat16,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz,
]
UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64, 16: np.uint64}


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    bits = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
    return bits.view(dtype).reshape(shape)


def _bits(t: torch.Tensor) -> np.ndarray:
    """Raw bits of ``t`` as unsigned integers (complex64: two uint32 per element)."""
    if t.dtype == torch.bool:
        return t.numpy().astype(np.uint8)
    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
    size = t.dtype.itemsize if t.dtype != torch.complex64 else 4
    shape = tuple(t.shape) + ((2,) if t.dtype == torch.complex64 else ())
    return raw.view(UINT[size]).reshape(shape)


def run_fresh(cwd: Path, body: str, *args: str) -> str:
    """Run ``body`` in a new interpreter outside the repo; assert it imported neither torch nor jax."""
    code = textwrap.dedent(body) + textwrap.dedent(
        """
        assert "torch" not in sys.modules and "jax" not in sys.modules, "a reader pulled in a framework"
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], cwd=cwd, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, f"fresh reader process failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


LAYOUTS = pytest.mark.parametrize("pack_array_bytes", [None, 0], ids=["packs", "directories"])

#: Plain readers of one stored array in a fresh process: the metadata (plain JSON) names its pack, if any.
PLAIN_OPEN = """
import json, os
import zarr

def packs_of(ckpt):
    # name -> the pack file holding its zarr.json (format 6: one of the files <rank>.<k>.zip of the rank the
    # metadata names; one rank wrote each array here, so that pack holds all of it)
    import zipfile

    with open(os.path.join(ckpt, ".acp", "metadata.json")) as f:
        tensors = json.load(f)["tensors"]
    where = {}
    packs = os.path.join(ckpt, ".acp", "packs")
    for leaf in sorted(os.listdir(packs)) if os.path.isdir(packs) else []:
        for member in zipfile.ZipFile(os.path.join(packs, leaf)).namelist():
            where[member] = os.path.join(".acp", "packs", leaf)
    return {n: where[n + "/zarr.json"] for n, t in tensors.items() if t.get("pack") is not None}

def open_plain(ckpt, packs, name):
    if name in packs:
        return zarr.open_array(zarr.storage.ZipStore(os.path.join(ckpt, packs[name]), mode="r"), path=name, mode="r")
    return zarr.open_array(os.path.join(ckpt, name), mode="r")
"""


def _options(pack_array_bytes: int | None) -> acp.PlanOptions:
    return (
        acp.PlanOptions() if pack_array_bytes is None else acp.PlanOptions(pack_array_bytes=pack_array_bytes)
    )


@LAYOUTS
def test_import_arraycheckpoint_zarr_lists_and_reads_every_dtype(tmp_path: Path, pack_array_bytes) -> None:
    gen = torch.Generator().manual_seed(0)
    model = {}
    for i, dtype in enumerate(DTYPES):
        name = str(dtype).removeprefix("torch.")
        model[f"layers.{i}.{name}"] = _random((6, 10), dtype, gen)
    model["scalar.bf16"] = _random((), torch.bfloat16, gen)
    ckpt = tmp_path / "ckpt"
    acp.save(ckpt, {"model": model}, plan_options=_options(pack_array_bytes))
    expected = {}
    for key, t in model.items():
        f = tmp_path / f"{key}.npy"
        np.save(f, _bits(t), allow_pickle=False)
        expected[f"model/{key}"] = str(f)
    (tmp_path / "expected.json").write_text(json.dumps(expected))

    out = run_fresh(
        tmp_path,
        PLAIN_OPEN
        + textwrap.dedent(
            """
        import json, sys
        import numpy as np
        import zarr
        import arraycheckpoint.zarr  # the registration under test
        from arraycheckpoint.zarr import checkpoint_store
        UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
        ckpt = sys.argv[1]
        expected = json.load(open(sys.argv[2]))
        packs = packs_of(ckpt)

        def same(arr, name):
            assert arr.ndim == 0 or arr.metadata.dimension_names is not None, name
            got = np.array(arr[...], order="C", copy=True)
            want = np.load(expected[name], allow_pickle=False)
            if got.dtype == np.bool_:
                bits = got.astype(np.uint8)
            elif got.dtype.kind == "c":
                bits = got.reshape(-1).view(np.uint32).reshape(got.shape + (2,))
            else:
                bits = got.reshape(-1).view(UINT[got.dtype.itemsize]).reshape(got.shape)
            assert bits.shape == want.shape and np.array_equal(bits, want), name

        # the whole checkpoint as one hierarchy; a plain walk of the directory too when nothing is packed
        roots = [zarr.open_group(checkpoint_store(ckpt), mode="r")]
        if not packs:
            roots.append(zarr.open_group(ckpt, mode="r"))
        for root in roots:
            tree = str(root.tree())
            members = dict(root["model"].members())
            assert len(members) == len(expected), sorted(members)
            for name in expected:
                assert name.split("/", 1)[1] in tree, (name, tree)
                same(root[name], name)
        for name in expected:  # each array alone: its directory, or ZipStore on its pack
            same(open_plain(ckpt, packs, name), name)
        print("OK", len(expected), len(members), len(packs))
        """
        ),
        str(tmp_path / "ckpt"),
        str(tmp_path / "expected.json"),
    )
    packed = len(model) if pack_array_bytes is None else 0
    assert f"OK {len(model)} {len(model)} {packed}" in out, out


def test_import_arraycheckpoint_zarr_is_light() -> None:
    """The registration module imports zarr, numpy and ml_dtypes only: no torch, jax or tensorstore."""
    code = textwrap.dedent(
        """
        import sys
        import arraycheckpoint.zarr
        from zarr.core.dtype import data_type_registry
        assert data_type_registry.get("bfloat16") is not None
        heavy = [m for m in ("torch", "jax", "tensorstore") if m in sys.modules]
        assert not heavy, heavy
        print("LIGHT")
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "LIGHT" in proc.stdout, proc.stderr


@pytest.fixture(params=[None, 0], ids=["packs", "directories"])
def float32_ckpt(tmp_path: Path, request) -> tuple[Path, dict[str, np.ndarray]]:
    """A float32 model + Adam checkpoint and every stored tensor (name -> numpy), after one step; saved with
    the default packs, or (``directories``) every array in its own directory."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.ReLU(), torch.nn.Linear(6, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    ckpt = tmp_path / "ckpt"
    acp.save(ckpt, {"model": model, "optimizer": opt}, plan_options=_options(request.param))
    assert bool(_packed(ckpt)) == (request.param is None)
    arrays = {f"model/{k}": v.detach().numpy().copy() for k, v in model.state_dict().items()}
    names = [n for n, _ in model.named_parameters()]
    for p, state in opt.state.items():
        fqn = names[[id(q) for q in model.parameters()].index(id(p))]
        for k, v in state.items():
            arrays[f"optimizer/{fqn}/{k}"] = v.numpy().copy()
    return ckpt, arrays


def _array_doc(ckpt: Path, name: str) -> dict:
    """The stored ``zarr.json`` of the array ``name``: in its directory, or in the pack the metadata names."""
    import zipfile

    pack = json.loads((ckpt / ".acp" / "metadata.json").read_text())["tensors"][name].get("pack")
    if pack is None:
        return json.loads((ckpt / name / "zarr.json").read_text())
    if not pack.endswith(".zip"):  # format 6: the pack of the named rank holding it
        from readers import _pack_holding

        pack = _pack_holding(str(ckpt), f"{name}/zarr.json")
    with zipfile.ZipFile(ckpt / pack) as zf:
        return json.loads(zf.read(f"{name}/zarr.json"))


def test_every_array_has_unique_dimension_names(float32_ckpt) -> None:
    ckpt, arrays = float32_ckpt
    seen: dict[str, set[str]] = {}
    for name in arrays:
        meta = _array_doc(ckpt, name)
        dims = meta.get("dimension_names", [])  # tensorstore leaves the empty list out for 0-d
        assert len(dims) == len(meta["shape"]) and len(set(dims)) == len(dims), (name, dims)
        group = name.rsplit("/", 1)[0]
        assert not seen.setdefault(group, set()) & set(dims), (name, dims)
        seen[group] |= set(dims)


def test_xarray_and_dask_read_a_float32_checkpoint(float32_ckpt, tmp_path: Path) -> None:
    ckpt, arrays = float32_ckpt
    manifest = {}
    for name, a in arrays.items():
        f = tmp_path / f"{name.replace('/', '__')}.npy"
        np.save(f, a, allow_pickle=False)
        manifest[name] = str(f)
    (tmp_path / "manifest.json").write_text(json.dumps(manifest))
    out = run_fresh(
        tmp_path,
        PLAIN_OPEN
        + textwrap.dedent(
            """
        import json, sys
        import numpy as np
        import dask.array as da
        import xarray as xr
        import zarr
        from arraycheckpoint.zarr import checkpoint_store
        ckpt, expected = sys.argv[1], json.load(open(sys.argv[2]))
        packs = packs_of(ckpt)

        def same(got, name):
            want = np.load(expected[name], allow_pickle=False)
            got = np.asarray(got)
            assert got.dtype == want.dtype and got.shape == want.shape, (name, got.dtype, got.shape)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), name

        # the one-hierarchy store always; the plain directory paths too when nothing is packed
        store = checkpoint_store(ckpt)
        sources = [(store, {"store": store}, lambda name: zarr.open_array(store, path=name, mode="r"))]
        if not packs:
            sources.append((ckpt, {"store": ckpt + "/model"}, lambda name: ckpt + "/" + name))
        model = [n for n in expected if n.startswith("model/")]
        for where, model_group, array in sources:
            tree = xr.open_datatree(where, engine="zarr", consolidated=False)
            for name in expected:
                group, var = name.rsplit("/", 1)
                same(tree[group].dataset[var].values, name)
            kwargs = {"group": "model"} if where is store else {}
            ds = xr.open_zarr(model_group["store"], consolidated=False, **kwargs)
            assert sorted(ds.data_vars) == sorted(n.split("/", 1)[1] for n in model)
            for name in model:
                same(ds[name.split("/", 1)[1]].values, name)
            for name in expected:
                same(da.from_zarr(array(name)).compute(), name)
        for name in packs:  # dask on a plain ZipStore of the pack
            same(da.from_zarr(open_plain(ckpt, packs, name)).compute(), name)
        print("READERS-OK", len(expected), len(sources), len(packs))
        """
        ),
        str(ckpt),
        str(tmp_path / "manifest.json"),
    )
    packed = len(_packed(ckpt))
    layouts = 1 if packed else 2
    assert f"READERS-OK {len(arrays)} {layouts} {packed}" in out, out


def _packed(ckpt: Path) -> set[str]:
    tensors = json.loads((ckpt / ".acp" / "metadata.json").read_text())["tensors"]
    return {name for name, t in tensors.items() if t.get("pack") is not None}
