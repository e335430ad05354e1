"""Packed chunks are read by the engine itself (arraycheckpoint.engine.packread over chunkread.read_shard): one
``preadv`` per member read whole (its local header, the inner chunks straight into the destination, their
crc32c and the index), the index first for part of a member, one ranged read per member from an object
store. They must give the same bits, partial regions and arrays spread over several writers' packs included;
a flipped byte is found by crc32c; a format-5 member in any other layout falls back to tensorstore, a
format-6 one is damage."""

from __future__ import annotations

import os
import shutil
import zipfile

import ml_dtypes
import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.engine import chunkread, packread, shardfile
from arraycheckpoint.errors import CorruptCheckpointError
from arraycheckpoint.planning.items import LoadShard, LoadTensor
from arraycheckpoint.planning.regions import Box


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "w": rng.standard_normal((48, 40)).astype(np.float32),  # several chunks and inner chunks (options)
        "b": rng.standard_normal(40).astype(ml_dtypes.bfloat16),
        "i": rng.integers(-(2**62), 2**62, size=(5, 3), dtype=np.int64),
        "flag": np.array([True, False, True]),
        "scalar": np.float64(2.5),
        "empty": np.zeros((0, 4), np.float32),
    }


# small chunk grids so that a packed array has several chunks, each of several inner chunks
OPTIONS = acp.PlanOptions(min_chunk_bytes=1 << 11, max_chunk_bytes=1 << 11, inner_chunk_bytes=1 << 9)


def _save(tmp_path) -> str:
    ck = str(tmp_path / "ck")
    acp.save(ck, {"extra_state": _state()}, plan_options=OPTIONS)
    meta = acp.read_metadata(ck)
    w = meta.tensors["extra_state/w"]
    assert w.pack is not None and len(w.writers) > 1 and w.chunk_shape != w.inner_chunk_shape
    return ck


def _load(ck: str) -> dict[str, np.ndarray]:
    target = {k: np.zeros_like(v) if v.ndim else np.float64(0) for k, v in _state().items()}
    return acp.load(ck, {"extra_state": target})["extra_state"]


def _same(got: dict, want: dict) -> None:
    for k, v in want.items():
        g = np.asarray(got[k])
        assert g.dtype == np.asarray(v).dtype and g.shape == np.shape(v), k
        assert np.asarray(v).tobytes() == g.tobytes(), k


def _read_phase(report: dict) -> dict:
    (read,) = [p for p in report["metrics"] if p["phase"] == "read"]
    return read


def test_packed_arrays_are_decoded_by_the_engine_bit_exactly(tmp_path, monkeypatch) -> None:
    ck = _save(tmp_path)
    calls = []
    real = packread.PackedReader.deliver_many
    monkeypatch.setattr(
        packread.PackedReader,
        "deliver_many",
        lambda self, ts: calls.extend(t.name for t in ts) or real(self, ts),
    )
    _same(_load(ck), _state())
    assert {"extra_state/w", "extra_state/b", "extra_state/i", "extra_state/flag"} <= set(calls)


def test_whole_members_go_straight_into_the_tensors_with_one_preadv_each(tmp_path, monkeypatch) -> None:
    """torch targets of the stored dtype: every inner chunk inside the array lands in the tensor itself (only
    the padded edge chunk's go through the staging buffer), one ``preadv`` per member read."""
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(48, 40, generator=g), "v": torch.randn(7, generator=g)}
    ck = tmp_path / "ck"
    acp.save(ck, {"model": state}, plan_options=OPTIONS)
    meta = acp.read_metadata(ck)
    chunks = sum(len(meta.tensors[f"model/{k}"].writers) for k in state)
    assert all(meta.tensors[f"model/{k}"].pack_rank == 0 for k in state)
    fds: list[int] = []
    real_init = packread.PackFile.__init__

    def init(self, *a):
        real_init(self, *a)
        fds.append(self._fd)

    monkeypatch.setattr(packread.PackFile, "__init__", init)
    preadv, pread = [], []
    real_preadv, real_pread = os.preadv, os.pread
    monkeypatch.setattr(
        os, "preadv", lambda fd, *a: (fd in fds and preadv.append(a[1])) or real_preadv(fd, *a)
    )
    monkeypatch.setattr(os, "pread", lambda fd, *a: (fd in fds and pread.append(a[1])) or real_pread(fd, *a))
    dest = {k: torch.full_like(v, -1) for k, v in state.items()}
    report: dict = {}
    acp.load(ck, {"model": dest}, report=report)
    for k, v in state.items():
        assert torch.equal(dest[k].view(torch.int32), v.view(torch.int32)), k
    # at most one preadv per chunk member and one for the arrays' zarr.json (small members and documents
    # come through the pack's read-ahead window); no separate read of an index or a local header
    assert len(preadv) <= chunks + 1 and not pread, (preadv, pread)
    read = _read_phase(report)
    total = sum(v.numel() * v.element_size() for v in state.values())
    assert read["direct"] >= total // 2 and read["direct"] + read["scratch"] >= total, read


@pytest.mark.parametrize("block", [None, 100])
def test_partial_regions_of_packed_chunks_are_read_bit_exactly(tmp_path, block, monkeypatch) -> None:
    """Regions that cut through chunks and inner chunks (two of them overlapping, one strided, one with no
    target) get exactly their bytes (checked against numpy); also read in blocks of 100 bytes (each inner
    chunk of 512 bytes in several ``preadv`` calls, checksummed block by block)."""
    if block is not None:
        monkeypatch.setattr(chunkread, "_BLOCK", block)
    from arraycheckpoint.engine import engine
    from arraycheckpoint.planning.items import LoadShard, LoadTensor
    from arraycheckpoint.planning.regions import Box
    from arraycheckpoint.storage import storage_for

    ck = _save(tmp_path)
    storage, root = storage_for(ck)
    meta = acp.read_metadata(ck)
    w = _state()["w"]
    got = {}
    boxes = [Box((3, 5), (17, 30)), Box((10, 0), (20, 40)), Box((40, 0), (8, 40)), Box((0, 39), (48, 1))]
    targets = [np.full(b.lengths, -1.0, np.float32) for b in boxes]
    wide = np.full((48, 80), -1.0, np.float32)
    targets[2] = wide[40:48, 20:60]  # strided: each inner chunk goes through the staging buffer
    shards = [LoadShard(b, lambda a, b=b: got.__setitem__(b, a), target=t) for b, t in zip(boxes, targets)]
    sink_box = Box((7, 2), (33, 21))
    shards.append(LoadShard(sink_box, lambda a: got.__setitem__(sink_box, a.copy())))
    engine().load(storage, root, meta, [LoadTensor("extra_state/w", shards)])
    for b, t in zip(boxes, targets):
        assert np.array_equal(t, w[b.slices()]), b
    assert (wide[:40] == -1).all() and (wide[:, :20] == -1).all() and (wide[:, 60:] == -1).all()
    assert np.array_equal(got[sink_box], w[sink_box.slices()])


def test_a_format5_member_in_another_layout_falls_back_to_tensorstore(tmp_path, monkeypatch) -> None:
    """Format 5 (the fixture written by f62d3f0): a member the engine does not decode goes to tensorstore."""
    from fixtures.make_format2 import full_state
    from test_format5_compat import _expected, _load_single
    from test_format5_compat import _same as same5

    src = os.path.join(os.path.dirname(__file__), "fixtures", "format5", "single")
    shutil.copytree(src, tmp_path / "single")
    monkeypatch.setattr(packread.PackFile, "read_chunk", lambda *a: None)  # "not the layout a save writes"
    model, opt, _extra = _load_single(tmp_path / "single")
    same5(full_state(model, opt), _expected("single"))


def test_a_format6_member_in_another_layout_is_damage(tmp_path, monkeypatch) -> None:
    ck = _save(tmp_path)
    monkeypatch.setattr(packread.PackFile, "read_chunk", lambda *a: None)
    with pytest.raises(CorruptCheckpointError, match="not the chunk file a save writes"):
        _load(ck)


def test_short_member_is_not_decoded() -> None:
    """A member whose size is not the exact uncompressed encoding is not decoded (False)."""
    from arraycheckpoint.planning.regions import Box

    class T:
        dtype, chunk_shape, inner_chunk_shape = "int64", (5, 3), (5, 3)

    out = np.zeros((5, 3), np.int64)
    lay = packread._Layout(T)
    raw = np.zeros(7, np.uint8)
    assert not packread.decode_into(raw, lay, (0, 0), [(Box((0, 0), (5, 3)), out)], ValueError)


# read_shard itself: a chunk file [8, 6] float32 in inner chunks [2, 6] (4 of them), at an offset ---------
class _T:
    dtype, chunk_shape, inner_chunk_shape = "float32", (8, 6), (2, 6)


def _chunk_file(value: np.ndarray) -> bytes:
    return b"".join(bytes(p) for p in shardfile.encode(value, _T.inner_chunk_shape))


@pytest.fixture(params=["file", "memory"])
def source(request, tmp_path):
    """``(make(raw) -> (src, at), value)``: the chunk file 100 bytes into a file, or into bytes in memory."""
    value = np.arange(48, dtype=np.float32).reshape(8, 6) * 1.5
    fds = []

    def make(raw: bytes):
        blob = b"x" * 100 + raw + b"y" * 7
        if request.param == "memory":
            return np.frombuffer(blob, np.uint8), 100
        path = tmp_path / f"f{len(fds)}"
        path.write_bytes(blob)
        fds.append(os.open(path, os.O_RDONLY))
        return fds[-1], 100

    yield make, value
    for fd in fds:
        os.close(fd)


def _read(src, at, raw, dests, lead=None, origin=(8, 0)):
    lay = chunkread.ShardLayout(_T)
    return chunkread.read_shard(
        src, at, len(raw), lay, origin, dests, chunkread.Staging(), CorruptCheckpointError, lead
    )


def test_read_shard_whole_partial_and_strided(source) -> None:
    make, value = source
    raw = _chunk_file(value)
    src, at = make(raw)
    whole = np.full((8, 6), -1, np.float32)
    assert _read(src, at, raw, [(Box((8, 0), (8, 6)), whole)]) == (value.nbytes, 0)
    assert np.array_equal(whole, value)
    # the chunk is rows 8..16 of a [16, 6] array: a destination of rows 9..14, columns 1..6 (partial inner
    # chunks: staged), another of rows 10..14 whole (contiguous whole inner chunks: direct)
    part = np.full((5, 5), -1, np.float32)
    rows = np.full((4, 6), -1, np.float32)
    got = _read(src, at, raw, [(Box((9, 1), (5, 5)), part), (Box((10, 0), (4, 6)), rows)])
    assert got is not None and got[0] == rows.nbytes, got
    assert np.array_equal(part, value[1:6, 1:6]) and np.array_equal(rows, value[2:6])
    strided = np.full((8, 12), -1, np.float32)
    _read(src, at, raw, [(Box((8, 0), (8, 6)), strided[:, ::2])])
    assert np.array_equal(strided[:, ::2], value) and (strided[:, 1::2] == -1).all()


def test_read_shard_bounds_its_staging_buffer(source, monkeypatch) -> None:
    """Inner chunks no destination takes whole are staged at most ``_MAX_STAGING`` bytes per read (the reads
    are split), so a reader thread's staging buffer stays bounded whatever the chunk."""
    make, value = source
    raw = _chunk_file(value)
    src, at = make(raw)
    monkeypatch.setattr(chunkread, "_MAX_STAGING", 2 * 48)  # two inner chunks of [2, 6] float32
    staging = chunkread.Staging()
    out = np.full((8, 12), -1, np.float32)
    lay = chunkread.ShardLayout(_T)
    dests = [(Box((8, 0), (8, 6)), out[:, 3:9])]  # strided: every inner chunk staged
    got = chunkread.read_shard(src, at, len(raw), lay, (8, 0), dests, staging, CorruptCheckpointError)
    assert got == (0, value.nbytes) and np.array_equal(out[:, 3:9], value)
    assert (out[:, :3] == -1).all() and (out[:, 9:] == -1).all()
    assert isinstance(src, np.ndarray) or staging._buf.nbytes <= 2 * 48


def test_read_shard_checksums_each_block_right_after_it_lands(source, monkeypatch) -> None:
    """One pass over the bytes: each ``preadv`` reads at most a block of data (``_BLOCK``: a part of an inner
    chunk, or several with their checksums) and its bytes are checksummed before the next read; from memory
    each block is copied then checksummed. Whole, partial and strided (staged) reads stay bit-exact."""
    make, value = source
    raw = _chunk_file(value)
    src, at = make(raw)
    monkeypatch.setattr(chunkread, "_BLOCK", 20)  # inner chunks of [2, 6] float32: 48 bytes, 3 blocks each
    events: list[tuple[str, int]] = []
    real_preadv, real_extend = os.preadv, chunkread.crc_extend
    monkeypatch.setattr(
        os,
        "preadv",
        lambda fd, bufs, o: events.append(("read", sum(map(len, bufs)))) or real_preadv(fd, bufs, o),
    )
    monkeypatch.setattr(
        chunkread, "crc_extend", lambda c, b: events.append(("crc", len(b))) or real_extend(c, b)
    )
    whole = np.full((8, 6), -1, np.float32)
    strided = np.full((8, 12), -1, np.float32)
    part = np.full((3, 6), -1, np.float32)
    for box, out in (
        (Box((8, 0), (8, 6)), whole),
        (Box((8, 0), (8, 6)), strided[:, ::2]),
        (Box((11, 0), (3, 6)), part),
    ):
        events.clear()
        assert _read(src, at, raw, [(box, out)]) is not None
        assert np.array_equal(out, value[box.slices(Box((8, 0), (8, 6)))])
        crcs = [n for kind, n in events if kind == "crc"]
        assert max(crcs) <= 20 and sum(crcs) == 48 * len(
            {r // 2 for r in range(box.offsets[0] - 8, box.offsets[0] - 8 + box.lengths[0])}
        )
        if isinstance(src, int):  # reads and checksums alternate: never two data reads in a row
            kinds = [kind for kind, _n in events]  # (the index of a part is read by ``pread``)
            assert kinds[0] == "read" and all(a != b or a == "crc" for a, b in zip(kinds, kinds[1:])), kinds
            # at most a block and the start of the next (with their checksums) per read; the last also
            # reads the index of a whole file
            reads = [n for kind, n in events if kind == "read"]
            assert len(reads) > 1 and max(reads[:-1]) <= 2 * 20 + 8 and reads[-1] <= 2 * 20 + 8 + 68, reads
    assert (strided[:, 1::2] == -1).all()


def test_a_chunk_inside_one_region_lands_whole_and_is_still_checked(source) -> None:
    """A chunk lying wholly inside one destination's region (an FSDP2 shard of whole chunks) takes the fast
    path (:func:`chunkread._within_one`: no box per inner chunk): every inner chunk straight into its place in
    the larger destination, nothing else touched, every checksum still compared (a flipped byte of any inner
    chunk or of the index is refused); a strided destination or two regions take the general path."""
    make, value = source
    raw = _chunk_file(value)
    lay = chunkread.ShardLayout(_T)
    out = np.full((24, 6), -1, np.float32)
    dests = [(Box((4, 0), (24, 6)), out)]  # the chunk [8, 16) x [0, 6) lies at rows [4, 12) of ``out``
    items = chunkread._within_one(lay, (8, 0), dests)
    assert [i[0] for i in items] == [0, 1, 2, 3] and all(i[3] is not None for i in items)
    assert items[1][3].ctypes.data == out[6:8].ctypes.data  # each inner chunk's place in ``out``
    src, at = make(raw)
    assert _read(src, at, raw, dests) == (value.nbytes, 0)
    assert np.array_equal(out[4:12], value) and (out[:4] == -1).all() and (out[12:] == -1).all()
    wide = [(Box((8, 0), (8, 12)), np.zeros((8, 12), np.float32))]  # inside, but no inner chunk contiguous
    assert not chunkread._within_one(lay, (8, 0), wide)
    strided = np.zeros((8, 12), np.float32)[:, ::2]
    assert not chunkread._within_one(lay, (8, 0), [(Box((8, 0), (8, 6)), strided)])
    assert not chunkread._within_one(lay, (8, 0), [(Box((8, 0), (7, 6)), np.zeros((7, 6), np.float32))])
    two = [(Box((8, 0), (4, 6)), np.zeros((4, 6), np.float32)), (Box((12, 0), (4, 6)), np.zeros((4, 6)))]
    assert not chunkread._within_one(lay, (8, 0), two)
    for at_byte, why in (
        (5, r"inner chunk \[0, 0\]"),
        (3 * 52 + 1, r"inner chunk \[3, 0\]"),
        (48, r"\[0, 0\]"),
    ):
        bad = bytearray(raw)
        bad[at_byte] ^= 0x10
        src, at = make(bytes(bad))
        with pytest.raises(CorruptCheckpointError, match=why):
            _read(src, at, bytes(bad), [(Box((4, 0), (24, 6)), np.zeros((24, 6), np.float32))])


def test_read_shard_finds_every_flipped_byte(source) -> None:
    make, value = source
    raw = _chunk_file(value)
    flips = ((5, r"inner chunk \[0, 0\]"), (52 + 4, r"inner chunk \[1, 0\]"), (len(raw) - 9, "index"))
    for at_byte, why in flips:
        bad = bytearray(raw)
        bad[at_byte] ^= 0x10
        src, at = make(bytes(bad))
        for box in (Box((8, 0), (8, 6)), Box((8, 0), (4, 6))):  # the whole file, or a part (index first)
            with pytest.raises(CorruptCheckpointError, match=why):
                _read(src, at, bytes(bad), [(box, np.zeros(box.lengths, np.float32))])


def test_read_shard_reads_another_order_by_its_index_and_refuses_a_cut_file(source) -> None:
    """A sound index of another order (two inner chunks swapped in the index only) is read as the index says,
    as zarr reads it; a file cut short is damage, or not decoded (None) when not even its index is there."""
    import struct

    make, value = source
    raw = _chunk_file(value)
    n = 4
    step = 2 * 6 * 4 + 4
    entries = list(struct.unpack(f"<{2 * n}Q", raw[n * step : n * step + 16 * n]))
    entries[0], entries[2] = entries[2], entries[0]  # inner chunks 0 and 1 swapped in the index only
    index = struct.pack(f"<{2 * n}Q", *entries)
    other = raw[: n * step] + index + shardfile.crc32c(index).to_bytes(4, "little")
    src, at = make(other)
    out = np.zeros((8, 6), np.float32)
    assert _read(src, at, other, [(Box((8, 0), (8, 6)), out)]) == (value.nbytes, 0)
    assert np.array_equal(out, np.concatenate([value[2:4], value[0:2], value[4:]]))
    src, at = make(raw[:-1])  # its index is not where it should be: damage
    with pytest.raises(CorruptCheckpointError, match="index"):
        _read(src, at, raw[:-1], [(Box((8, 0), (8, 6)), np.zeros((8, 6), np.float32))])
    src, at = make(raw[:10])  # not even an index
    assert _read(src, at, raw[:10], [(Box((8, 0), (8, 6)), np.zeros((8, 6), np.float32))]) is None


def test_read_shard_checks_the_lead_and_follows_an_extra_field(source) -> None:
    """The bytes before the file (a pack member's local header) are read with it and checked first; an extra
    field moves the file's start; a refused lead is no read."""
    make, value = source
    raw = _chunk_file(value)
    src, at = make(b"LEAD" + raw)  # the file really starts 4 bytes later than expected
    seen = []

    def check(head: bytes) -> int | None:
        seen.append(head)
        return 4 if head == b"x" * 6 else None

    out = np.zeros((8, 6), np.float32)
    assert _read(src, at, raw, [(Box((8, 0), (8, 6)), out)], (6, check)) == (value.nbytes, 0)
    assert np.array_equal(out, value) and seen == [b"x" * 6]
    part = np.zeros((3, 6), np.float32)
    assert _read(src, at, raw, [(Box((9, 0), (3, 6)), part)], (6, check)) is not None
    assert np.array_equal(part, value[1:4])
    assert _read(src, at, raw, [(Box((8, 0), (8, 6)), out)], (6, lambda h: None)) is None


def test_pack_member_with_an_extra_field_in_its_local_header(tmp_path) -> None:
    """A member whose local header carries an extra field (zipfile writes one for ZipInfo.extra) is read at
    its real start."""
    value = np.arange(48, dtype=np.float32).reshape(8, 6)
    raw = _chunk_file(value)
    path = tmp_path / "p.zip"
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_STORED) as zf:
        zf.writestr("a/zarr.json", b"{}")
        info = zipfile.ZipInfo("a/c.1.0")
        info.extra = b"\xfe\xca\x04\x00abcd"
        zf.writestr(info, raw)
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: i for i in zf.infolist()}
    pack = packread.PackFile(str(tmp_path), "p.zip", members)
    try:
        out = np.zeros((8, 6), np.float32)
        lay = chunkread.ShardLayout(_T)
        got = pack.read_chunk(
            "a/c.1.0", lay, (8, 0), [(Box((8, 0), (8, 6)), out)], chunkread.Staging(), ValueError
        )
        assert got == (value.nbytes, 0) and np.array_equal(out, value)
        # a member read under another member's name: its local header names the other one
        assert (
            pack.read_chunk(
                "a/zarr.json", lay, (8, 0), [(Box((8, 0), (8, 6)), out)], chunkread.Staging(), ValueError
            )
            is None
        )
    finally:
        pack.close()


# a checkpoint whose arrays' chunks lie in both ranks' packs (2 gloo ranks, replicated state) ---------------
def _replicated() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return {"w": torch.randn(64, 40, generator=g), "h": torch.randn(30, 17, generator=g).to(torch.bfloat16)}


def _save_body(rank: int, world: int, path: str) -> bool:
    acp.save(path, {"model": _replicated()}, plan_options=OPTIONS)
    return True


@pytest.fixture(scope="module")
def two_writers(tmp_path_factory):
    from dist import run_distributed

    path = str(tmp_path_factory.mktemp("packread2") / "ck")
    assert run_distributed(_save_body, world=2, args=(path,)) == [True, True]
    meta = acp.read_metadata(path)
    for name in ("model/w", "model/h"):
        assert meta.tensors[name].pack_rank is not None and set(meta.tensors[name].writers) == {0, 1}, name
    return path


def test_arrays_over_two_writers_packs_load_bit_exactly_whole_and_in_parts(two_writers) -> None:
    from arraycheckpoint.engine import engine
    from arraycheckpoint.storage import storage_for

    want = _replicated()
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    acp.load(two_writers, {"model": dest})
    for k, v in want.items():
        assert torch.equal(dest[k].view(torch.int16), v.view(torch.int16)), k
    storage, root = storage_for(two_writers)
    meta = acp.read_metadata(two_writers)
    box = Box((3, 1), (58, 38))  # every chunk (of both writers), none whole
    out = np.full(box.lengths, -1, np.float32)
    engine().load(storage, root, meta, [LoadTensor("model/w", [LoadShard(box, lambda a: None, target=out)])])
    assert np.array_equal(out, want["w"].numpy()[box.slices()])


def test_object_store_members_load_bit_exactly(two_writers) -> None:
    """The same checkpoint on ``memory://``: each member one ranged read, decoded from those bytes."""
    import arraycheckpoint.storage.memory  # noqa: F401 - registers memory://
    from arraycheckpoint.storage import storage_for

    url = f"memory://packread/{os.getpid()}"
    storage, root = storage_for(url)
    for d, _, fs in os.walk(two_writers):
        for f in fs:
            with open(os.path.join(d, f), "rb") as fh:
                storage.write(root, os.path.relpath(os.path.join(d, f), two_writers), fh.read())
    want = _replicated()
    dest = {"w": torch.zeros(64, 40), "h": torch.zeros(30, 17, dtype=torch.bfloat16)}
    acp.load(url, {"model": dest})
    for k, v in want.items():
        assert torch.equal(dest[k].view(torch.int16), v.view(torch.int16)), k


def test_a_flipped_byte_in_the_second_writers_pack_names_tensor_and_pack(two_writers, tmp_path) -> None:
    import struct

    copy = tmp_path / "ck"
    shutil.copytree(two_writers, copy)
    meta = acp.read_metadata(str(copy))
    t = meta.tensors["model/w"]
    flat = t.writers.index(1)
    grid_cols = -(-40 // t.chunk_shape[1])
    member = "model/w/c." + ".".join(map(str, (flat // grid_cols, flat % grid_cols)))
    holding = [
        (f, zipfile.ZipFile(f).getinfo(member))
        for f in sorted((copy / ".acp" / "packs").iterdir())
        if member in zipfile.ZipFile(f).namelist()
    ]
    ((f, info),) = holding
    assert f.name.startswith("1.")
    raw = bytearray(f.read_bytes())
    (nlen, xlen) = struct.unpack_from("<2H", raw, info.header_offset + 26)
    raw[info.header_offset + 30 + nlen + xlen + 3] ^= 0x01  # inside the first inner chunk's data
    f.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match=rf"'model/w'.*{member}.*{f.name}.*crc32c"):
        acp.load(copy, {"model": {k: torch.zeros_like(v) for k, v in _replicated().items()}})


# the packed zarr.json check -----------------------------------------------------------------------------
@pytest.mark.parametrize("leaf", ["w", 'q"uo\\te', "n\u00e4me.\u4e2d"])
def test_zarr_json_check_accepts_what_a_save_writes_and_checks_the_rest(leaf, monkeypatch) -> None:
    """The cheap path accepts exactly the bytes safety generates for the array (any name); any other document
    goes to safety.check_packed_doc."""
    import json

    from arraycheckpoint.audit import arrays as audit_arrays
    from arraycheckpoint.errors import MetadataError

    class T:
        name, shape, dtype = f"model/{leaf}", (10, 7), "bfloat16"
        chunk_shape, inner_chunk_shape, compression = (4, 7), (2, 7), None

    _doc, exact = audit_arrays._generated(T, ".")
    check = packread._DocCheck(".")
    calls = []
    real = audit_arrays.check_packed_doc
    monkeypatch.setattr(audit_arrays, "check_packed_doc", lambda *a: calls.append(a) or real(*a))
    for _ in range(2):
        check.check(T, exact, "p")
    assert calls == []
    check.check(T, json.dumps(json.loads(exact), indent=1).encode(), "p")  # same document, other bytes
    assert len(calls) == 1
    wrong = json.loads(exact)
    wrong["shape"] = [11, 7]
    with pytest.raises(MetadataError):
        check.check(T, json.dumps(wrong).encode(), "p")
