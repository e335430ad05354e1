"""A failure after ``acp.dcp.Writer`` committed never removes the committed checkpoint.

Before (review23e D1): on marker stores (S3, memory, fsspec) the checkpoint is written in place and its DCP
discovery file ``.metadata`` is written after the commit marker, still inside the ``try`` whose ``except``
called ``storage.abort(staging, final)``; staging is final there, so a refused ``.metadata`` write (or a failing
``close_flush``) deleted every key of the just-committed checkpoint, its marker included.
Now: the late ``.metadata`` failure raises an error saying the step is committed and how to write the file
again (``Writer.write_discovery_file``); a ``close_flush`` failure after the commit is logged.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import ArrayCheckpointError, StorageError
from arraycheckpoint.storage import register_scheme, storage_for
from arraycheckpoint.storage.memory import MemoryStorage

dcp = pytest.importorskip("torch.distributed.checkpoint")

STATE = {"w": torch.arange(12.0).reshape(3, 4), "b": torch.tensor([7, -3], dtype=torch.int64)}


class RefusesMetadata(MemoryStorage):
    """A store refusing writes of ``.metadata`` while ``refuse`` is set (503s past the retries)."""

    refuse = True

    def normalize(self, url: str) -> str:
        return super().normalize(url.replace("refusemeta://", "memory://", 1))

    def write(self, root: str, key: str, data: bytes) -> None:
        if key == ".metadata" and type(self).refuse:
            raise StorageError(f"storage write of {root}/.metadata failed: 503 Slow Down")
        super().write(root, key, data)


class FailsCloseFlush(MemoryStorage):
    """A store whose ``close_flush`` fails once the checkpoint is committed (the coordinator's, after the commit)."""

    def normalize(self, url: str) -> str:
        return super().normalize(url.replace("failclose://", "memory://", 1))

    def close_flush(self, root: str) -> None:
        super().close_flush(root)
        if self.is_committed(root):
            raise StorageError(f"close_flush of {root} failed")


def _loads_bit_exact(url: str) -> None:
    back = {k: torch.zeros_like(v) for k, v in STATE.items()}
    acp.load(url, back)
    for k, v in STATE.items():
        assert torch.equal(back[k], v), k


def test_a_refused_late_metadata_keeps_the_commit_and_says_so() -> None:
    register_scheme("refusemeta", RefusesMetadata)
    url = f"refusemeta://b-{uuid.uuid4().hex[:8]}/ckpt"
    RefusesMetadata.refuse = True
    with pytest.raises(BaseException) as info:  # DCP wraps the Writer's error in its CheckpointException
        dcp.save(STATE, storage_writer=acp.dcp.Writer(url))
    said = str(info.value)
    assert "is committed" in said and "503 Slow Down" in said and "write_discovery_file" in said
    storage, final = storage_for(url)
    assert storage.is_committed(final)  # before: abort deleted every key, the marker included
    assert not storage.exists(final, ".metadata")
    _loads_bit_exact(url)
    RefusesMetadata.refuse = False
    acp.dcp.Writer.write_discovery_file(url)  # what the error tells the user to do
    assert storage.exists(final, ".metadata")
    back = {k: torch.zeros_like(v) for k, v in STATE.items()}
    dcp.load(back, storage_reader=acp.dcp.Reader(url))
    for k, v in STATE.items():
        assert torch.equal(back[k], v), k


def test_write_discovery_file_refuses_an_uncommitted_path() -> None:
    url = f"memory://b-{uuid.uuid4().hex[:8]}/none"
    with pytest.raises(ArrayCheckpointError, match="no committed checkpoint"):
        acp.dcp.Writer.write_discovery_file(url)
    storage, final = storage_for(url)
    assert not storage.exists(final, ".metadata")


def test_a_close_flush_failure_after_the_commit_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    register_scheme("failclose", FailsCloseFlush)
    url = f"failclose://b-{uuid.uuid4().hex[:8]}/ckpt"
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):
        dcp.save(STATE, storage_writer=acp.dcp.Writer(url))  # before: raised, and the checkpoint was deleted
    storage, final = storage_for(url)
    assert storage.is_committed(final) and storage.exists(final, ".metadata")
    assert "close_flush" in caplog.text and "failed" in caplog.text
    _loads_bit_exact(url)
