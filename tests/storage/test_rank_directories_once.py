"""A rank holding more than 65,536 packed members on an object store: its pack directories are read once.

Above :data:`arraycheckpoint.audit.capacity.REMOTE_CAPACITY_FREE` members, a reader of an object store counts
the entries of a rank's pack directories before it builds a key per chunk (a 40-byte change of shape in the
metadata could declare 2^26 chunks no pack holds). That count read every directory, and the walk that checks
the members read them all again (the zarr store's listing a third time). The count now keeps what it read
for the walk: counted on the wire for ``checkpoint_store`` over S3 (s3fs, the loopback server), and per read
for the load from ``memory://`` (tensorstore), on one rank's pack of 70,000 chunks of 4 bytes.
"""

from __future__ import annotations

import os
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.audit import packdir  # noqa: E402
from arraycheckpoint.audit.capacity import REMOTE_CAPACITY_FREE  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

N = 70_000
PACK = ".acp/packs/0.0.zip"


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model/w`` of 70,000 chunks of one float each, all in rank 0's one pack (about 9 MB, 1.5 s)."""
    path = tmp_path_factory.mktemp("many") / "ck"
    opts = acp.PlanOptions(min_chunk_bytes=16 << 20, max_chunk_bytes=4, inner_chunk_bytes=4)
    acp.save(path, {"model": {"w": torch.arange(N, dtype=torch.float32)}}, plan_options=opts)
    assert sorted(os.listdir(path / ".acp" / "packs")) == ["0.0.zip"]
    assert N > REMOTE_CAPACITY_FREE
    return path


def _files(ck: Path) -> dict[str, bytes]:
    out = {}
    for d, _, fs in os.walk(ck):
        for f in fs:
            out[os.path.relpath(os.path.join(d, f), ck)] = Path(d, f).read_bytes()
    return out


def test_the_zarr_store_reads_the_directories_once_over_s3(
    many: Path, s3_server: Any, fault_proxy: Any
) -> None:
    """Listing the array's 70,000 keys (what zarr, xarray and a walk of the store do), then reading chunks:
    the pack's size once, its directory once (its tail, then the rest of it: two ranged GETs), one ranged GET
    per member read (its ``zarr.json`` and the chunks). It was three passes (a count to list, a count and a
    walk to read): 3 HEADs and 6 GETs."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")
    prefix = f"many-{uuid.uuid4().hex[:8]}/ck"
    for key, body in _files(many).items():
        s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}", Body=body)
    store = checkpoint_store(
        f"s3://{s3_server.bucket}/{prefix}", storage_options={"endpoint_url": fault_proxy.endpoint}
    )

    from zarr.core.sync import sync

    async def keys() -> list[str]:
        return [k async for k in store.list_prefix("model/w")]

    assert len(sync(keys())) == N + 1  # its zarr.json and every chunk
    w = zarr.open_array(store, path="model/w", mode="r")
    assert np.array_equal(w[[7, 65_537, N - 1]], np.array([7, 65_537, N - 1], dtype=np.float32))
    pack = [(m, r, n) for m, p, r, n in fault_proxy.requests if p.endswith(f"{prefix}/{PACK}")]
    calls = Counter(m for m, _r, _n in pack)
    assert calls == {"HEAD": 1, "GET": 2 + 4}, pack  # directory (tail, rest); its zarr.json and 3 chunks
    size = len(_files(many)[PACK])
    directory = sum(n for m, _r, n in pack[:3] if m == "GET")
    assert directory < size, (directory, size)  # the directory's reads, not the pack twice
    absent = [m for m, p, _r, _n in fault_proxy.requests if p.endswith(f"{prefix}/.acp/packs/0.1.zip")]
    assert absent == []  # no pack past the last one its save wrote (the metadata says how many) is looked for


def test_the_load_reads_the_directories_once_from_memory(many: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``acp.load`` from ``memory://`` (tensorstore's key-value store: the object-store branch) counts the
    rank's members before it builds a key per chunk, then checks them: one read of the pack's tail and one of
    the rest of its directory (were two of each), bit-exact."""
    url = _in_memory(many)
    tails, ranges = _count_directory_reads(monkeypatch)
    w = torch.zeros(N)
    acp.load(url, {"model": {"w": w}})
    assert torch.equal(w, torch.arange(N, dtype=torch.float32))
    assert tails == {PACK: 1}, tails  # and no read of a pack past the last one (0.1.zip)
    assert ranges == {PACK: 1}, ranges  # the directory beyond the tail, once


def _in_memory(ck: Path) -> str:
    """Every file of ``ck`` copied to a fresh ``memory://`` location (tensorstore's key-value store: the
    object-store branch of every reader); its URL."""
    import arraycheckpoint.storage.memory  # noqa: F401 - registers memory://
    from arraycheckpoint.storage import storage_for

    url = f"memory://many/{uuid.uuid4().hex[:8]}"
    storage, root = storage_for(url)
    for key, body in _files(ck).items():
        storage.write(root, key, body)
    return url


def _count_directory_reads(monkeypatch: pytest.MonkeyPatch) -> tuple[Counter[str], Counter[str]]:
    """From now on: per pack, the reads of its tail, and of the rest of its directory (``packdir._kv_ranges``)."""
    tails: Counter[str] = Counter()
    ranges: Counter[str] = Counter()
    real = packdir._kv_ranges

    def counted(storage: Any, base: str, key: str, want: int) -> Any:
        tails[key] += 1
        got = real(storage, base, key, want)
        if got is None:
            return None
        tail, size, read = got

        def read_counted(spans: list[tuple[int, int | None]]) -> list[bytes]:
            ranges[key] += 1
            return read(spans)

        return tail, size, read_counted

    monkeypatch.setattr(packdir, "_kv_ranges", counted)
    return tails, ranges


def test_verify_with_data_reads_the_directories_once_from_memory(
    many: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify`` (reading the data) of the same checkpoint on ``memory://``: it counts the rank's members
    before it builds a key per chunk, then reads every chunk through the load, which counted and read the
    4.5 MB directory a second time (two reads of the tail and two of the rest); now once. And it reads the
    70,000 chunks, one region each, in seconds: matching each chunk to its region was a scan of every
    region (4.9e9 box intersections: it did not finish in 10 minutes)."""
    from arraycheckpoint.tools.verify import verify

    url = _in_memory(many)
    tails, ranges = _count_directory_reads(monkeypatch)
    report = verify(url)
    assert report.ok and report.chunks == N, report.problems[:3]
    assert tails == {PACK: 1}, tails  # and no read of a pack past the last one (0.1.zip)
    assert ranges == {PACK: 1}, ranges


def test_the_zarr_store_reads_only_the_packs_holding_what_is_read_over_s3(
    tmp_path: Path, s3_server: Any, fault_proxy: Any
) -> None:
    """A rank of a dozen packs on S3: reading three rows through ``checkpoint_store`` sends requests for the
    three packs holding them (and the array's ``zarr.json``, in the first) and none for the others; it read
    the tail of every pack of the rank for the first row. Bit-exact."""
    pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")
    rows = 3000
    ck = tmp_path / "ck"
    w = torch.arange(rows * 4, dtype=torch.float32).reshape(rows, 4)
    opts = acp.PlanOptions(max_chunk_bytes=16, inner_chunk_bytes=16, min_chunk_bytes=16 << 10)
    acp.save(ck, {"model": {"w": w}}, plan_options=opts)
    packs = sorted(os.listdir(ck / ".acp" / "packs"))
    assert len(packs) >= 8, packs
    prefix = f"packs-{uuid.uuid4().hex[:8]}/ck"
    for key, body in _files(ck).items():
        s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/{key}", Body=body)
    store = checkpoint_store(
        f"s3://{s3_server.bucket}/{prefix}", storage_options={"endpoint_url": fault_proxy.endpoint}
    )
    array = zarr.open_array(store, path="model/w", mode="r")
    picked = [5, rows // 2, rows - 2]
    assert np.array_equal(array[picked], w.numpy()[picked])
    import zipfile

    wanted = {"model/w/zarr.json", *(f"model/w/c.{r}.0" for r in picked)}
    holding = set()
    for name in packs:
        with zipfile.ZipFile(ck / ".acp" / "packs" / name) as zf:
            if wanted & set(zf.namelist()):
                holding.add(name)
    asked = {p.rpartition("/")[2] for _m, p, _r, _n in fault_proxy.requests if "/.acp/packs/" in p}
    assert len(holding) == 3 and asked == holding, (sorted(asked), sorted(holding))


def test_verify_without_data_reads_the_directories_once_from_memory(
    many: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``verify --no-data`` of the same checkpoint on ``memory://``: it checked the rank's packs (counting its
    members, then reading each directory with its checks), then counted the members once more before building
    a key per chunk, reading the 4.5 MB directory a second time (two reads of the tail and two of the rest);
    now once: one read of its tail, one of the rest of its directory, and one of its members' local headers
    (the pack whole: cheaper than 70,000 ranges; the checks without the data read them, the load does not)."""
    from arraycheckpoint.tools.verify import verify

    url = _in_memory(many)
    tails, ranges = _count_directory_reads(monkeypatch)
    report = verify(url, read_data=False)
    assert report.ok and report.tensors == 1, report.problems[:3]
    assert tails == {PACK: 1}, tails  # and no read of a pack past the last one (0.1.zip)
    assert ranges == {PACK: 2}, ranges
