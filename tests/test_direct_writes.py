"""``O_DIRECT`` writes of large files (``engine/direct.py``, opt-in with ``ARRAYCHECKPOINT_DIRECT_WRITES=1``): the files hold
exactly the bytes of the buffered path (chunk files and streamed packs, unaligned sizes, staging buffers reused),
a file system that refuses ``O_DIRECT`` gets the same bytes buffered, a failed direct write fails the save and
leaves nothing, and every direct write of a save lands before its flush (``syncfs``) and commit."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.engine import direct, packstream, shardfile
from arraycheckpoint.storage.local import LocalStorage

pytestmark = pytest.mark.skipif(not hasattr(os, "O_DIRECT"), reason="no O_DIRECT on this platform")


@pytest.fixture
def direct_on(tmp_path: Path, monkeypatch) -> list[int]:
    """Direct writes on for ``tmp_path``'s file system, whatever it is; the bytes each direct write took."""
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "1")
    monkeypatch.setattr(direct, "_DIRECT_FS", frozenset({direct._fs_type(str(tmp_path))}))
    monkeypatch.setattr(direct, "_refused", False)
    taken: list[int] = []
    real = direct._write_direct

    def counted(fd, view, path):
        n = real(fd, view, path)
        taken.append(n)
        return n

    monkeypatch.setattr(direct, "_write_direct", counted)
    return taken


def _chunk(rows: int, cols: int, seed: int) -> list:
    data = np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)
    return shardfile.encode(data, (rows // 2, cols), deferred=True)  # two inner chunks, summed as written


def _pack_members(seed: int) -> list[tuple[str, list]]:
    rng = np.random.default_rng(seed)
    out: list[tuple[str, list]] = [("a/zarr.json", [b'{"zarr_format": 3}'])]
    for i, rows in enumerate([1000, 3, 4096, 777]):  # ~6 MiB in all, every size unaligned
        out.append((f"t{i}/c.0.0", _chunk(2 * rows, 257, int(rng.integers(1 << 30)))))
    out.append(("b/c.0", [b"x" * 5]))
    return out


def _write(root: Path, seed: int) -> dict[str, bytes]:
    """A large chunk file and a streamed pack (members added out of order) under ``root``; their bytes."""
    writer = shardfile.FileWriter(str(root), threads=2)
    futures = [writer.write("big/c.0.0", _chunk(2 * 1500, 301, seed))]  # 3.4 MiB + 44 bytes
    members = _pack_members(seed)
    sizes = [(k, sum(len(p) if not isinstance(p, np.ndarray) else p.nbytes for p in ps)) for k, ps in members]
    pack = writer.open_pack("p.zip", sizes)
    order = [3, 0, 5, 1, 4, 2]
    futures += [pack.add(i, members[i][1])[0] for i in order]
    writer.flush()
    for f in futures:
        f.result()
    writer.close()
    return {p.name: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_direct_files_hold_the_buffered_paths_bytes(tmp_path: Path, monkeypatch, direct_on) -> None:
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "0")
    want = [_write(tmp_path / f"buffered{s}", s) for s in (1, 2)]
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "1")
    got = [_write(tmp_path / f"direct{s}", s) for s in (1, 2)]  # the second reuses the first's buffers
    assert got == want
    assert all(len(b) % direct.ALIGN for files in got for b in files.values())  # unaligned tails
    assert len(direct_on) == 4 and all(n > 0 and n % direct.ALIGN == 0 for n in direct_on), direct_on


def test_a_file_system_refusing_o_direct_gets_the_same_bytes_buffered(
    tmp_path: Path, monkeypatch, direct_on
) -> None:
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "0")
    want = _write(tmp_path / "buffered", 3)
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "1")
    real = direct.fcntl.fcntl

    def refusing(fd, cmd, arg=0):  # what an older tmpfs answers
        if cmd == direct.fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(direct.fcntl, "fcntl", refusing)
    assert _write(tmp_path / "refused", 3) == want
    assert direct._refused and not any(direct_on)


def test_staging_without_room_writes_buffered(tmp_path: Path, monkeypatch, direct_on) -> None:
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "0")
    want = _write(tmp_path / "buffered", 4)
    monkeypatch.setenv("ARRAYCHECKPOINT_DIRECT_WRITES", "1")
    monkeypatch.setattr(direct, "POOL", direct._Pool(1 << 20))  # smaller than any file here
    assert _write(tmp_path / "small-budget", 4) == want
    assert not direct_on


#: 2 MiB chunks: the 4 MiB tensor in files of its own (above the pack target), the rest packed
_PLAN = acp.PlanOptions(min_chunk_bytes=1 << 20, max_chunk_bytes=2 << 20)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    # chunk files of their own (4 MiB in 2 MiB chunks; 1.2 MB), and a pack of 1.2 MB of small tensors
    return {"w": torch.randn(1024, 1024, generator=g), "b": torch.randn(300_001, generator=g)} | {
        f"s{i}": torch.randn(50_000 + i, generator=g) for i in range(6)
    }


def test_a_direct_save_loads_bit_exactly_and_writes_before_its_flush(
    tmp_path: Path, monkeypatch, direct_on
) -> None:
    events: list[str] = []
    real_write, real_flush = direct._write_direct, LocalStorage.flush

    def write(fd, view, path):
        n = real_write(fd, view, path)
        events.append("direct")
        return n

    def flush(self, root):
        events.append("flush")
        return real_flush(self, root)

    monkeypatch.setattr(direct, "_write_direct", write)
    monkeypatch.setattr(LocalStorage, "flush", flush)
    state = _state()
    acp.save(tmp_path / "ck", {"model": state}, plan_options=_PLAN)
    assert events.count("direct") == 4 and "flush" in events, events  # w's two chunks, b, the pack
    assert events.index("flush") > max(i for i, e in enumerate(events) if e == "direct"), events
    dest = {k: torch.zeros_like(v) for k, v in state.items()}
    acp.load(tmp_path / "ck", {"model": dest})
    assert all(torch.equal(dest[k], state[k]) for k in state)
    monkeypatch.undo()
    again = {k: torch.zeros_like(v) for k, v in state.items()}  # the buffered path writes the same files
    acp.save(tmp_path / "ck2", {"model": state}, plan_options=_PLAN)
    one, two = tmp_path / "ck", tmp_path / "ck2"
    data = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file() and ".acp" not in p.parts)
    assert data == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file() and ".acp" not in p.parts)
    assert all((one / p).read_bytes() == (two / p).read_bytes() for p in data)
    acp.load(two, {"model": again})
    assert all(torch.equal(again[k], state[k]) for k in state)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
def test_a_failed_direct_write_fails_the_save_and_leaves_nothing(
    tmp_path: Path, monkeypatch, direct_on
) -> None:
    def full(fd, view, path):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(direct, "_write_direct", full)
    members = _pack_members(5)
    sizes = [(k, sum(len(p) if not isinstance(p, np.ndarray) else p.nbytes for p in ps)) for k, ps in members]
    before = _fds()
    writer = shardfile.FileWriter(str(tmp_path / "w"), threads=2)
    pack = writer.open_pack("p.zip", sizes)
    futures = [pack.add(i, parts)[0] for i, (_k, parts) in enumerate(members)]
    writer.flush()
    errors = [f.exception() for f in futures]
    writer.close()
    assert any(isinstance(e, OSError) and e.errno == errno.ENOSPC for e in errors), errors
    assert not (tmp_path / "w" / "p.zip").exists()
    assert _fds() == before
    with pytest.raises(acp.ArrayCheckpointError, match="No space left"):
        acp.save(tmp_path / "ck", {"model": _state()}, plan_options=_PLAN)
    assert not (tmp_path / "ck").exists()
    assert direct.POOL._held <= direct.STAGING_BYTES


def test_a_file_whose_open_fails_gives_its_staging_budget_back(tmp_path: Path, monkeypatch) -> None:
    """A direct write takes a staging buffer only once its file is open: a failed open (here EEXIST) keeps
    none of the budget, so later files still get one (chunk files and streamed packs alike)."""
    monkeypatch.setattr(direct, "POOL", direct._Pool(2 << 20))  # room for one 2 MiB file
    blob = bytes(2 << 20)
    for i in range(3):
        taken = tmp_path / f"taken{i}"
        taken.write_bytes(b"x")
        with pytest.raises(FileExistsError):
            shardfile._write_file(str(taken), [blob], None, staged=True)
        with pytest.raises(FileExistsError):
            packstream.StreamedPack(
                str(taken), [("a", len(blob))], lambda t, _n: t(), lambda t: t(), lambda fd, _n: os.close(fd),
                lambda _fd, _o, _n: None, 1 << 62, lambda n, p: direct.Staged.take(n, p),
            )  # fmt: skip
    staged = direct.Staged.take(len(blob), "after")
    assert staged is not None, (
        "failed opens kept the staging budget: no file is written with O_DIRECT any more"
    )
    staged.release()


def test_a_pack_whose_staging_fails_leaves_no_descriptor_and_no_file(tmp_path: Path) -> None:
    """The staging buffer of a streamed pack cannot be had (its mmap fails: ENOMEM): the pack's file, opened
    just before, is closed and removed (it leaked a descriptor and left an empty pack)."""

    def no_memory(_n: int, _p: str) -> None:
        raise OSError(12, "Cannot allocate memory")

    before = set(os.listdir("/proc/self/fd"))
    path = tmp_path / "pack.zip"
    with pytest.raises(OSError, match="Cannot allocate"):
        packstream.StreamedPack(
            str(path), [("a", 4096)], lambda t, _n: t(), lambda t: t(), lambda fd, _n: os.close(fd),
            lambda _fd, _o, _n: None, 1 << 62, no_memory,
        )  # fmt: skip
    assert set(os.listdir("/proc/self/fd")) <= before and not path.exists()
