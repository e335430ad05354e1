"""``checkpoint_store`` and the native readers agree on a hostile checkpoint, and the store's errors name it.

The zarr store (what zarr-python, xarray and dask read a checkpoint through) and ``verify`` / ``acp.load``
enumerate a rank's packs with one piece of code (``audit.rankpacks.RankPacks``), so a checkpoint is valid for
all of them or refused by all of them with one message naming the pack and the member. An object store gets
the capacity check of a local path; a damaged chunk read through the store names the tensor and the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")

from faults.packtools import flip_member_byte, members  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.errors import ArrayCheckpointError, CorruptCheckpointError  # noqa: E402
from arraycheckpoint.tools.verify import verify  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

W = "model/w"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return {"w": torch.randn(64, 32, generator=g), "b": torch.randn(32, generator=g)}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("agree") / "ck"
    acp.save(path, {"model": _state()})
    assert sorted(os.listdir(path / ".acp" / "packs")) == ["0.0.zip"]
    return path


@pytest.fixture
def ck(saved: Path, tmp_path: Path) -> Path:
    shutil.copytree(saved, tmp_path / "ck")
    return tmp_path / "ck"


def _memory_store(ck: Path) -> zarr.storage.MemoryStore:
    """Every file of ``ck`` in a zarr MemoryStore: what the store sees of an object store (no file sizes
    without reads, ranged reads only), in process (the same store over S3 through s3fs, against the loopback
    server: ``tests/storage/test_checkpoint_store_s3.py``)."""
    from zarr.core.buffer import default_buffer_prototype

    data = {}
    for dirpath, _, files in os.walk(ck):
        for f in files:
            key = os.path.relpath(os.path.join(dirpath, f), ck)
            data[key] = default_buffer_prototype().buffer.from_bytes(Path(dirpath, f).read_bytes())
    return zarr.storage.MemoryStore(data, read_only=True)


@pytest.mark.parametrize("extra", ["duplicate", "foreign", "empty", "fifo", "directory"])
def test_a_pack_past_the_last_one_a_save_wrote_is_opened_by_no_reader(ck: Path, extra: str) -> None:
    """``.acp/packs/0.1.zip`` beside rank 0's only pack: a second, conflicting ``model/w/c.0.0``, a foreign
    member, an empty ZIP file, a FIFO or a directory. The metadata says how many packs rank 0's save wrote
    (one: its members and the fill target recorded in ``pack``), and verify, the load and the store (local and
    object store) all stop there: none reads the extra file (they read on to the first absent pack, one
    missing-object read per rank on an object store, and refused it), all read the checkpoint bit-exactly,
    and nothing waits on the FIFO. A member twice within the packs the save wrote is refused by all of them
    (below)."""
    from faults.packtools import rescuing_fifo

    path = ck / ".acp" / "packs" / "0.1.zip"
    if extra in ("duplicate", "foreign", "empty"):
        chunk = dict(members(ck / ".acp" / "packs" / "0.0.zip"))[f"{W}/c.0.0"]
        with zipfile.ZipFile(path, "w") as zf:
            if extra != "empty":
                zf.writestr(f"{W}/c.0.0" if extra == "duplicate" else "notes.txt", bytes(len(chunk)))
    elif extra == "fifo":
        os.mkfifo(path)
    else:
        path.mkdir()
    want = _state()
    with rescuing_fifo(path, after=5.0) if extra == "fifo" else contextlib.nullcontext() as rescued:
        assert verify(ck).ok
        got = acp.load(ck, {"model": {k: torch.zeros_like(v) for k, v in want.items()}})
        assert all(torch.equal(got["model"][k], v) for k, v in want.items())
        stores = (ck,) if extra in ("fifo", "directory") else (ck, _memory_store(ck))
        for base in stores:
            root = zarr.open_group(checkpoint_store(base), mode="r")
            assert all(np.array_equal(root[f"model/{k}"][...], v.numpy()) for k, v in want.items())
    assert rescued is None or not rescued.is_set()  # nothing waited on the FIFO


@pytest.mark.parametrize("extra", ["duplicate", "foreign"])
def test_a_member_twice_in_the_packs_a_save_wrote_is_refused_alike(tmp_path: Path, extra: str) -> None:
    """Rank 0 wrote three packs; its second holds a second, conflicting ``model/w/c.0.0`` (a reader would
    have to pick one) or a foreign member: verify, the load and the store (local and object store) refuse
    it with the same message naming the pack."""
    ck = tmp_path / "ck"
    opts = acp.PlanOptions(min_chunk_bytes=4096, max_chunk_bytes=2048)
    acp.save(ck, {"model": _state()}, plan_options=opts)
    assert sorted(os.listdir(ck / ".acp" / "packs")) == ["0.0.zip", "0.1.zip", "0.2.zip"]
    chunk = dict(members(ck / ".acp" / "packs" / "0.0.zip"))[f"{W}/c.0.0"]
    name = f"{W}/c.0.0" if extra == "duplicate" else "notes.txt"
    with zipfile.ZipFile(ck / ".acp" / "packs" / "0.1.zip", "a") as zf:
        zf.writestr(name, bytes(len(chunk)))
    why = "a second time" if extra == "duplicate" else "none of its arrays has"
    pattern = re.escape(f"/.acp/packs/0.1.zip holds the member {name!r}") + ".*" + why
    report = verify(ck)
    assert not report.ok and all(re.search(str(ck) + pattern, p.message) for p in report.problems), report
    with pytest.raises(CorruptCheckpointError, match=str(ck) + pattern):
        acp.load(ck, {"model": {k: torch.zeros_like(v) for k, v in _state().items()}})
    for base, where in ((ck, str(ck)), (_memory_store(ck), "memory://[0-9]+")):
        with pytest.raises(CorruptCheckpointError, match=where + pattern):
            zarr.open_group(checkpoint_store(base), mode="r")[W][...]


def test_an_object_store_grid_the_packs_cannot_hold_is_refused_before_its_keys_are_built(
    tmp_path: Path,
) -> None:
    """A 40-byte change of shape declares 2^17 chunks of ``model/w`` in rank 0's packs of a few KB. A local
    path was refused from the packs' sizes; on an object store the store built a key per chunk and read
    every pack before saying a member was missing (at 2^26 chunks: gigabytes of keys). Now the entries of the
    rank's pack directories are counted first, as verify and the load count them."""
    path = tmp_path / "ck"
    opts = acp.PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=64, inner_chunk_bytes=64)
    acp.save(path, {"model": {"w": torch.randn(64, 4), "b": torch.randn(8, 8)}}, plan_options=opts)
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["tensors"][W].update(shape=[1 << 17, 4], chunk_shape=[1, 4], inner_chunk_shape=[1, 4])
    meta.write_text(json.dumps(doc))
    why = "members in all, but the metadata puts 13107[0-9] chunks in them"
    store = checkpoint_store(_memory_store(path))
    with pytest.raises(ArrayCheckpointError, match=f"{W}.*{why}"):
        zarr.open_group(store, mode="r")[W][0]
    # listing the array's keys (zarr's list_prefix, xarray, a walk of the store) is checked the same way, on a
    # local path too (it built the keys of every declared chunk there)
    for listed, reason in ((store, why), (checkpoint_store(path), "chunks in them, which take at least")):
        with pytest.raises(ArrayCheckpointError, match=f"{W}.*{reason}"):
            _keys(listed, W)


def _keys(store: object, prefix: str) -> list[str]:
    from zarr.core.sync import sync

    async def collect() -> list[str]:
        return [k async for k in store.list_prefix(prefix)]  # type: ignore[attr-defined]

    return sync(collect())


def test_a_damaged_chunk_read_through_the_store_names_the_tensor_and_the_file(tmp_path: Path) -> None:
    """zarr-python's own checksum error says only "Stored and computed checksum do not match": the store
    checks what it serves first, naming the tensor and the file (or the member and its pack), for a whole
    chunk file, and for an inner chunk read by range."""
    path = tmp_path / "ck"
    state = {"w": torch.randn(16, 8), "big": torch.randn(512, 256)}  # w packed, big in its own file
    opts = acp.PlanOptions(min_chunk_bytes=256 << 10, inner_chunk_bytes=64 << 10)  # big: 8 inner chunks
    acp.save(path, {"model": state}, plan_options=opts)
    assert (path / "model" / "big" / "c.0.0").is_file() and not (path / "model" / "w").exists()
    flip_member_byte(path / ".acp" / "packs" / "0.0.zip", f"{W}/c.0.0", 5)
    big = path / "model" / "big" / "c.0.0"
    raw = bytearray(big.read_bytes())
    raw[100] ^= 1
    big.write_bytes(bytes(raw))
    for base in (path, _memory_store(path)):
        root = zarr.open_group(checkpoint_store(base), mode="r")
        member = re.escape(f"{W}/c.0.0 in ") + ".*" + re.escape(".acp/packs/0.0.zip")
        with pytest.raises(
            CorruptCheckpointError, match=f"tensor '{W}': {member}: inner chunk 0 does not match"
        ):
            root[W][...]
        for read in (lambda a: a[...], lambda a: a[0, :5]):  # the whole file, and one inner chunk by range
            with pytest.raises(
                CorruptCheckpointError, match=r"tensor 'model/big': .*model/big/c\.0\.0: inner"
            ):
                read(root["model/big"])
        assert np.array_equal(root["model/big"][-1], state["big"][-1].numpy())  # undamaged inner chunks read


def test_an_oversized_document_is_refused_on_an_object_store_before_it_is_downloaded(tmp_path: Path) -> None:
    """An array's ``zarr.json`` padded with 2 MiB of spaces (the same JSON). A local path refused it from its
    size (1 MiB at most); an object store downloaded it whole before its parse refused it (a 10 GB document:
    10 GB in memory). Now both refuse from the size, naming the file, and nothing is downloaded."""
    path = tmp_path / "ck"
    acp.save(
        path, {"model": {"big": torch.randn(512, 256)}}, plan_options=acp.PlanOptions(min_chunk_bytes=1 << 10)
    )
    doc = path / "model" / "big" / "zarr.json"
    doc.write_bytes(doc.read_bytes() + b" " * (2 << 20))
    fetched: list[str] = []

    class Watched(zarr.storage.MemoryStore):
        async def get(self, key, prototype, byte_range=None):  # type: ignore[no-untyped-def]  # noqa: ANN001, ANN202
            got = await super().get(key, prototype, byte_range)
            if got is not None and len(got) > 1 << 20:
                fetched.append(key)
            return got

        async def getsize(self, key: str) -> int:  # an object store's HEAD (MemoryStore's reads the value)
            if key not in self._store_dict:
                raise FileNotFoundError(key)
            return len(self._store_dict[key])

    remote = Watched(dict(_memory_store(path)._store_dict), read_only=True)
    for base, where in ((path, str(path)), (remote, "memory://[0-9]+")):
        with pytest.raises(
            CorruptCheckpointError, match=where + "/model/big/zarr.json is [0-9]+ bytes, more than"
        ):
            zarr.open_group(checkpoint_store(base), mode="r")["model/big"]
    assert fetched == []


def _format5(tmp_path: Path) -> tuple[Path, Path]:
    """A copy of the format-5 fixture (a pack per group of arrays, written by f62d3f0) and its first pack."""
    path = tmp_path / "ck"
    shutil.copytree(Path(__file__).parents[1] / "fixtures" / "format5" / "single", path)
    return path, sorted((path / ".acp" / "packs").iterdir())[0]


def _set_flags(pack: Path, member: str, flags: int) -> None:
    raw = bytearray(pack.read_bytes())
    at = raw.index(b"PK\x01\x02")
    while raw[at + 46 : at + 46 + int.from_bytes(raw[at + 28 : at + 30], "little")] != member.encode():
        at = raw.index(b"PK\x01\x02", at + 4)
    raw[at + 8 : at + 10] = flags.to_bytes(2, "little")
    pack.write_bytes(bytes(raw))


@pytest.mark.parametrize("damage", ["data descriptor", "foreign member"])
def test_format5_packs_are_read_by_the_store_as_the_load_reads_them(tmp_path: Path, damage: str) -> None:
    """Format 5: the store read a pack's directory with zipfile and its own checks, the load and verify with
    the library's parser: a member flagged with a data descriptor (its sizes after its data: readers may take
    them from there) or a member none of the pack's arrays has was served by the store and refused by the
    others. Now the store parses the pack as they do and refuses the same."""
    path, pack = _format5(tmp_path)
    member = "extra_state/a/b/c.0.0"
    if damage == "data descriptor":
        _set_flags(pack, member, 0x08)
        why = re.escape(f"{pack} is not a ZIP archive as a save writes it: member b'{member}' is encrypted")
    else:
        with zipfile.ZipFile(pack, "a") as zf:
            zf.writestr("notes.txt", b"hello")
        why = re.escape(f"{pack} holds the member 'notes.txt', which none of its arrays has")
    report = verify(path)
    assert not report.ok and any(re.search(why, p.message) for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match=why):
        zarr.open_group(checkpoint_store(path), mode="r")["extra_state/a/b"][...]


def _damage(ck: Path, how: str, tmp_path: Path) -> str:
    """Damage rank 0's only pack ``how``; return what every reader's message must say."""
    from faults.packtools import set_local_header

    pack = ck / ".acp" / "packs" / "0.0.zip"
    raw = pack.read_bytes()
    if how == "cut directory":
        pack.write_bytes(raw[:-30])
        return "is not a ZIP archive as a save writes it"
    if how == "bytes prepended":  # zipfile shifts every offset by them, tensorstore does not
        pack.write_bytes(b"\0" * 64 + raw)
        return "its directory does not end where its end records begin"
    if how == "deflate in the local header":
        set_local_header(pack, f"{W}/c.0.0", method=8)
        return "declares compression method 8"
    if how == "symlink":
        outside = tmp_path / "outside.zip"
        outside.write_bytes(raw)
        pack.unlink()
        pack.symlink_to(outside)
        return "is a symlink"
    raise AssertionError(how)


@pytest.mark.parametrize(
    "how", ["cut directory", "bytes prepended", "deflate in the local header", "symlink"]
)
def test_a_damaged_pack_gets_one_answer_from_verify_load_and_store(
    ck: Path, tmp_path: Path, how: str
) -> None:
    """Every reader refuses a damaged pack with the same words, naming the pack (the store had a ZIP parser
    and messages of its own, from zipfile)."""
    why = re.escape(f"{ck}/.acp/packs/0.0.zip") + ".*" + re.escape(_damage(ck, how, tmp_path))
    _refused_alike(ck, why)


def _refused_alike(ck: Path, why: str) -> None:
    """verify, the load and the store all refuse ``ck`` with a message matching ``why``."""
    report = verify(ck)
    assert not report.ok and all(re.search(why, p.message) for p in report.problems), report.problems
    with pytest.raises(CorruptCheckpointError, match=why):
        acp.load(ck, {"model": {k: torch.zeros_like(v) for k, v in _state().items()}})
    with pytest.raises(CorruptCheckpointError, match=why):
        zarr.open_group(checkpoint_store(ck), mode="r")[W][...]
