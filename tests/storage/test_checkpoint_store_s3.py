"""``checkpoint_store`` over S3 as a user reads a checkpoint there: zarr-python's ``FsspecStore`` through
s3fs, against the loopback S3 server (moto's server mode, started by ``conftest.py``), on a checkpoint two
gloo ranks saved to ``s3://`` whose arrays' chunks lie in both ranks' packs.

zarr-python, xarray and dask read every tensor bit-exactly from the URL; each packed member is one ranged GET
of its pack (its local header and its bytes together), each pack's size one HEAD and its directory one
ranged GET of its tail, counted on the wire by a proxy in front of the server; a truncated pack and a flipped
byte in a packed chunk are refused naming the tensor, the member and the pack by its ``s3://`` URL.
"""

from __future__ import annotations

import io
import os
import re
import uuid
import warnings
import zipfile
from collections import Counter
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")
pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.errors import ArrayCheckpointError  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

#: a 1 MiB target file size and chunk cap: ``model/w``'s 1 MiB chunks keep their own files, every other
#: array's chunks (one per rank, below the target) go into their writer's packs
OPTIONS = acp.PlanOptions(min_chunk_bytes=1 << 20, max_chunk_bytes=1 << 20, inner_chunk_bytes=64 << 10)
#: what a pack's first read fetches at most: its last bytes, which hold its ZIP directory
#: (``audit.packdir._PACK_TAIL_BYTES``)
TAIL = 256 << 10


def _full() -> dict[str, torch.Tensor]:
    """Every tensor, whole (each rank builds the same and saves its shard)."""
    g = torch.Generator().manual_seed(21)
    out = {"w": torch.randn(1024, 512, generator=g)}  # 2 MiB, two 1 MiB chunks of their own
    for i in range(4):
        out[f"v{i}"] = torch.randn(300, 512, generator=g)  # 300 KiB per rank: packed, in both ranks' packs
    out["emb"] = torch.randn(64, 40, generator=g).to(torch.bfloat16)  # split by columns
    out["b"] = torch.randn(33, generator=g)  # replicated: written once
    return out


def _save_rank(rank: int, world: int, env: dict[str, str], url: str) -> bool:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    os.environ.update(env)
    mesh = init_device_mesh("cpu", (world,))
    place = {"emb": Shard(1), "b": Replicate()}
    state = {k: distribute_tensor(v, mesh, [place.get(k, Shard(0))]) for k, v in _full().items()}
    acp.save(url, {"model": state}, plan_options=OPTIONS)
    return True


@pytest.fixture(scope="module")
def saved(s3_server: Any) -> tuple[str, dict[str, np.ndarray]]:
    from dist import run_distributed

    url = f"s3://{s3_server.bucket}/store-{uuid.uuid4().hex[:8]}/ck"
    env = {
        k: os.environ[k]
        for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_REGION", "AWS_ENDPOINT_URL")
    }
    assert run_distributed(_save_rank, world=2, args=(env, url)) == [True, True]
    meta = checkpoint_store(url).metadata
    spread = [n for n, t in meta.tensors.items() if t.pack is not None and set(t.writers) == {0, 1}]
    assert len(spread) == 5, spread  # v0..v3 and emb: one chunk in each rank's packs
    assert meta.tensors["model/w"].pack is None, "w's chunks keep their own files"
    keys = s3_server.keys(_prefix(s3_server, url))
    assert any("/.acp/packs/0." in k for k in keys) and any("/.acp/packs/1." in k for k in keys), keys
    return url, {f"model/{k}": _bits(v) for k, v in _full().items()}


def _prefix(s3_server: Any, url: str) -> str:
    return url[len(f"s3://{s3_server.bucket}/") :] + "/"


def _bits(t: torch.Tensor | np.ndarray) -> np.ndarray:
    """The bytes of a tensor or array as unsigned integers (bfloat16 and NaNs compared bit for bit)."""
    if isinstance(t, torch.Tensor):
        t = t.contiguous().view(getattr(torch, f"uint{8 * t.element_size()}")).numpy()
    a = np.ascontiguousarray(t)
    return a.view(f"u{a.dtype.itemsize}")


def _arrays(store: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing unrecognised in the hierarchy
        members = zarr.open_group(store, mode="r").members(max_depth=None)
    return {k: v for k, v in members if isinstance(v, zarr.Array)}


@pytest.mark.parametrize("opened", ["url", "fsspec store"])
def test_zarr_python_reads_every_tensor_from_s3(
    saved: tuple[str, dict[str, np.ndarray]], opened: str
) -> None:
    """``checkpoint_store("s3://...")`` (s3fs configured from the environment, as the save's tensorstore
    is) and ``checkpoint_store(FsspecStore)`` list and read every tensor, packed or not, bit-exactly."""
    url, want = saved
    base = url if opened == "url" else zarr.storage.FsspecStore.from_url(url, read_only=True)
    arrays = _arrays(checkpoint_store(base))
    assert set(arrays) == set(want) | {".acp"}, sorted(arrays)
    for name, value in want.items():
        assert np.array_equal(_bits(arrays[name][...]), value), name


def test_xarray_and_dask_read_from_s3(saved: tuple[str, dict[str, np.ndarray]]) -> None:
    """The README's xarray and dask lines, with the ``s3://`` URL for the path."""
    xr = pytest.importorskip("xarray")
    da = pytest.importorskip("dask.array")
    url, want = saved
    store = checkpoint_store(url)
    tree = xr.open_datatree(store, engine="zarr", consolidated=False)
    model = xr.open_zarr(store, group="model", consolidated=False)
    for name, value in want.items():
        var = name.split("/", 1)[1]
        assert np.array_equal(_bits(tree["model"].dataset[var].values), value), name
        assert np.array_equal(_bits(model[var].values), value), name
    w = da.from_zarr(zarr.open_array(store, path="model/v1", mode="r"))
    assert w.numblocks[0] > 2  # dask reads by zarr's read chunks (the inner chunks), from both ranks' packs
    assert np.array_equal(_bits(w.compute()), want["model/v1"])


def _pack_members(s3_server: Any, prefix: str) -> dict[str, tuple[int, dict[str, zipfile.ZipInfo]]]:
    """``pack key -> (size, member -> ZIP entry)`` of every pack, read here with boto3 and zipfile."""
    out = {}
    for key in s3_server.keys(prefix + ".acp/packs/"):
        body = s3_server.client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read()
        with zipfile.ZipFile(io.BytesIO(body)) as zf:
            out[key] = (len(body), {i.filename: i for i in zf.infolist()})
    return out


def _wire(proxy: Any, s3_server: Any) -> dict[str, list[tuple[str, str | None, int]]]:
    """The requests the proxy forwarded, per object key: ``(method, Range header, body bytes)``."""
    out: dict[str, list[tuple[str, str | None, int]]] = {}
    for method, path, rng, n in proxy.requests:
        key = path.split("?", 1)[0][len(f"/{s3_server.bucket}/") :]
        out.setdefault(key, []).append((method, rng, n))
    return out


def test_members_are_read_with_one_ranged_get_each(
    saved: tuple[str, dict[str, np.ndarray]], s3_server: Any, fault_proxy: Any
) -> None:
    """Counted on the wire (a proxy in front of the server): a pack is never fetched whole; per pack one
    HEAD (its size) and one ranged GET of its last bytes (its directory), then one ranged GET per member
    served, exactly the member's local header and bytes. Reading one small tensor touches its rank's
    packs' tails and its own member, nothing of the other rank."""
    url, want = saved
    prefix = _prefix(s3_server, url)
    packs = _pack_members(s3_server, prefix)
    options = {"endpoint_url": fault_proxy.endpoint}

    # one small tensor: written by one rank
    store = checkpoint_store(url, storage_options=options)
    assert np.array_equal(_bits(zarr.open_array(store, path="model/b", mode="r")[...]), want["model/b"])
    rank = store.metadata.tensors["model/b"].writers[0]
    wire = _wire(fault_proxy, s3_server)
    touched = {k for k in wire if "/.acp/packs/" in k}
    mine = {k for k in packs if f"/packs/{rank}." in k}
    assert touched == mine  # the packs its save wrote (the metadata says how many), none past them
    fetched = sum(n for k in touched for m, _r, n in wire[k] if m == "GET")
    b_members = [
        i for _s, members in packs.values() for i in members.values() if i.filename.startswith("model/b/")
    ]
    bound = sum(min(packs[k][0], TAIL) for k in touched if k in packs)
    bound += sum(30 + len(i.filename) + 64 + i.file_size for i in b_members)
    assert fetched <= bound, (fetched, bound)

    # everything: one ranged GET per member and per pack directory, each pack byte fetched at most twice
    fault_proxy.requests.clear()
    arrays = _arrays(checkpoint_store(url, storage_options=options))
    for name, value in want.items():
        assert np.array_equal(_bits(arrays[name][...]), value), name
    wire = _wire(fault_proxy, s3_server)
    for key, (size, members) in packs.items():
        calls = Counter(m for m, _r, _n in wire[key])
        gets = [(r, n) for m, r, n in wire[key] if m == "GET"]
        assert calls == {"HEAD": 1, "GET": 1 + len(members)}, (key, calls, len(members))
        assert all(r is not None and re.fullmatch(r"bytes=\d+-\d+", r) for r, _n in gets), gets
        tail, *rest = gets
        # the pack's end: its directory and end records, and no more than the rank's directories can take
        directory_at = max(i.header_offset + 30 + len(i.filename) + i.file_size for i in members.values())
        assert tail[0].endswith(f"-{size - 1}") and size - directory_at <= tail[1] <= min(size, TAIL), tail
        assert tail[1] < (size - directory_at) * 4, (key, tail, size - directory_at)
        # each member's GET: its 30-byte local header, its name and its bytes, exactly (a save's members
        # follow one another with no extra field: the first read's room for one ends at the next member)
        served = sorted((i.header_offset, 30 + len(i.filename) + i.file_size) for i in members.values())
        got = sorted((int(r.split("=")[1].split("-")[0]), n) for r, n in rest)
        assert [o for o, _n in got] == [o for o, _n in served], key
        assert [n for _o, n in got] == [need for _p, need in served], key
        assert sum(n for _r, n in gets) <= min(size, TAIL) + size
    # w's own chunk files: one HEAD (size), the shard index checked (a suffix GET), then the file once
    files = {k: n for k, n in _sizes(s3_server, prefix + "model/w/").items() if "/c." in k}
    assert len(files) == 2
    for key, size in files.items():
        index = 16 * 16 + 4  # 16 inner chunks of 64 KiB
        assert wire[key] == [("HEAD", None, 0), ("GET", f"bytes=-{index}", index), ("GET", None, size)], key


def _sizes(s3_server: Any, prefix: str) -> dict[str, int]:
    pages = s3_server.client.get_paginator("list_objects_v2").paginate(Bucket=s3_server.bucket, Prefix=prefix)
    return {o["Key"]: o["Size"] for page in pages for o in page.get("Contents", [])}


def test_tensorstore_reads_a_packed_chunk_from_s3_with_ranged_gets(
    saved: tuple[str, dict[str, np.ndarray]], s3_server: Any, fault_proxy: Any
) -> None:
    """``docs/format.md``'s tensorstore route with an S3 pack for the base: the ``zarr3`` driver over the
    ``zip`` key-value store of rank 1's pack on the server reads ``model/v2``'s chunk ``c.1.0`` bit-exactly,
    with ranged GETs only: the pack's last 64 KiB (its end records), its directory, the member; a second read
    revalidates the tail (an empty answer) and fetches the member again."""
    ts = pytest.importorskip("tensorstore")
    import json

    url, want = saved
    prefix = _prefix(s3_server, url)
    packs = _pack_members(s3_server, prefix)
    key = next(k for k, (_n, members) in packs.items() if "model/v2/c.1.0" in members)
    members = packs[key][1]
    holder = next(k for k, (_n, m) in packs.items() if "model/v2/zarr.json" in m)  # its creator's packs
    body = s3_server.client.get_object(Bucket=s3_server.bucket, Key=holder)["Body"].read()
    with zipfile.ZipFile(io.BytesIO(body)) as zf:
        doc = zf.read("model/v2/zarr.json")
    meta = json.loads(doc)
    base = {"driver": "s3", "bucket": s3_server.bucket, "path": key, "endpoint": fault_proxy.endpoint}
    spec = {
        "driver": "zarr3",
        "metadata": meta,
        "kvstore": {"driver": "zip", "path": "model/v2/", "base": base},
    }
    arr = ts.open(spec, open=True, assume_metadata=True).result()
    rows = meta["chunk_grid"]["configuration"]["chunk_shape"][0]
    assert np.array_equal(_bits(arr[rows : 2 * rows].read().result()), want["model/v2"][rows:])
    gets = [(r, n) for m, p, r, n in fault_proxy.requests if m == "GET" and p.endswith(key)]
    member = members["model/v2/c.1.0"]
    assert all(r is not None for r, _n in gets), gets
    assert len(gets) == 3 and gets[0] == ("bytes=-65634", 65634), gets  # end records, directory, member
    assert gets[2][1] == 30 + len(member.filename) + member.file_size, (gets, member)
    fault_proxy.requests.clear()
    assert np.array_equal(_bits(arr[rows : 2 * rows].read().result()), want["model/v2"][rows:])
    again = [(r, n) for m, p, r, n in fault_proxy.requests if m == "GET" and p.endswith(key)]
    assert again == [("bytes=-65634", 0), gets[2]], again


def _copy(s3_server: Any, url: str) -> tuple[str, str]:
    """A copy of the saved checkpoint under a fresh prefix (server-side copies): its URL and key prefix."""
    src = _prefix(s3_server, url)
    dst = f"store-{uuid.uuid4().hex[:8]}/ck/"
    for key in s3_server.keys(src):
        s3_server.client.copy_object(
            Bucket=s3_server.bucket,
            Key=dst + key[len(src) :],
            CopySource={"Bucket": s3_server.bucket, "Key": key},
        )
    return f"s3://{s3_server.bucket}/{dst.rstrip('/')}", dst


def _rewrite(s3_server: Any, key: str, change: Any) -> None:
    body = bytearray(s3_server.client.get_object(Bucket=s3_server.bucket, Key=key)["Body"].read())
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=key, Body=bytes(change(body)))


@pytest.mark.parametrize("damage", ["truncated pack", "flipped byte"])
def test_a_damaged_pack_on_s3_is_refused_naming_tensor_member_and_pack(
    saved: tuple[str, dict[str, np.ndarray]], s3_server: Any, damage: str
) -> None:
    """Rank 1's first pack cut by 100 bytes (its end records gone), or one byte of ``model/v2``'s chunk
    flipped inside it: reading the tensor through the store raises naming the tensor and the pack by its
    ``s3://`` URL (and the member, for the flipped byte); the other rank's tensors still read."""
    url, want = saved
    copy, prefix = _copy(s3_server, url)
    pack = f"{prefix}.acp/packs/1.0.zip"
    members = _pack_members(s3_server, prefix)[pack][1]
    victim = next(n for n in sorted(members) if n.startswith("model/v") and "/c." in n)
    tensor = victim.rpartition("/")[0]
    if damage == "truncated pack":
        _rewrite(s3_server, pack, lambda b: b[:-100])
        why = re.escape(f"s3://{s3_server.bucket}/{pack}") + ".*not a ZIP archive as a save writes it"
    else:
        info = members[victim]
        at = info.header_offset + 30 + len(info.filename) + 7  # inside the member's first inner chunk

        def flip(b: bytearray) -> bytearray:
            b[at] ^= 0x40
            return b

        _rewrite(s3_server, pack, flip)
        why = re.escape(f"{victim} in s3://{s3_server.bucket}/{pack}") + ".*crc32c"
    store = checkpoint_store(copy)
    with pytest.raises(ArrayCheckpointError, match=f"tensors? .*{re.escape(repr(tensor))}.*{why}"):
        zarr.open_array(store, path=tensor, mode="r")[...]
    if damage == "flipped byte":  # the rest of that pack, and the other rank's packs, still serve
        other = checkpoint_store(copy)
        assert np.array_equal(_bits(zarr.open_array(other, path="model/b", mode="r")[...]), want["model/b"])
