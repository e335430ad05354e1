"""Hostile and damaged packs (format 6; format 5 before): a pack is a ZIP file another job, tool or person may have written.

Every case must end in a clear error (CorruptCheckpointError, InconsistentCheckpointError or MetadataError)
naming the tensor or the path, before anything the pack declares is allocated or inflated: no crash, no hang,
no partly loaded lie. tensorstore's ``zip`` driver finds a member through the central directory but decodes it
as the member's *local* header says, so both are attacked. Cases that would exhaust memory if a check were
missing run in a subprocess that reports its peak memory. docs/security.md describes the checks.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import struct
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
from faults.packtools import (
    chunk_member,
    deflate_raw,
    delete_member,
    members,
    pack_key,
    pack_of,
    replace_member,
    rescuing_fifo,
    rewrite_pack,
    set_eocd,
    set_local_header,
    write_members,
)
from hostile import edit_metadata, run_isolated

import arraycheckpoint as acp
from arraycheckpoint.checks import bounds
from arraycheckpoint.errors import CorruptCheckpointError, InconsistentCheckpointError, MetadataError

W = "model/w"
B = "model/b"


def _state(seed: int = 0, rows: int = 64) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(rows, 32, generator=g), "b": torch.randn(32, generator=g)}


def _zeros(rows: int = 64) -> dict[str, dict[str, torch.Tensor]]:
    return {"model": {"w": torch.zeros(rows, 32), "b": torch.zeros(32)}}


@pytest.fixture
def ck(tmp_path: Path) -> Path:
    """A packed checkpoint of model/w (64 x 32) and model/b (32), both in one pack."""
    path = tmp_path / "ck"
    acp.save(path, {"model": _state()})
    assert pack_key(path, W) == pack_key(path, B) == ".acp/packs/0.0.zip"
    return path


def _refused(path: Path, error: type[Exception], *patterns: str, target: dict | None = None) -> str:
    """Load ``path``; it must raise ``error`` whose message holds every pattern; return the message."""
    with pytest.raises(error) as info:
        acp.load(path, _zeros() if target is None else target, strict=target is None)
    msg = str(info.value)
    for p in patterns:
        assert p in msg, (p, msg)
    return msg


def test_packed_checkpoint_round_trips(ck: Path) -> None:
    """The baseline every case below damages: both arrays packed, loading bit-exactly."""
    got = acp.load(ck, _zeros())
    want = _state()
    assert torch.equal(got["model"]["w"], want["w"]) and torch.equal(got["model"]["b"], want["b"])
    assert not (ck / "model" / "w").exists()
    assert {n for n, _ in members(pack_of(ck, W))} == {
        "model/b/zarr.json",
        "model/b/c.0",
        "model/w/zarr.json",
        "model/w/c.0.0",
    }


# Compression: nothing is inflated --------------------------------------------------------------------------
def test_deflated_member_is_refused(ck: Path) -> None:
    """A chunk member deflated (central directory and local header agree): tensorstore would inflate it and
    the load would succeed; packs store members uncompressed, so it is refused, naming the tensor."""
    pack = pack_of(ck, W)
    write_members(
        pack, members(pack), compression=lambda n: zipfile.ZIP_DEFLATED if n == chunk_member(W) else 0
    )
    _refused(ck, CorruptCheckpointError, "'model/w'", "compressed", "model/w/c.0.0")


def test_local_header_saying_deflate_is_refused(ck: Path) -> None:
    """The central directory says stored, the local header says deflate (and the data is deflated): the
    central-directory check alone passes, tensorstore decodes by the local header and would load the data.
    Refused: the local header must say what the central directory says."""
    pack = pack_of(ck, W)
    start_size = pack.stat().st_size
    original = dict(members(pack))[chunk_member(W)]
    squeezed = deflate_raw(original)
    set_local_header(pack, chunk_member(W), method=8, sizes=(len(squeezed), len(original)), data=squeezed)
    assert pack.stat().st_size == start_size
    assert zipfile.ZipFile(pack).getinfo(chunk_member(W)).compress_type == zipfile.ZIP_STORED
    _refused(ck, CorruptCheckpointError, "'model/w'", "local header", "compression method 8")


@pytest.mark.parametrize(
    "edit",
    [
        pytest.param({"sizes": (1 << 20, 1 << 20)}, id="larger-sizes"),
        pytest.param({"sizes": (100, 100)}, id="smaller-sizes"),
        pytest.param({"flags": 0x08}, id="data-descriptor"),
        pytest.param({"flags": 0x01}, id="encrypted"),
    ],
)
def test_local_header_disagreeing_with_the_directory_is_refused(ck: Path, edit: dict) -> None:
    set_local_header(pack_of(ck, W), chunk_member(W), **edit)
    _refused(ck, CorruptCheckpointError, "'model/w'", "local header")


def test_local_header_naming_another_member_is_refused(ck: Path) -> None:
    pack = pack_of(ck, W)
    raw = bytearray(pack.read_bytes())
    off = zipfile.ZipFile(pack).getinfo(chunk_member(W)).header_offset
    name = chunk_member(W).encode()
    assert raw[off + 30 : off + 30 + len(name)] == name
    raw[off + 30 : off + 30 + len(name)] = b"model/x/c.0.0"
    pack.write_bytes(bytes(raw))
    _refused(ck, CorruptCheckpointError, "'model/w'", "names another member")


@functools.lru_cache(maxsize=1)
def _bomb() -> tuple[bytes, int]:
    """A raw deflate stream of 500 MiB (almost all zeros) in about 520 KB: a ratio just under the 1024 that
    tensorstore's zip reader itself refuses, so only arraycheckpoint's checks stand between it and memory."""
    inflated = 500 << 20
    c = zlib_compressor()
    zeros = bytes(50 << 20)
    parts = [c.compress(zeros) for _ in range(9)]
    parts.append(c.compress(bytes(inflated - 9 * len(zeros) - 10_000)))
    parts.append(c.compress(np.random.default_rng(0).integers(0, 256, 10_000, dtype=np.uint8).tobytes()))
    parts.append(c.flush())
    data = b"".join(parts)
    assert inflated / len(data) < 1024, inflated / len(data)
    return data, inflated


def zlib_compressor():  # noqa: ANN201 - zlib's compressobj has no public type
    import zlib

    return zlib.compressobj(9, zlib.DEFLATED, -15)


def _bomb_checkpoints(root: Path) -> tuple[Path, Path, Path]:
    """Three checkpoints of one 512 KiB array (256 x 512 float32, packed): intact, with its chunk member a
    deflate bomb as the central directory declares it (500 MiB), and with the bomb stored in the central
    directory but declared deflated, 500 MiB, in its local header."""
    w = torch.randn(256, 512, generator=torch.Generator().manual_seed(3))
    paths = []
    for name in ("good", "central", "local"):
        p = root / name
        acp.save(p, {"model": {"w": w}})
        paths.append(p)
    data, inflated = _bomb()
    member = chunk_member(W)
    # central: a real deflated member declaring its true 500 MiB size (what zipfile writes for the stream)
    pack = pack_of(paths[1], W)
    items = members(pack)
    tmp = Path(str(pack) + ".tmp")
    with zipfile.ZipFile(tmp, "w") as zf:
        for n, d in items:
            info = zipfile.ZipInfo(n, date_time=(1980, 1, 1, 0, 0, 0))
            if n != member:
                zf.writestr(info, d)
    raw = _append_deflated_member(tmp.read_bytes(), member, data, inflated)
    tmp.unlink()
    pack.write_bytes(raw)
    zi = zipfile.ZipFile(pack).getinfo(member)
    assert zi.compress_type == zipfile.ZIP_DEFLATED and zi.file_size == inflated
    # local: stored in the directory (the member's bytes are the stream), deflate in the local header
    pack = pack_of(paths[2], W)
    assert len(data) <= len(dict(members(pack))[member])
    replace_member(pack, member, data)
    set_local_header(pack, member, method=8, sizes=(len(data), inflated))
    return paths[0], paths[1], paths[2]


def _append_deflated_member(archive: bytes, name: str, stream: bytes, inflated: int) -> bytes:
    """``archive`` (a ZIP file) with one more member ``name`` whose data is the raw deflate ``stream`` that
    decodes to ``inflated`` bytes (zipfile cannot write a stream it did not compress itself)."""
    at = archive.rfind(b"PK\x05\x06")
    _sig, _d, _cd, n_disk, n, cd_size, cd_offset, _c = struct.unpack("<4s4H2LH", archive[at : at + 22])
    body, directory = archive[:cd_offset], archive[cd_offset : cd_offset + cd_size]
    crc = 0  # the CRC-32 of the inflated data: no reader checks it before inflating
    raw_name = name.encode()
    local = struct.pack(
        "<4s5H3L2H", b"PK\x03\x04", 20, 0, 8, 0, 0x21, crc, len(stream), inflated, len(raw_name), 0
    )
    offset = len(body)
    central = struct.pack(
        "<4s6H3L5H2L",
        b"PK\x01\x02",
        20,
        20,
        0,
        8,
        0,
        0x21,
        crc,
        len(stream),
        inflated,
        len(raw_name),
        0,
        0,
        0,
        0,
        0o644 << 16,
        offset,
    )
    body += local + raw_name + stream
    directory += central + raw_name
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, n + 1, n + 1, len(directory), len(body), 0)
    return body + directory + eocd


BOMB_LOAD = """
import resource, sys, torch, arraycheckpoint as acp
good, central, local = sys.argv[1:4]
acp.load(good, {"model": {"w": torch.zeros(256, 512)}})
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
for path in (central, local):
    try:
        acp.load(path, {"model": {"w": torch.zeros(256, 512)}})
        print("LOADED", path)
    except Exception as e:
        print("RAISED", type(e).__name__, str(e).replace("\\n", " ")[:1500])
grown = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base
print("GROWN_KIB", grown)
"""


def test_zip_bombs_are_refused_before_inflating(tmp_path: Path) -> None:
    """A 520 KB member that inflates to 500 MiB, declared by the central directory or only by the local
    header: refused, naming the tensor, and the loading process's peak memory does not grow by the bomb."""
    good, central, local = _bomb_checkpoints(tmp_path)
    proc = run_isolated(BOMB_LOAD.replace("sys.argv[1:4]", repr([str(good), str(central), str(local)])), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.strip().splitlines()
    assert lines[0].startswith("RAISED CorruptCheckpointError") and "compressed" in lines[0], lines[0]
    assert "'model/w'" in lines[0]
    assert lines[1].startswith("RAISED CorruptCheckpointError") and "compression method 8" in lines[1], lines[
        1
    ]
    assert "'model/w'" in lines[1]
    grown = int(lines[2].split()[1])
    assert grown < 100 << 10, f"peak memory grew by {grown} KiB while refusing a 500 MiB bomb"


# The central directory -------------------------------------------------------------------------------------
def test_member_listed_twice_is_refused(ck: Path, tmp_path: Path) -> None:
    """Two members named model/w/c.0.0, each a valid chunk (from two checkpoints): a reader would pick one
    silently. Refused, naming the member."""
    other = tmp_path / "other"
    acp.save(other, {"model": _state(seed=7)})
    foreign = dict(members(pack_of(other, W)))[chunk_member(W)]
    rewrite_pack(pack_of(ck, W), lambda ms: [(n, d) for n, d in ms] + [(chunk_member(W), foreign)])
    _refused(ck, CorruptCheckpointError, "model/w/c.0.0", "twice")


def test_zarr_json_listed_twice_is_refused(ck: Path) -> None:
    rewrite_pack(pack_of(ck, W), lambda ms: ms + [(f"{W}/zarr.json", dict(ms)[f"{W}/zarr.json"])])
    _refused(ck, CorruptCheckpointError, "model/w/zarr.json", "twice")


@pytest.mark.parametrize("member", [chunk_member(W), f"{W}/zarr.json"])
def test_missing_member_is_refused(ck: Path, member: str) -> None:
    delete_member(pack_of(ck, W), member)
    _refused(ck, InconsistentCheckpointError, "'model/w'")
    # the other array of the pack still loads on its own
    got = acp.load(ck, {"model": {"b": torch.zeros(32)}}, strict=False)
    assert torch.equal(got["model"]["b"], _state()["b"])


@pytest.mark.parametrize(
    "extra",
    [
        "model/w/c.0.1",  # a chunk outside the 1 x 1 grid
        "model/w/c.1.0",
        "model/w/c.0",  # the wrong number of dimensions
        "model/w/c.00.0",  # not the canonical key: a reader looking for c.0.0 would not find it
        "model/b/c.1",  # outside the grid of the other array of the pack
        "model/ghost/c.0",  # an array the metadata does not have
        "notes.txt",
    ],
)
def test_extra_member_is_refused(ck: Path, extra: str) -> None:
    """Without the check these load fine; a pack holds exactly what its arrays declare."""
    rewrite_pack(pack_of(ck, W), lambda ms: ms + [(extra, b"\0" * 64)])
    _refused(ck, CorruptCheckpointError, extra, "none of its arrays has")


def test_chunk_member_larger_than_its_encoding_is_refused(ck: Path) -> None:
    member = chunk_member(W)
    data = dict(members(pack_of(ck, W)))[member]
    assert len(data) == 64 * 32 * 4 + 20 + 4  # data, crc32c of the one inner chunk, index and its crc32c
    replace_member(pack_of(ck, W), member, data[:100] + b"\0" + data[100:])
    _refused(ck, CorruptCheckpointError, "'model/w'", "more than its encoding can be")


def test_zarr_json_member_above_its_limit_is_refused(ck: Path) -> None:
    """A valid zarr.json padded with whitespace beyond 64 KiB: it would parse and pass the cross-check."""
    doc = f"{W}/zarr.json"
    raw = dict(members(pack_of(ck, W)))[doc]
    padded = raw + b" " * (bounds.MAX_PACKED_JSON_BYTES + 1 - len(raw))
    assert json.loads(padded) == json.loads(raw)
    replace_member(pack_of(ck, W), doc, padded)
    _refused(ck, CorruptCheckpointError, "'model/w'", "model/w/zarr.json", "more than its encoding")


def test_pack_larger_than_its_arrays_can_be_is_refused(ck: Path) -> None:
    rewrite_pack(pack_of(ck, W), lambda ms: ms + [("model/pad", b"\0" * (2 << 20))])
    _refused(ck, CorruptCheckpointError, "'model/w'", "0.0.zip", "larger than its arrays can be stored in")


def test_directory_with_more_entries_than_members_is_refused_before_reading_it(ck: Path) -> None:
    """The end record claims 2^40 entries in a zip64 record (tensorstore reserves memory for as many as the
    record says): refused from the record alone."""
    pack = pack_of(ck, W)
    pack.write_bytes(_as_zip64(pack.read_bytes(), entries=1 << 40))
    _refused(ck, CorruptCheckpointError, "0.0.zip", "cannot fit")


def test_zip64_pack_is_read(ck: Path) -> None:
    """The same pack with zip64 end records (what zipfile writes for a pack of more than 65,535 members)
    loads bit-exactly: the strict layout check accepts what a save can write."""
    pack = pack_of(ck, W)
    pack.write_bytes(_as_zip64(pack.read_bytes()))
    got = acp.load(ck, _zeros())
    assert torch.equal(got["model"]["w"], _state()["w"])


def _as_zip64(raw: bytes, entries: int | None = None) -> bytes:
    """``raw`` with its end record replaced by a zip64 record, its locator, and an end record deferring to
    them (``entries``: the count the records claim)."""
    at = raw.rfind(b"PK\x05\x06")
    _sig, _d, _cd, _nd, n, cd_size, cd_offset, _c = struct.unpack("<4s4H2LH", raw[at : at + 22])
    n = n if entries is None else entries
    record = struct.pack("<4sQ2H2L4Q", b"PK\x06\x06", 44, 45, 45, 0, 0, n, n, cd_size, cd_offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, at, 1)
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, 0xFFFF, 0xFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0)
    return raw[:at] + record + locator + eocd


@pytest.mark.parametrize(
    "damage",
    [
        "garbage",
        "json",
        "empty",
        "cut-half",
        "cut-last-byte",
        "cut-end-record",
        "cut-to-directory",
        "appended",
        "prepended",
        "comment",
        "count-off",
        "directory-offset-off",
        "gap-before-end-record",
    ],
)
def test_pack_that_is_no_zip_as_a_save_writes_is_refused(ck: Path, damage: str) -> None:
    pack = pack_of(ck, W)
    raw = pack.read_bytes()
    at = raw.rfind(b"PK\x05\x06")
    cd_offset = struct.unpack("<L", raw[at + 16 : at + 20])[0]
    n = struct.unpack("<H", raw[at + 10 : at + 12])[0]
    forged = {
        "garbage": np.random.default_rng(1).integers(0, 256, len(raw), dtype=np.uint8).tobytes(),
        "json": b'{"zarr_format": 3}',
        "empty": b"",
        "cut-half": raw[: len(raw) // 2],
        "cut-last-byte": raw[:-1],
        "cut-end-record": raw[:at],
        "cut-to-directory": raw[:cd_offset],
        "appended": raw + b"\0" * 100,
        "prepended": b"\0" * 100 + raw,  # Python's zipfile shifts every offset by 100; tensorstore does not
        "comment": set_eocd(raw, comment_length=5) + b"hello",
        "count-off": set_eocd(raw, entries=n - 1),
        "directory-offset-off": set_eocd(raw, cd_offset=cd_offset - 1),
        # bytes no record accounts for, between the directory and its end record: readers disagree on them
        "gap-before-end-record": raw[:at] + b"\0" * 16 + raw[at:],
    }[damage]
    pack.write_bytes(forged)
    _refused(ck, CorruptCheckpointError, "'model/w'", str(pack))


def test_member_name_with_nul_is_refused(ck: Path) -> None:
    """Python's zipfile cuts a name at NUL, tensorstore does not: a name with NUL could be one member to a
    check written with zipfile and another to the reader. Refused."""
    pack = pack_of(ck, B)
    raw = pack.read_bytes()
    name = chunk_member(B, (0,)).encode()
    assert raw.count(name) == 2  # local header and central directory
    pack.write_bytes(raw.replace(name, b"model/b/c\x000"))
    _refused(ck, CorruptCheckpointError, "NUL")


# Files, links and FIFOs ----------------------------------------------------------------------------------
def test_symlinked_pack_is_refused(ck: Path, tmp_path: Path) -> None:
    pack = pack_of(ck, W)
    elsewhere = tmp_path / "elsewhere.zip"
    pack.rename(elsewhere)
    pack.symlink_to(elsewhere)
    _refused(ck, CorruptCheckpointError, "'model/w'", "link")


def test_symlinked_pack_directory_is_refused(ck: Path, tmp_path: Path) -> None:
    """``.acp/packs`` replaced by a link to a directory elsewhere holding the very same packs."""
    packs = ck / ".acp" / "packs"
    elsewhere = tmp_path / "elsewhere"
    shutil.copytree(packs, elsewhere)
    shutil.rmtree(packs)
    packs.symlink_to(elsewhere, target_is_directory=True)
    _refused(ck, CorruptCheckpointError, "'model/w'", "symlink")


def test_fifo_pack_is_refused_without_blocking(ck: Path) -> None:
    """A FIFO where the pack was: opening it for reading without O_NONBLOCK would wait for a writer forever
    (a helper plays that writer after 20 s, so that a regression fails instead of hanging)."""
    pack = pack_of(ck, W)
    pack.unlink()
    os.mkfifo(pack)
    with rescuing_fifo(pack) as rescued:
        _refused(ck, CorruptCheckpointError, "'model/w'", "not a regular file")
    assert not rescued.is_set(), "the load blocked opening a FIFO pack"


def test_missing_pack_is_refused(ck: Path) -> None:
    pack_of(ck, W).unlink()
    _refused(ck, InconsistentCheckpointError, "'model/w'", "is missing")


# The metadata's pack entry ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "value",
    [
        "../x.zip",
        "/etc/x.zip",
        ".acp/packs/99999.0.zip",  # a rank beyond the world size (1)
        ".acp/packs/1.0.zip",
        ".acp/packs/../../x.zip",
        ".acp/packs/0.0.zip/../0.0.zip",
        ".acp/packs/00.0.zip",
        ".acp/packs/-1.0.zip",
        "model/w/c.0.0",
        ".acp/metadata.json",
        "",
        5,
        ["x"],
    ],
)
def test_metadata_pack_outside_the_pack_directory_is_refused(ck: Path, value: object) -> None:
    edit_metadata(str(ck), lambda d: d["tensors"][W].update(pack=value))
    with pytest.raises(MetadataError, match="pack"):
        acp.read_metadata(ck)
    _refused(ck, MetadataError, "pack")


def test_metadata_naming_a_pack_file_in_format6_is_refused(ck: Path) -> None:
    """Format 6 names the rank whose packs hold an array (``.acp/packs/<rank>``), never a pack file: a format-5
    pack key, or a rank outside the world, is refused before anything is read."""
    for value in (".acp/packs/0.0.zip", ".acp/packs/1", ".acp/packs/0/x"):
        edit_metadata(str(ck), lambda d, v=value: d["tensors"][W].update(pack=v))
        _refused(ck, MetadataError, "'model/w'", value, target={"model": {"w": torch.zeros(64, 32)}})


def test_metadata_moving_an_array_into_a_pack_that_lacks_it_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    options = acp.PlanOptions(min_chunk_bytes=1 << 20)  # model/big's one chunk (2.4 MB) has its own file
    acp.save(path, {"model": {"w": torch.ones(4, 4), "big": torch.zeros(600, 1000)}}, plan_options=options)
    assert pack_key(path, "model/big") is None
    edit_metadata(str(path), lambda d: d["tensors"]["model/big"].update(pack=".acp/packs/0"))
    with pytest.raises(InconsistentCheckpointError, match="model/big"):
        acp.load(path, {"model": {"w": torch.zeros(4, 4), "big": torch.zeros(600, 1000)}})


# What the checks do not catch ------------------------------------------------------------------------------
def test_pack_swapped_with_another_checkpoints_pack_is_not_detected(ck: Path, tmp_path: Path) -> None:
    """A documented limit (docs/security.md): a pack of another checkpoint with the same arrays, shapes and
    types is well-formed and its crc32c checksums hold, so it loads, with the other checkpoint's values.
    Checksums detect damage, not substitution; this test pins the behaviour the document describes."""
    other = tmp_path / "other"
    acp.save(other, {"model": _state(seed=9)})
    shutil.copyfile(pack_of(other, W), pack_of(ck, W))
    got = acp.load(ck, _zeros())
    assert torch.equal(got["model"]["w"], _state(seed=9)["w"])


# memory:// (the object-store branch: ranged reads, no file) -------------------------------------------------
def _memory_checkpoint(tag: str, state: dict[str, torch.Tensor]) -> tuple[str, object, str, str]:
    import arraycheckpoint.storage.memory  # noqa: F401 - registers memory://
    from arraycheckpoint.storage import storage_for

    url = f"memory://hostile-packs/{tag}-{os.getpid()}-{np.random.default_rng().integers(1 << 30)}"
    acp.save(url, {"model": state})
    storage, root = storage_for(url)
    meta = acp.read_metadata(url)
    assert meta.tensors[W].pack_rank == 0
    return url, storage, root, ".acp/packs/0.0.zip"  # format 6: rank 0's first (and only) pack


def _edit_memory_pack(storage: object, root: str, key: str, edit) -> None:  # noqa: ANN001
    """Apply ``edit(path)`` (a packtools edit of a file) to the pack object ``key``."""
    raw = storage.read(root, key)  # type: ignore[attr-defined]
    assert raw is not None
    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "pack.zip"
        p.write_bytes(raw)
        edit(p)
        storage.write(root, key, p.read_bytes())  # type: ignore[attr-defined]


def test_memory_pack_bomb_is_refused() -> None:
    url, storage, root, key = _memory_checkpoint("bomb", _state())

    def bomb(p: Path) -> None:
        write_members(p, members(p), compression=lambda n: 8 if n == chunk_member(W) else 0)

    _edit_memory_pack(storage, root, key, bomb)
    with pytest.raises(CorruptCheckpointError, match="compressed") as info:
        acp.load(url, _zeros())
    assert "'model/w'" in str(info.value)


def test_memory_pack_local_header_deflate_is_refused() -> None:
    url, storage, root, key = _memory_checkpoint("local", _state())

    def local(p: Path) -> None:
        original = dict(members(p))[chunk_member(W)]
        squeezed = deflate_raw(original)
        set_local_header(p, chunk_member(W), method=8, sizes=(len(squeezed), len(original)), data=squeezed)

    _edit_memory_pack(storage, root, key, local)
    with pytest.raises(CorruptCheckpointError, match="compression method 8"):
        acp.load(url, _zeros())


def test_memory_pack_missing_member_is_refused() -> None:
    url, storage, root, key = _memory_checkpoint("missing", _state())
    _edit_memory_pack(storage, root, key, lambda p: delete_member(p, chunk_member(W)))
    with pytest.raises(InconsistentCheckpointError, match="'model/w'"):
        acp.load(url, _zeros())
    got = acp.load(url, {"model": {"b": torch.zeros(32)}}, strict=False)
    assert torch.equal(got["model"]["b"], _state()["b"])


def test_memory_pack_larger_than_the_first_read_is_checked_with_ranged_reads() -> None:
    """A pack of 1.2 MB (more than the first, suffix read of 256 KiB): intact, it loads bit-exactly; with the
    local header of a member far from the end saying deflate, it is refused, both when one array is read
    (its local headers fetched by small ranged reads) and when all are (the pack fetched once: cheaper than
    six ranged reads of up to 256 KiB each)."""
    g = torch.Generator().manual_seed(4)
    state = {"a": torch.randn(400, 256, generator=g), "w": torch.randn(400, 256, generator=g)}
    state["z"] = torch.randn(400, 256, generator=g)
    url, storage, root, key = _memory_checkpoint("ranged", state)
    raw = storage.read(root, key)  # type: ignore[attr-defined]
    assert 4 * (256 << 10) < len(raw) < 6 * (256 << 10)
    got = acp.load(url, {"model": {k: torch.zeros(400, 256) for k in state}})
    assert all(torch.equal(got["model"][k], v) for k, v in state.items())
    one = acp.load(url, {"model": {"a": torch.zeros(400, 256)}}, strict=False)
    assert torch.equal(one["model"]["a"], state["a"])

    def local(p: Path) -> None:
        member = "model/a/c.0.0"
        assert zipfile.ZipFile(p).getinfo(member).header_offset < len(raw) - (256 << 10)
        set_local_header(p, member, method=8)

    _edit_memory_pack(storage, root, key, local)
    for target, strict in [
        ({"a": torch.zeros(400, 256)}, False),
        ({k: torch.zeros(400, 256) for k in state}, True),
    ]:
        with pytest.raises(CorruptCheckpointError, match="compression method 8") as info:
            acp.load(url, {"model": target}, strict=strict)
        assert "model/a/c.0.0" in str(info.value) and "'model/a'" in str(info.value)


def test_memory_pack_with_a_directory_beyond_the_first_read_loads() -> None:
    """Thousands of packed arrays with long names: the central directory is larger than the first read, so
    it is fetched with a second ranged read; everything loads bit-exactly."""
    g = torch.Generator().manual_seed(5)
    prefix = "layer_with_a_rather_long_descriptive_name_to_grow_the_directory"
    state = {f"{prefix}_{i:04d}": torch.randn(2, generator=g) for i in range(2500)}
    url = f"memory://hostile-packs/many-{os.getpid()}"
    acp.save(url, {"model": state})
    meta = acp.read_metadata(url)
    assert {t.pack_rank for t in meta.tensors.values()} == {0}
    got = acp.load(url, {"model": {k: torch.zeros(2) for k in state}})
    assert all(torch.equal(got["model"][k], v) for k, v in state.items())
