"""A file system may report a failed write only when the file is closed (NFS: ``EIO``, ``ENOSPC``,
``EDQUOT`` from ``close(2)``). The save closes large files on its write-back thread
(:class:`arraycheckpoint.engine.shardfile.FileWriter`): such a failure must fail the save naming the file,
commit nothing, leak no descriptor, and leave the previous checkpoint loadable. Also the DCP Writer's path."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.engine import shardfile
from arraycheckpoint.errors import ArrayCheckpointError

# 2 MiB arrays: above the write-back threshold (1 MiB), in a chunk file of its own or in a pack
OWN = acp.PlanOptions(pack_array_bytes=0)
PACKED = acp.PlanOptions(min_chunk_bytes=8 << 20)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _failing_close(monkeypatch, fail_on: list[int]) -> list[int]:
    """Make every close of a file of at least 1 MiB on the write-back thread fail with EIO after closing it
    (as Linux does: the descriptor is released whatever close returns)."""
    real = os.close
    seen: list[int] = []

    def close(fd: int) -> None:
        size = os.fstat(fd).st_size
        real(fd)
        if size >= shardfile.WRITEBACK_BYTES:
            seen.append(size)
            if len(seen) in fail_on:
                raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(shardfile, "_close", close)
    return seen


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts descriptors in /proc")
@pytest.mark.parametrize("options", [OWN, PACKED], ids=["own_file", "pack"])
def test_a_failed_close_fails_the_save_and_commits_nothing(tmp_path, monkeypatch, options) -> None:
    old = {"w": torch.arange(512 * 1024, dtype=torch.float32)}
    acp.save(tmp_path / "step_1", {"model": old}, plan_options=options)
    new = {"w": torch.ones(512 * 1024), "v": torch.zeros(512 * 1024)}
    before = _fds()
    seen = _failing_close(monkeypatch, fail_on=[1])
    with pytest.raises(ArrayCheckpointError) as info:
        acp.save(tmp_path / "step_2", {"model": new}, plan_options=options)
    assert seen, "no file went through the write-back thread"
    assert "Input/output error" in str(info.value) and str(tmp_path / "step_2") in str(info.value), info.value
    assert not (tmp_path / "step_2").exists()
    assert _fds() == before
    monkeypatch.undo()
    dest = {"w": torch.zeros(512 * 1024)}
    acp.load(tmp_path / "step_1", {"model": dest})
    assert torch.equal(dest["w"], old["w"])


def test_filewriter_raises_the_first_failed_close_naming_the_file(tmp_path, monkeypatch) -> None:
    _failing_close(monkeypatch, fail_on=[1, 2])
    w = shardfile.FileWriter(str(tmp_path / "d"), threads=2)
    big = np.zeros(2 << 20, np.uint8)
    futs = [w.write("a/c.0", [big]), w.write("b/c.0", [big]), w.write("c/zarr.json", [b"{}"])]
    w.flush()
    for f in futs:
        f.result()  # the bytes were written: only the close failed
    with pytest.raises(ArrayCheckpointError, match=r"d/a/c\.0|d/b/c\.0"):
        w.close()


def test_dcp_writer_fails_on_a_failed_close(tmp_path, monkeypatch) -> None:
    import torch.distributed.checkpoint as dcp

    from arraycheckpoint.dcp import Writer

    _failing_close(monkeypatch, fail_on=[1])
    with pytest.raises(BaseException) as info:  # DCP's CheckpointException is a BaseException
        dcp.save({"w": torch.ones(512 * 1024)}, storage_writer=Writer(str(tmp_path / "ck")))
    text = str(info.value) + repr(getattr(info.value, "failures", ""))  # DCP wraps the rank's error
    assert "Input/output error" in text and "w/c.0" in text, text
    assert not (tmp_path / "ck").exists()  # nothing committed


def test_a_failed_close_does_not_mask_the_saves_own_error(tmp_path, monkeypatch) -> None:
    _failing_close(monkeypatch, fail_on=[1])
    w = shardfile.FileWriter(str(tmp_path / "d"), threads=2)
    fut = w.write("a/c.0", [np.zeros(2 << 20, np.uint8)])
    w.flush()
    fut.result()
    with pytest.raises(KeyError) as info:
        try:
            raise KeyError("the save's own error")
        finally:
            w.close()
    assert any("a/c.0" in n and "Input/output error" in n for n in info.value.__notes__)
