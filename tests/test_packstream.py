"""Packs streamed member by member (``engine/packstream.py``): a member's bytes are in its pack file before the
pack's last member is encoded, in any order of arrival, on the writer's threads; the file is zipfile's bytes
for the same members; a failed or abandoned pack leaves no file and no descriptor, and a save that failed
while writing a pack commits nothing and can be retried."""

from __future__ import annotations

import errno
import io
import os
import random
import threading
import zipfile
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.codecs import crc
from arraycheckpoint.engine import packfile, packstream, packwrite, shardfile, summed
from arraycheckpoint.errors import ArrayCheckpointError, SaveFailedError


def _members(count: int = 40) -> list[packfile.Member]:
    rng = np.random.default_rng(3)
    out: list[packfile.Member] = [("model/a/zarr.json", [b'{"zarr_format": 3}'])]
    for i in range(count):
        rows = int(rng.integers(1, 64))
        out.append(
            (
                f"model/t{i}/c.0.0",
                shardfile.encode(rng.standard_normal((rows, 32)).astype(np.float32), (rows, 32)),
            )
        )
    out.append(("model/empty/c.0", [b""]))
    return out


def _reference(members: list[packfile.Member]) -> bytes:
    buf = io.BytesIO()
    packfile.write_zip(buf, members)
    return buf.getvalue()


def _sizes(members: list[packfile.Member]) -> list[tuple[str, int]]:
    return [
        (key, sum(p.nbytes if isinstance(p, np.ndarray) else len(p) for p in parts)) for key, parts in members
    ]


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("batch", [1, 1 << 12, 1 << 30])
def test_members_in_any_order_on_the_writers_threads_give_zipfiles_bytes(
    tmp_path: Path, monkeypatch, batch
) -> None:
    monkeypatch.setattr(packstream, "BATCH_BYTES", batch)
    members = _members()
    writer = shardfile.FileWriter(str(tmp_path / "ck"), threads=3)
    pack = writer.open_pack(".acp/packs/0.0.zip", _sizes(members))
    order = list(range(len(members)))
    random.Random(5).shuffle(order)
    futures = [pack.add(i, members[i][1])[0] for i in order]
    writer.flush()
    for fut in futures:
        fut.result()
    writer.close()
    path = tmp_path / "ck" / ".acp" / "packs" / "0.0.zip"
    assert path.read_bytes() == _reference(members)
    with zipfile.ZipFile(path) as zf:
        assert zf.testzip() is None


def test_a_member_of_the_wrong_size_or_added_twice_is_refused(tmp_path: Path) -> None:
    members = _members(2)
    writer = shardfile.FileWriter(str(tmp_path / "ck"), threads=2)
    pack = writer.open_pack("p.zip", _sizes(members))
    with pytest.raises(SaveFailedError, match=r"model/t0/c\.0\.0 .*not the \d+ planned"):
        pack.add(1, [b"short"])
    pack.add(0, members[0][1])
    with pytest.raises(SaveFailedError, match="twice"):
        pack.add(0, members[0][1])
    writer.close()
    assert not (tmp_path / "ck" / "p.zip").exists()  # left incomplete: removed


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_failed_member_write_removes_the_pack_and_its_descriptor(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(packstream, "BATCH_BYTES", 1)  # one batch per member
    members = _members(6)
    _third_write_fails(tmp_path, monkeypatch, members, _sizes(members))


def _third_write_fails(tmp_path: Path, monkeypatch, members: list, sizes: list) -> None:
    """Stream ``members`` into a pack whose third ``pwritev`` fails with ENOSPC: a member's future carries the
    error, and neither the pack nor a descriptor is left."""
    before = _fds()
    real = os.pwritev
    calls = []

    def pwritev(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 3:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, bufs, offset)

    monkeypatch.setattr(os, "pwritev", pwritev)
    writer = shardfile.FileWriter(str(tmp_path / "ck"), threads=2)
    pack = writer.open_pack("p.zip", sizes)
    futures = [pack.add(i, parts)[0] for i, (_k, parts) in enumerate(members)]
    writer.flush()
    errors = [f.exception() for f in futures]
    writer.close()
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors), errors
    assert not (tmp_path / "ck" / "p.zip").exists()
    assert _fds() == before


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_write_failing_inside_a_summed_member_removes_the_pack(tmp_path: Path, monkeypatch) -> None:
    """A large member is written in groups, its checksums summed as it goes (:mod:`summed`): a failure after
    some of its groups are written fails its future, and the pack is removed with its descriptor."""
    data = np.random.default_rng(3).standard_normal((4, 65_536)).astype(np.float32)  # 1 MiB, one inner chunk
    parts = shardfile.encode(data, data.shape, deferred=True)
    assert summed.has_deferred(parts)
    members = [("a/zarr.json", [b"{}"]), ("a/c.0.0", parts), ("b", [b"x" * 100])]
    sizes = [(k, sum(len(p) if not isinstance(p, np.ndarray) else p.nbytes for p in ps)) for k, ps in members]
    monkeypatch.setattr(summed, "GROUP_BYTES", summed.SLICE_BYTES)  # four groups for the member
    _third_write_fails(tmp_path, monkeypatch, members, sizes)


def _bias_model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {f"t{i}": torch.randn(4096 + i, generator=g) for i in range(8)}  # ~16 KiB chunk files: one pack


def test_pack_members_are_written_before_the_last_one_is_encoded(tmp_path: Path, monkeypatch) -> None:
    """The overlap itself: each member goes to its pack file as soon as it is encoded. The save's last chunk
    is encoded only once earlier chunks' bytes are in the pack (the hook waits for them, at most 20 s): a
    writer that held the members until the pack was whole never writes them, and the wait fails."""
    monkeypatch.setattr(packstream, "BATCH_BYTES", 1)
    state = _bias_model()
    written = threading.Event()
    chunk_bytes = 4096 * 4
    real = os.pwritev

    def pwritev(fd, bufs, offset):
        n = real(fd, bufs, offset)
        if n >= chunk_bytes:  # a chunk member (not a zarr.json document)
            written.set()
        return n

    add = packwrite.Packs.add
    seen: list[bool] = []

    def hooked(self, w, data):
        if len(seen) == len(state) - 1:  # the last chunk of the (only) pack
            seen.append(written.wait(20))
        else:
            seen.append(written.is_set())
        return add(self, w, data)

    monkeypatch.setattr(os, "pwritev", pwritev)
    monkeypatch.setattr(packwrite.Packs, "add", hooked)
    acp.save(tmp_path / "ck", {"model": state})
    monkeypatch.undo()
    assert len(seen) == len(state) and seen[-1], seen
    packs = sorted((tmp_path / "ck" / ".acp" / "packs").glob("*.zip"))
    assert len(packs) == 1, packs
    with zipfile.ZipFile(packs[0]) as zf:
        assert zf.testzip() is None
        assert sum(n.endswith("/c.0") for n in zf.namelist()) == len(state)
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    acp.load(tmp_path / "ck", {"model": dest})
    assert all(torch.equal(dest[k], state[k]) for k in state)


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_save_whose_pack_write_fails_commits_nothing_and_a_retry_succeeds(
    tmp_path: Path, monkeypatch
) -> None:
    monkeypatch.setattr(packstream, "BATCH_BYTES", 1)
    state = _bias_model()
    real = os.pwritev
    calls = []

    def pwritev(fd, bufs, offset):
        calls.append(offset)
        if len(calls) == 4:
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, bufs, offset)

    acp.save(tmp_path / "warm", {"model": state})  # imports and pools outside the count
    before = _fds()
    monkeypatch.setattr(os, "pwritev", pwritev)
    with pytest.raises(ArrayCheckpointError, match="Input/output error"):
        acp.save(tmp_path / "ck", {"model": state})
    monkeypatch.undo()
    assert not (tmp_path / "ck").exists()
    assert not [p for p in tmp_path.iterdir() if p.name not in ("warm",)], list(tmp_path.iterdir())
    assert _fds() == before
    acp.save(tmp_path / "ck", {"model": state})
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    acp.load(tmp_path / "ck", {"model": dest})
    assert all(torch.equal(dest[k], state[k]) for k in state)


def test_packs_on_a_key_value_store_are_written_whole_and_load(tmp_path: Path) -> None:
    """Object stores take one value per object: the same packs, each written once its last member arrived."""
    import arraycheckpoint.storage.memory  # noqa: F401 - registers memory://

    state = _bias_model()
    url = f"memory://packstream/{os.getpid()}"
    acp.save(url, {"model": state})
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    acp.load(url, {"model": dest})
    assert all(torch.equal(dest[k], state[k]) for k in state)


@pytest.mark.parametrize(
    ("shape", "inner"),
    [((512, 160), (128, 160)), ((7, 5), (7, 5)), ((64, 96), (32, 96)), ((300_001,), (300_001,))],
)
def test_a_chunk_summed_as_written_is_the_encoded_file(shape, inner, tmp_path, monkeypatch) -> None:
    """A chunk file whose CRC32C are left to the writer (:mod:`summed`) is written with exactly the bytes of
    the resolved encoding, and the CRC-32 summed beside them is zlib's over those bytes: with slices smaller
    than an inner chunk, groups of one slice, and the CRC32C through google_crc32c instead of the crc32c
    package, too."""
    data = np.random.default_rng(len(shape)).standard_normal(shape).astype(np.float32)

    def joined(parts: list[shardfile.Buffer]) -> bytes:
        return b"".join(
            bytes(np.ascontiguousarray(p).reshape(-1).view(np.uint8)) if isinstance(p, np.ndarray) else p
            for p in parts
        )

    want = joined(shardfile.encode(data, inner))
    assert crc._FAST is not None, "the crc32c package is a dependency: its hardware path is the one tested"
    cases = [
        (summed.SLICE_BYTES, summed.GROUP_BYTES, crc._FAST),
        (4096, 4096, None),
        (4096, 3 * 4096, crc._FAST),
    ]
    for n, (slice_bytes, group_bytes, fast) in enumerate(cases):
        monkeypatch.setattr(summed, "SLICE_BYTES", slice_bytes)
        monkeypatch.setattr(summed, "GROUP_BYTES", group_bytes)
        monkeypatch.setattr(crc, "_FAST", fast)
        parts = shardfile.encode(data, inner, deferred=True)
        assert summed.has_deferred(parts) == (int(np.prod(inner)) * 4 >= slice_bytes)
        path = tmp_path / f"f{n}"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        try:
            zip_crc, nbytes = summed.write(fd, parts, 100, str(path), zip_crc=True)
        finally:
            os.close(fd)
        assert nbytes == len(want)
        assert path.read_bytes()[100:] == want
        assert zip_crc == zlib.crc32(want)


def test_large_members_summed_as_written_through_a_save(tmp_path: Path) -> None:
    """Chunks at or above the summed slice (both checksums summed by the writer as it writes them, the local
    header after the bytes): the pack's members check with zipfile and load bit-exactly."""
    g = torch.Generator().manual_seed(1)
    state = {"w": torch.randn(512, 1024, generator=g), "v": torch.randn(3, 70_000, generator=g)}
    acp.save(tmp_path / "ck", {"model": state}, plan_options=acp.PlanOptions(min_chunk_bytes=8 << 20))
    packs = sorted((tmp_path / "ck" / ".acp" / "packs").glob("*.zip"))
    assert packs, "nothing was packed: nothing tested"
    for pack in packs:
        with zipfile.ZipFile(pack) as zf:
            assert zf.testzip() is None
            sizes = [i.file_size for i in zf.infolist() if not i.filename.endswith("zarr.json")]
            assert max(sizes) >= summed.SLICE_BYTES, sizes
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    acp.load(tmp_path / "ck", {"model": dest})
    assert all(torch.equal(dest[k], state[k]) for k in state)
