"""Packed arrays (formats 5 and 6) read by zarr-python, xarray and tensorstore: as one hierarchy through
``arraycheckpoint.zarr.checkpoint_store``, and plainly from the pack the metadata names.

A default save puts every small array one rank writes whole into a pack (an uncompressed ZIP file
``.acp/packs/<rank>.<k>.zip``); large arrays keep their own directories. The store must list and read both
kinds at their natural paths, bit-exactly; zarr-python's ``ZipStore`` and
tensorstore's ``zip`` key-value driver must read a packed array one rank wrote whole from its pack with
nothing of arraycheckpoint but the dtype registration; and the store must refuse hostile metadata and damaged packs rather than read them.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import CheckpointNotFoundError, CorruptCheckpointError, MetadataError
from arraycheckpoint.zarr import checkpoint_store

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def _bits(a: object) -> np.ndarray:
    a = np.ascontiguousarray(np.asarray(a))
    return a.view(UINT[a.dtype.itemsize]) if a.dtype.itemsize in UINT else a.view(np.uint8)


def _torch_bits(t: torch.Tensor) -> np.ndarray:
    return _bits(t.detach().contiguous().view(getattr(torch, f"uint{8 * t.element_size()}")).numpy())


def _same(got: object, want: torch.Tensor | np.ndarray, what: str) -> None:
    want_bits = _torch_bits(want) if isinstance(want, torch.Tensor) else _bits(want)
    got_bits = _bits(got)
    assert got_bits.shape == want_bits.shape, (what, got_bits.shape, want_bits.shape)
    assert np.array_equal(got_bits, want_bits), what


def _packs(ckpt: Path) -> dict[str, str]:
    """``name -> pack file`` from the metadata, read as plain JSON (format 6: the file of the named rank's
    packs holding the array's ``zarr.json``; one rank wrote each array here, so that pack holds all of it)."""
    from readers import _pack_holding

    tensors = json.loads((ckpt / ".acp" / "metadata.json").read_text())["tensors"]
    out = {}
    for n, t in tensors.items():
        pack = t.get("pack")
        if pack is not None:
            out[n] = pack if pack.endswith(".zip") else _pack_holding(str(ckpt), f"{n}/zarr.json")
    return out


def _get(store: object, key: str) -> bytes:
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    return sync(store.get(key, default_buffer_prototype())).to_bytes()  # type: ignore[attr-defined]


def _arrays(group: object) -> dict[str, object]:
    import zarr

    return {k: v for k, v in group.members(max_depth=None) if isinstance(v, zarr.Array)}  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A save of small (packed) and large (unpacked) tensors, bfloat16 and float8 among them."""
    gen = torch.Generator().manual_seed(7)

    def bits(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:  # any bit pattern: NaNs, -0.0
        raw = torch.randint(0, 256, (*shape, dtype.itemsize), generator=gen, dtype=torch.uint8)
        return raw.view(dtype).reshape(shape)

    model = {
        "embed.weight": torch.randn(1024, 768, generator=gen),  # 3 MiB: its own directory
        "head.weight": bits((1024, 1024), torch.bfloat16),  # 2 MiB + index: its own directory
        "layers.0.norm.weight": bits((768,), torch.bfloat16),
        "layers.0.attn.wq.weight": bits((64, 48), torch.bfloat16),
        "layers.0.attn.wq.bias": torch.randn(48, generator=gen),
        "layers.1.attn.wq.weight": bits((64, 48), torch.float8_e4m3fn),
        "layers.10.attn.wq.weight": bits((64, 48), torch.float8_e5m2),  # shares the prefix "layers.1"
        "scale": bits((), torch.bfloat16),
    }
    extra = {"ids": torch.arange(30, dtype=torch.int64).reshape(5, 6), "step": 3}
    ckpt = tmp_path_factory.mktemp("packed") / "ckpt"
    # a 1 MiB target: the two large arrays' chunk files are above it (their own directories), the rest packed
    acp.save(
        ckpt,
        {"model": model, "extra_state": extra},
        step=3,
        plan_options=acp.PlanOptions(min_chunk_bytes=1 << 20),
    )
    expected = {f"model/{k}": v for k, v in model.items()}
    expected["extra_state/ids"] = extra["ids"]
    packs = _packs(ckpt)
    assert {"model/embed.weight", "model/head.weight"}.isdisjoint(packs), packs
    assert set(expected) - {"model/embed.weight", "model/head.weight"} <= set(packs), packs
    return ckpt, expected


def test_store_lists_and_reads_every_tensor(mixed) -> None:
    import zarr

    ckpt, expected = mixed
    packs = _packs(ckpt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plain = _arrays(zarr.open_group(str(ckpt), mode="r"))
        assert set(plain) == set(expected) - set(packs) | {".acp"}, sorted(plain)  # what a plain walk sees
        store = checkpoint_store(ckpt)
        root = zarr.open_group(store, mode="r")
        arrays = _arrays(root)
        tree = str(root.tree())
    assert set(arrays) == set(expected) | {".acp"}, sorted(arrays)
    assert set(store.packed) == set(packs) and store.metadata.format_version >= 5
    for name, want in expected.items():
        assert name.rsplit("/", 1)[1] in tree, (name, tree)
        arr = arrays[name]
        assert tuple(arr.shape) == tuple(want.shape) and arr.metadata.dimension_names is not None, name
        _same(arr[...], want, f"store {name}")
        if want.ndim == 2:  # a partial read (inner chunks, ranged reads inside the pack)
            _same(arr[1:3, 2:5], want[1:3, 2:5], f"store {name}[1:3, 2:5]")
        assert arr.nchunks_initialized == arr.nchunks, name  # listing a prefix never counts a sibling's keys
    # the same bytes as the directory readers see, by key
    member = next(iter(packs))
    with zipfile.ZipFile(ckpt / packs[member]) as zf:
        assert _get(store, f"{member}/zarr.json") == zf.read(f"{member}/zarr.json")


def test_store_listing_methods(mixed) -> None:
    from zarr.core.sync import sync

    ckpt, expected = mixed
    store = checkpoint_store(ckpt)
    packs = _packs(ckpt)

    async def collect(gen):
        return [k async for k in gen]

    keys = sync(collect(store.list()))
    assert len(keys) == len(set(keys))
    for name in expected:
        assert f"{name}/zarr.json" in keys, name
    assert ".acp/zarr.json" in keys and ".acp/metadata.json" in keys
    name = "model/layers.1.attn.wq.weight"
    assert name in packs
    assert sorted(sync(collect(store.list_dir(name)))) == ["c.0.0", "zarr.json"]
    assert sorted(sync(collect(store.list_prefix(name)))) == [f"{name}/c.0.0", f"{name}/zarr.json"]
    assert "layers.10.attn.wq.weight" in sync(collect(store.list_dir("model")))
    below_model = sync(collect(store.list_prefix("model/")))
    assert set(below_model) == {k for k in keys if k.startswith("model/")}
    assert sync(store.exists(f"{name}/zarr.json")) and not sync(store.exists(f"{name}/c.9.9"))
    with zipfile.ZipFile(ckpt / packs[name]) as zf:
        info = zf.getinfo(f"{name}/c.0.0")
        assert sync(store.getsize(f"{name}/c.0.0")) == info.file_size
        assert _get(store, f"{name}/c.0.0") == zf.read(info)
    assert (
        sync(store.getsize("model/embed.weight/zarr.json"))
        == (ckpt / "model/embed.weight/zarr.json").stat().st_size
    )
    assert sync(store.get(f"{name}/nothing", None)) is None
    assert not store.supports_writes
    with pytest.raises(ValueError):
        sync(store.set(f"{name}/zarr.json", None))  # type: ignore[arg-type]


def test_plain_zipstore_fsspec_and_tensorstore_read_a_packed_tensor(mixed) -> None:
    import tensorstore as ts
    import zarr

    ckpt, expected = mixed
    packs = _packs(ckpt)
    for name in ("model/layers.0.attn.wq.weight", "model/scale", "extra_state/ids"):
        pack = str(ckpt / packs[name])
        with zarr.storage.ZipStore(pack, mode="r") as zstore:
            _same(zarr.open_array(zstore, path=name, mode="r")[...], expected[name], f"ZipStore {name}")
        spec = {
            "driver": "zarr3",
            "kvstore": {"driver": "zip", "base": f"file://{pack}", "path": f"{name}/"},
        }
        _same(ts.open(spec, open=True).result().read().result(), expected[name], f"tensorstore zip {name}")


def test_xarray_open_datatree_through_the_store(mixed) -> None:
    xr = pytest.importorskip("xarray", reason="xarray is not installed (the 'dev' extra lists it)")
    ckpt, expected = mixed
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tree = xr.open_datatree(checkpoint_store(ckpt), engine="zarr", consolidated=False)
    for name, want in expected.items():
        group, var = name.rsplit("/", 1)
        _same(tree[group].dataset[var].values, want, f"xarray {name}")


def test_other_zarr_stores_as_the_base(mixed) -> None:
    """Any zarr store of the checkpoint works as the base: fsspec's (ranged reads of the packs through
    ``FsspecStore.get``) and an in-memory copy."""
    import zarr
    from zarr.core.buffer import default_buffer_prototype

    ckpt, expected = mixed
    fs = zarr.storage.FsspecStore.from_url(f"file://{ckpt}", read_only=True)
    data = {}
    for dirpath, _, files in os.walk(ckpt):
        for f in files:
            key = os.path.relpath(os.path.join(dirpath, f), ckpt)
            data[key] = default_buffer_prototype().buffer.from_bytes(Path(dirpath, f).read_bytes())
    memory = zarr.storage.MemoryStore(data, read_only=True)
    for base in (fs, memory):
        arrays = _arrays(zarr.open_group(checkpoint_store(base), mode="r"))
        assert set(arrays) == set(expected) | {".acp"}, (base, sorted(arrays))
        for name, want in expected.items():
            _same(arrays[name][...], want, f"{base} {name}")


def test_group_documents_only_a_pack_holds(tmp_path: Path) -> None:
    """Format 5 (the fixture f62d3f0 wrote): a directory above packed arrays whose ``zarr.json`` the checkpoint
    lacks is served from the pack, which holds group documents (format-6 packs hold none: the save writes
    every group document as a file)."""
    import zarr

    ckpt = tmp_path / "ck"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "format5" / "single", ckpt)
    want = {n: np.asarray(a) for n, a in _arrays(zarr.open_group(checkpoint_store(ckpt), mode="r")).items()}
    (ckpt / "model" / "zarr.json").unlink()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arrays = _arrays(zarr.open_group(checkpoint_store(ckpt), mode="r"))
    assert set(arrays) == set(want)
    for key, value in want.items():
        _same(arrays[key][...], value, key)


def _save_small(root: Path) -> Path:
    acp.save(root, {"model": {"w": torch.randn(3, 4), "b": torch.randn(4)}})
    return root


def _rewrite_metadata(ckpt: Path, edit) -> None:
    path = ckpt / ".acp" / "metadata.json"
    doc = json.loads(path.read_text())
    edit(doc)
    path.write_text(json.dumps(doc))


@pytest.mark.parametrize(
    "pack",
    [
        "../../outside.zip",
        "/etc/passwd",
        ".acp/packs/7.0.zip",
        ".acp/packs/0.0.zip/../x.zip",
        ".acp/other.zip",
        3,
    ],
)
def test_hostile_pack_names_are_refused(tmp_path: Path, pack: object) -> None:
    ckpt = _save_small(tmp_path / "ck")
    _rewrite_metadata(ckpt, lambda doc: doc["tensors"]["model/w"].__setitem__("pack", pack))
    with pytest.raises(MetadataError, match="pack"):
        checkpoint_store(ckpt)


def test_uncommitted_checkpoint_is_refused(tmp_path: Path) -> None:
    ckpt = _save_small(tmp_path / "ck")
    (ckpt / ".acp" / "committed").unlink()
    with pytest.raises(CheckpointNotFoundError):
        checkpoint_store(ckpt)


def _read_all(ckpt: Path) -> None:
    import zarr

    for arr in _arrays(zarr.open_group(checkpoint_store(ckpt), mode="r")).values():
        arr[...]


def test_compressed_pack_member_is_refused(tmp_path: Path) -> None:
    ckpt = _save_small(tmp_path / "ck")
    (pack,) = set(_packs(ckpt).values())
    with zipfile.ZipFile(ckpt / pack) as zf:
        members = [(i.filename, zf.read(i)) for i in zf.infolist()]
    with zipfile.ZipFile(ckpt / pack, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data in members:
            zf.writestr(name, data)
    with pytest.raises(CorruptCheckpointError, match="compressed"):
        _read_all(ckpt)


def test_symlinked_pack_is_refused(tmp_path: Path) -> None:
    ckpt = _save_small(tmp_path / "ck")
    (pack,) = set(_packs(ckpt).values())
    elsewhere = tmp_path / "elsewhere.zip"
    shutil.move(ckpt / pack, elsewhere)
    os.symlink(elsewhere, ckpt / pack)
    with pytest.raises(CorruptCheckpointError, match="link"):
        _read_all(ckpt)


def test_truncated_or_missing_pack_is_refused(tmp_path: Path) -> None:
    ckpt = _save_small(tmp_path / "ck")
    (pack,) = set(_packs(ckpt).values())
    data = (ckpt / pack).read_bytes()
    (ckpt / pack).write_bytes(data[: len(data) // 2])
    with pytest.raises(CorruptCheckpointError, match="ZIP"):
        _read_all(ckpt)
    (ckpt / pack).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing"):
        _read_all(ckpt)


def test_a_large_central_directory(tmp_path: Path) -> None:
    """A pack whose directory is larger than the first (tail) read is listed with one more ranged read."""
    import zarr

    from arraycheckpoint.interop.zarrpacks import TAIL_BYTES

    state = {
        f"block_{i:04d}.with.a.rather.long.parameter.name.weight": torch.full((2,), float(i))
        for i in range(600)
    }
    ckpt = tmp_path / "ck"
    acp.save(ckpt, {"model": state})
    packs = _packs(ckpt)
    assert len(set(packs.values())) == 1
    with zipfile.ZipFile(ckpt / next(iter(packs.values()))) as zf:
        directory = sum(46 + len(i.filename) + len(i.extra) for i in zf.infolist())
    assert directory > TAIL_BYTES
    arrays = _arrays(zarr.open_group(checkpoint_store(ckpt), mode="r"))
    assert len(arrays) == len(state) + 1
    for key, want in state.items():
        _same(arrays[f"model/{key}"][...], want, key)


# Two processes ----------------------------------------------------------------------------------------------
def _two_rank_save(rank: int, world: int, path: str) -> dict[str, np.ndarray]:
    torch.manual_seed(11)  # the same replicated model on every rank: owners spread its arrays over both
    # (two equal large arrays, one per rank, then the small ones by worst fit)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(16, 16) for _ in range(8)],
        torch.nn.Linear(16, 1 << 16),
        torch.nn.Linear(1 << 16, 16),
    )
    model[3].to(torch.bfloat16)
    acp.save(
        path, {"model": model}, plan_options=acp.PlanOptions(min_chunk_bytes=1 << 20)
    )  # 4 MiB: own files
    return {f"model/{k}": _torch_bits(v) for k, v in model.state_dict().items()}


def test_two_process_checkpoint_is_fully_visible(tmp_path: Path) -> None:
    import zarr
    from dist import run_distributed

    ckpt = tmp_path / "ck"
    expected = run_distributed(_two_rank_save, world=2, args=(str(ckpt),))[0]
    packs = _packs(ckpt)
    ranks = {Path(p).name.split(".")[0] for p in packs.values()}
    assert ranks == {"0", "1"}, sorted(set(packs.values()))
    assert set(expected) - set(packs), "the large arrays keep their own directories"
    store = checkpoint_store(ckpt)
    assert store.metadata.world_size == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        arrays = _arrays(zarr.open_group(store, mode="r"))
    assert set(arrays) == set(expected) | {".acp"}, sorted(arrays)
    for name, want in expected.items():
        _same(arrays[name][...], want, name)
