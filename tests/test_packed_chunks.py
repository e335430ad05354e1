"""Format 6: chunk files below the target size lie in their writers' packs, one array over several ranks' packs.

An FSDP2 model is saved by 3 gloo ranks with a target file size far above its chunks (every chunk file is
packed, none has its own file); its arrays' chunks lie in the packs of every rank that wrote them. The
checkpoint loads bit-exactly at 2 and 4 ranks and in one process, zarr-python reads every tensor through
``checkpoint_store``, tensorstore reads a packed chunk by the route ``docs/format.md`` gives, ``verify`` finds a
flipped byte inside a packed chunk and names the tensor, and ``checkpoint_store`` refuses links and FIFOs.
"""

from __future__ import annotations

import json
import os
import shutil
import zipfile

import numpy as np
import pytest
import torch
from safetensors.numpy import load_file, save_file

import arraycheckpoint as acp
from arraycheckpoint.cli import main as cli
from arraycheckpoint.errors import CorruptCheckpointError
from arraycheckpoint.format.metadata import FORMAT_VERSION
from arraycheckpoint.planning.plan import PlanOptions

#: chunks of at most 1 KiB, packs of about 64 KiB: every chunk file goes into its writer's packs
OPTIONS = PlanOptions(min_chunk_bytes=64 << 10, max_chunk_bytes=1 << 10, inner_chunk_bytes=512)


def _model() -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(33, 47), torch.nn.Linear(47, 9))


def _trained(rank: int, world: int, seed: int = 0):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    model = _model()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=0.02)
    torch.manual_seed(100 + rank + seed)
    model(torch.randn(4, 33)).sum().backward()
    opt.step()
    return model, opt


def _full(model, opt) -> dict[str, np.ndarray]:
    from fixtures.make_format2 import full_state

    return full_state(model, opt)


def _save_body(rank, world, path, expected):
    model, opt = _trained(rank, world)
    acp.save(path, {"model": model, "optimizer": opt}, plan_options=OPTIONS)
    full = _full(model, opt)
    if rank == 0:
        save_file(full, expected)
    return True


def _load_body(rank, world, path, expected):
    model, opt = _trained(rank, world, seed=50)  # other values, optimizer state present
    acp.load(path, {"model": model, "optimizer": opt})
    got, want = _full(model, opt), load_file(expected)
    assert sorted(got) == sorted(want)
    return all(np.array_equal(got[k], want[k]) for k in want)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    from dist import run_distributed

    root = tmp_path_factory.mktemp("packed_chunks")
    path, expected = str(root / "ckpt"), str(root / "expected.safetensors")
    assert run_distributed(_save_body, world=3, args=(path, expected)) == [True] * 3
    return path, expected


def _copy(saved, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(saved[0], dst)
    return dst


def _members(path) -> dict[str, tuple[str, zipfile.ZipInfo]]:
    """Every member of every pack: ``member -> (pack file, its ZIP entry)``."""
    out = {}
    packs = os.path.join(path, ".acp", "packs")
    for f in sorted(os.listdir(packs)):
        with zipfile.ZipFile(os.path.join(packs, f)) as zf:
            for info in zf.infolist():
                assert info.filename not in out, info.filename
                out[info.filename] = (os.path.join(packs, f), info)
    return out


def test_every_chunk_file_is_in_its_writers_packs(saved) -> None:
    path = saved[0]
    meta = acp.read_metadata(path)
    with open(os.path.join(path, ".acp", "metadata.json")) as f:
        doc = json.load(f)
    assert doc["format_version"] == FORMAT_VERSION
    # sharded arrays' writers are derived from their regions (format 7), replicated ones listed; the
    # derived ones must name the rank whose packs hold each chunk (checked below for every chunk)
    held = {n for n, t in doc["tensors"].items() if t["writers"] == "held"}
    assert held and len(held) < len(doc["tensors"]), held
    members = _members(path)
    spread = 0
    for name, t in meta.tensors.items():
        assert t.pack == f".acp/packs/{t.pack_rank}@{OPTIONS.min_chunk_bytes}", name
        assert f"{name}/zarr.json" in members and os.path.basename(
            members[f"{name}/zarr.json"][0]
        ).startswith(f"{t.pack_rank}.")
        assert not os.path.exists(os.path.join(path, name, "zarr.json")), name  # no file of its own
        grid = [-(-s // c) for s, c in zip(t.shape, t.chunk_shape)]
        for flat, idx in enumerate(np.ndindex(*grid)):
            pack, _info = members[f"{name}/" + ".".join(["c", *map(str, idx)])]
            assert os.path.basename(pack).startswith(f"{t.writers[flat]}."), (name, idx)
        spread += len(set(t.writers)) > 1
    assert spread >= 4  # arrays whose chunks lie in several ranks' packs
    # nothing else than packs and group documents: the file count is bounded by the packs
    files = [os.path.relpath(os.path.join(d, f), path) for d, _, fs in os.walk(path) for f in fs]
    assert all(f.startswith(".acp/") or f.endswith("zarr.json") for f in files), files


@pytest.mark.parametrize("world", [2, 4])
def test_packed_chunks_load_bit_exactly_at_another_world_size(saved, world) -> None:
    from dist import run_distributed

    assert run_distributed(_load_body, world=world, args=saved) == [True] * world


def test_packed_chunks_load_in_one_process(saved) -> None:
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    model(torch.randn(2, 33)).sum().backward()
    opt.step()
    acp.load(saved[0], {"model": model, "optimizer": opt})
    got, want = _full(model, opt), load_file(saved[1])
    assert sorted(got) == sorted(want)
    for k in want:
        assert np.array_equal(got[k], want[k]), k


def test_zarr_python_reads_packed_chunks_through_checkpoint_store(saved) -> None:
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    want = load_file(saved[1])
    root = zarr.open_group(checkpoint_store(saved[0]), mode="r")
    arrays = {k: v for k, v in root.members(max_depth=None) if isinstance(v, zarr.Array)}
    for name, value in want.items():
        assert np.array_equal(arrays[name][...], value), name
        assert np.array_equal(arrays[name][1:4], value[1:4]), name


def test_tensorstore_reads_a_packed_chunk_by_the_documented_route(saved) -> None:
    """docs/format.md: the array's zarr.json from its creator's packs, then each chunk through a ``zarr3``
    driver over the ``zip`` kvstore of the pack holding it, opened with that metadata."""
    import tensorstore as ts

    path, want = saved[0], load_file(saved[1])
    members = _members(path)
    name = "model/0.weight"
    pack, _ = members[f"{name}/zarr.json"]
    with zipfile.ZipFile(pack) as zf:
        metadata = json.loads(zf.read(f"{name}/zarr.json"))
    out = np.zeros(metadata["shape"], dtype=np.float32)
    chunk = metadata["chunk_grid"]["configuration"]["chunk_shape"]
    for key, (pack, _info) in members.items():
        if not key.startswith(name + "/c."):
            continue
        idx = [int(i) for i in key[len(name) + 3 :].split(".")]
        arr = ts.open(
            {
                "driver": "zarr3",
                "kvstore": {"driver": "zip", "base": f"file://{pack}", "path": f"{name}/"},
                "metadata": metadata,
            },
            open=True,
            assume_metadata=True,
            read=True,
        ).result()
        box = tuple(slice(i * c, min((i + 1) * c, s)) for i, c, s in zip(idx, chunk, metadata["shape"]))
        out[box] = arr[box].read().result()
    assert np.array_equal(out, want[name])


def _flip(pack: str, info: zipfile.ZipInfo) -> None:
    with open(pack, "r+b") as f:
        f.seek(info.header_offset)
        head = f.read(30)
        start = (
            info.header_offset
            + 30
            + int.from_bytes(head[26:28], "little")
            + int.from_bytes(head[28:30], "little")
        )
        f.seek(start + 3)
        b = f.read(1)
        f.seek(start + 3)
        f.write(bytes([b[0] ^ 0xFF]))


def test_verify_and_load_name_the_tensor_of_a_damaged_packed_chunk(saved, tmp_path, capsys) -> None:
    path = _copy(saved, tmp_path)
    assert cli(["verify", str(path)]) == 0
    capsys.readouterr()
    victim = "model/0.weight"
    t = acp.read_metadata(path).tensors[victim]
    flat = next(i for i, w in enumerate(t.writers) if w != t.pack_rank)  # a chunk another rank's pack holds
    grid = [-(-s // c) for s, c in zip(t.shape, t.chunk_shape)]
    key = f"{victim}/" + ".".join(["c", *map(str, np.unravel_index(flat, grid))])
    _flip(*_members(path)[key])
    assert cli(["verify", str(path)]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("BAD")]
    assert bad and any(victim in line for line in bad), bad
    model = _model()
    with pytest.raises(CorruptCheckpointError, match="0.weight"):
        acp.load(path, {"model": model})


def test_checkpoint_store_refuses_links_and_fifos(saved, tmp_path) -> None:
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    path = _copy(saved, tmp_path)
    packs = path / ".acp" / "packs"
    first = sorted(os.listdir(packs))[0]
    os.rename(packs / first, tmp_path / "moved.zip")
    os.symlink(tmp_path / "moved.zip", packs / first)
    root = zarr.open_group(checkpoint_store(path), mode="r")
    with pytest.raises(CorruptCheckpointError, match="link"):
        for name in acp.read_metadata(path).tensors:
            root[name][...]
    os.unlink(packs / first)
    os.mkfifo(packs / first)
    root = zarr.open_group(checkpoint_store(path), mode="r")
    with pytest.raises(CorruptCheckpointError, match="regular file"):
        for name in acp.read_metadata(path).tensors:
            root[name][...]


def test_checkpoint_store_refuses_a_linked_or_fifo_chunk_file(tmp_path) -> None:
    """Arrays in their own directories: a chunk file that is a link or a FIFO is refused, as the load does."""
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    path = tmp_path / "own"
    acp.save(
        path, {"model": {"w": torch.arange(12.0).reshape(3, 4)}}, plan_options=PlanOptions(pack_array_bytes=0)
    )
    chunk = path / "model" / "w" / "c.0.0"
    assert chunk.is_file()
    os.rename(chunk, tmp_path / "elsewhere")
    os.symlink(tmp_path / "elsewhere", chunk)
    with pytest.raises(CorruptCheckpointError, match="link"):
        zarr.open_group(checkpoint_store(path), mode="r")["model/w"][...]
    os.unlink(chunk)
    os.mkfifo(chunk)
    with pytest.raises(CorruptCheckpointError, match="regular file"):
        zarr.open_group(checkpoint_store(path), mode="r")["model/w"][...]


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_checkpoint_store_refuses_a_cut_chunk_file(tmp_path, compression) -> None:
    """Arrays in their own directories: a chunk file cut short is refused naming the tensor and the file
    (its shard index checked before zarr sees it), never zarr's raw checksum ValueError."""
    import zarr

    from arraycheckpoint.zarr import checkpoint_store

    w = torch.arange(4096.0).reshape(64, 64)
    opts = PlanOptions(pack_array_bytes=0)
    acp.save(tmp_path, {"model": {"w": w}}, plan_options=opts, compression=compression)
    read = zarr.open_group(checkpoint_store(tmp_path), mode="r")["model/w"][...]
    assert np.array_equal(read, w.numpy())
    chunk = tmp_path / "model" / "w" / "c.0.0"
    raw = chunk.read_bytes()
    for cut in (raw[: len(raw) // 2], raw[:3]):
        chunk.write_bytes(cut)
        with pytest.raises(CorruptCheckpointError, match=r"'model/w'.*c\.0\.0"):
            zarr.open_group(checkpoint_store(tmp_path), mode="r")["model/w"][...]


def test_a_padded_edge_chunk_is_what_zarr_reads_and_what_the_reader_decodes() -> None:
    """An edge chunk is padded to the full chunk shape with the fill value, as zarr writes it: zarr-python reads
    the array from the files the engine encodes, and the pack reader decodes the same bytes into a region."""
    import zarr

    from arraycheckpoint.codecs import array_metadata
    from arraycheckpoint.engine import packread, shardfile
    from arraycheckpoint.planning.regions import Box

    rng = np.random.default_rng(3)
    value = rng.standard_normal((10, 7)).astype(np.float32)
    chunk, inner = (4, 7), (2, 7)
    doc = array_metadata(value.shape, value.dtype, chunk, inner, None, name="w", separator=".")
    store = zarr.storage.MemoryStore()
    files = {"w/zarr.json": json.dumps(doc).encode()}
    for i in range(3):
        part = value[i * 4 : (i + 1) * 4]
        raw = b"".join(bytes(p) for p in shardfile.encode(shardfile.padded(part, chunk), inner))
        files[f"w/c.{i}.0"] = raw
    from zarr.core.buffer import default_buffer_prototype
    from zarr.core.sync import sync

    for k, v in files.items():
        sync(store.set(k, default_buffer_prototype().buffer.from_bytes(v)))
    assert np.array_equal(zarr.open_array(store, path="w", mode="r")[...], value)

    class T:
        dtype, chunk_shape, inner_chunk_shape = "float32", chunk, inner

    out = np.full(value.shape, -1.0, dtype=np.float32)
    lay = packread._Layout(T)
    for i in range(3):
        raw = np.frombuffer(files[f"w/c.{i}.0"], dtype=np.uint8)
        assert packread.decode_into(raw, lay, (i * 4, 0), [(Box((0, 0), value.shape), out)], ValueError)
    assert np.array_equal(out, value)


def test_packed_chunks_load_from_an_object_store_with_ranged_reads(saved) -> None:
    """The 3-rank checkpoint copied to ``memory://`` (the object-store branch): the load reads each member with
    a ranged read of its pack object; ``checkpoint_store`` over a zarr store that is no local path (ranged
    ``get``s of the packs) serves every tensor."""
    import zarr

    import arraycheckpoint.storage.memory  # noqa: F401 - registers memory://
    from arraycheckpoint.storage import storage_for
    from arraycheckpoint.zarr import checkpoint_store

    url = f"memory://packed-chunks/{os.getpid()}"
    storage, root = storage_for(url)
    for d, _, fs in os.walk(saved[0]):
        for f in fs:
            key = os.path.relpath(os.path.join(d, f), saved[0])
            with open(os.path.join(d, f), "rb") as fh:
                storage.write(root, key, fh.read())
    want = load_file(saved[1])
    model = _model()
    acp.load(url, {"model": model})
    for k, v in model.state_dict().items():
        assert np.array_equal(v.numpy(), want[f"model/{k}"]), k
    from zarr.core.buffer import default_buffer_prototype

    data = {}
    for d, _, fs in os.walk(saved[0]):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                data[os.path.relpath(os.path.join(d, f), saved[0])] = (
                    default_buffer_prototype().buffer.from_bytes(fh.read())
                )
    group = zarr.open_group(checkpoint_store(zarr.storage.MemoryStore(data, read_only=True)), mode="r")
    for name, value in want.items():
        assert np.array_equal(group[name][...], value), name
