"""Every byte that lands in a tensor is covered by a crc32c: a byte flipped anywhere in a chunk file, or
anywhere in a whole pack, is either found (an error of ours naming the tensor) or changes nothing that is read
(ZIP fields no reader uses); a load never returns other values silently."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

import arraycheckpoint as acp
from arraycheckpoint.engine import chunkread, shardfile
from arraycheckpoint.errors import ArrayCheckpointError, CorruptCheckpointError
from arraycheckpoint.planning.regions import Box


class _T:
    dtype, chunk_shape, inner_chunk_shape = "float32", (4, 6), (2, 6)


VALUE = (np.arange(24, dtype=np.float32).reshape(4, 6) + 1) * 1.5
#: the whole chunk, a part of it (index first), a strided part (staged), two regions at once
REGIONS = [
    [(Box((4, 0), (4, 6)), None)],
    [(Box((5, 0), (2, 6)), None)],
    [(Box((4, 1), (4, 3)), None)],
    [(Box((4, 0), (1, 6)), None), (Box((6, 0), (2, 6)), None)],
]


def _read_regions(tmp_path, where: str, blob: bytes, size: int):
    """``(regions' destinations, decoded)`` for each of REGIONS, reading a chunk file of ``size`` bytes at
    offset 9 of ``blob`` (from a file or from memory); regions refused as damage or not decoded are left out."""
    if where == "memory":
        src: int | np.ndarray = np.frombuffer(blob, np.uint8)
    else:
        (tmp_path / "f").write_bytes(blob)
        src = os.open(tmp_path / "f", os.O_RDONLY)
    lay = chunkread.ShardLayout(_T)
    out = []
    try:
        for regions in REGIONS:
            dests = [(box, np.full(box.lengths, -7, np.float32)) for box, _ in regions]
            try:
                got = chunkread.read_shard(
                    src, 9, size, lay, (4, 0), dests, chunkread.Staging(), CorruptCheckpointError
                )
            except CorruptCheckpointError:
                continue
            if (
                got is not None
            ):  # None: not decoded (the caller reads it through tensorstore or calls it damage)
                out.append(dests)
    finally:
        if isinstance(src, int):
            os.close(src)
    return out


@pytest.mark.parametrize("where", ["file", "memory"])
@pytest.mark.parametrize("block", [None, 20, 60])
def test_read_shard_every_flipped_byte(tmp_path, where, block, monkeypatch) -> None:
    """Also with blocks (read and checksummed together) of a part of an inner chunk (20 bytes of 48) and of
    several inner chunks (60 bytes: two inner chunks and their checksums per ``preadv``)."""
    if block is not None:
        monkeypatch.setattr(chunkread, "_BLOCK", block)
    raw = b"".join(bytes(p) for p in shardfile.encode(VALUE, _T.inner_chunk_shape))
    lay = chunkread.ShardLayout(_T)
    assert len(raw) == lay.nbytes
    sound = _read_regions(tmp_path, where, b"h" * 9 + raw, len(raw))
    assert len(sound) == len(REGIONS)  # every region of the sound file decoded, bit-exact
    for dests in sound:
        for box, out in dests:
            assert np.array_equal(out, VALUE[box.slices(Box((4, 0), (4, 6)))]), box
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        for dests in _read_regions(tmp_path, where, b"h" * 9 + bytes(bad), len(raw)):
            for box, out in dests:  # decoded: then exactly the stored values
                assert np.array_equal(out, VALUE[box.slices(Box((4, 0), (4, 6)))]), (i, box)


def test_load_every_flipped_byte_of_a_pack(tmp_path) -> None:
    """One small packed array (a pack of a few hundred bytes besides its zarr.json): every byte flipped in
    turn, the load of the whole array and of a part of it either fails with our error or is bit-exact."""
    ck = tmp_path / "ck"
    w = (np.arange(4 * 6, dtype=np.float32).reshape(4, 6) + 1) * 0.25
    opts = acp.PlanOptions(min_chunk_bytes=1 << 12, max_chunk_bytes=1 << 12, inner_chunk_bytes=48)
    acp.save(ck, {"extra_state": {"w": w}}, plan_options=opts)
    packs = ck / ".acp" / "packs"
    (name,) = os.listdir(packs)
    pack = packs / name
    raw = pack.read_bytes()
    found = silent = 0
    for i in range(len(raw)):
        bad = bytearray(raw)
        bad[i] ^= 0x01
        os.chmod(pack, 0o644)
        pack.write_bytes(bytes(bad))
        try:
            got = acp.load(ck, {"extra_state": {"w": np.zeros_like(w)}})["extra_state"]["w"]
        except ArrayCheckpointError as e:
            assert "extra_state/w" in str(e) or name in str(e), (i, e)
            found += 1
            continue
        assert np.array_equal(got, w), f"byte {i} of {name} flipped: the load returned other values"
        silent += 1
    pack.write_bytes(raw)
    print(f"{name}: {len(raw)} bytes, {found} flips found, {silent} changed nothing read")
    assert found > silent  # nearly every byte matters
    shutil.rmtree(ck)


def _with_index(raw: bytes, edit) -> bytes:
    """``raw`` with its shard index edited by ``edit(entries)`` and a matching crc32c (a forger's index)."""
    import struct

    n = 2
    table = 16 * n + 4
    entries = list(struct.unpack(f"<{2 * n}Q", raw[-table:-4]))
    edit(entries)
    index = struct.pack(f"<{2 * n}Q", *entries)
    return raw[:-table] + index + shardfile.crc32c(index).to_bytes(4, "little")


@pytest.mark.parametrize(
    "edit",
    [
        lambda e: e.__setitem__(2, e[0]),  # both inner chunks at the same bytes (overlapping)
        lambda e: e.__setitem__(2, 2**64 - 8),  # far past the file (no wrap-around)
        lambda e: e.__setitem__(3, 2**64 - 1),  # a huge size
        lambda e: e.__setitem__(2, e[2] + 40),  # into the index itself
        lambda e: e.__setitem__(1, 0),  # an empty inner chunk
        lambda e: e.__setitem__(0, 2**63),  # "missing" is not what a save writes either
    ],
)
@pytest.mark.parametrize("where", ["file", "memory"])
def test_read_shard_forged_index(tmp_path, where, edit) -> None:
    """A shard index with a valid crc32c but entries out of range, overlapping or huge: read as it says only
    when every inner chunk read lies inside the file at its exact size and passes its own crc32c (the values
    are then those bytes, as zarr reads them); else not decoded (None) or damage, never a read or write out
    of bounds."""
    raw = _with_index(b"".join(bytes(p) for p in shardfile.encode(VALUE, _T.inner_chunk_shape)), edit)
    for dests in _read_regions(tmp_path, where, b"h" * 9 + raw + b"t" * 64, len(raw)):
        for box, out in dests:  # decoded: each value is one of the stored inner chunks' values
            assert np.isin(out, VALUE).all(), box
