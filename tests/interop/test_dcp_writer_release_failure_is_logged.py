"""``acp.dcp.Writer.finish`` logs a failure to give its claim back instead of raising it, as ``acp.save`` does.

Before (review23c D5): ``finish`` released the claim in a ``finally``: a release failing after a successful
commit (the store refusing the lock's delete) made ``dcp.save`` raise although the checkpoint was committed
(a retry with ``overwrite=False`` then found "already exists"), and on a failed save it replaced the save's own
error with the release's.
"""

from __future__ import annotations

import logging
import uuid

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.errors import StorageError
from arraycheckpoint.storage import register_scheme, storage_for
from arraycheckpoint.storage.memory import MemoryStorage

dcp = pytest.importorskip("torch.distributed.checkpoint")


class RefusesLockDeletes(MemoryStorage):
    """A store whose deletes of the save lock keep failing (503s past the retries)."""

    def normalize(self, url: str) -> str:
        return super().normalize(url.replace("refusedel://", "memory://", 1))

    def _delete_lock_if(self, final: str, generation: bytes) -> bool:
        raise StorageError(f"storage lock delete of {final}/.acp-lock failed: 503 Slow Down")


@pytest.fixture
def url() -> str:
    register_scheme("refusedel", RefusesLockDeletes)
    return f"refusedel://b-{uuid.uuid4().hex[:8]}/ckpt"


def test_a_committed_save_returns_when_its_release_fails(url: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="arraycheckpoint"):  # before: dcp.save raised
        dcp.save({"w": torch.arange(4.0)}, storage_writer=acp.dcp.Writer(url, overwrite=False))
    storage, final = storage_for(url)
    assert storage.is_committed(final)
    assert "storage release of" in caplog.text and "503 Slow Down" in caplog.text
    back = {"w": torch.zeros(4)}
    acp.load(url, back)
    assert torch.equal(back["w"], torch.arange(4.0))


def test_a_failed_save_raises_its_own_error_when_its_release_fails(url: str) -> None:
    with pytest.raises(BaseException, match="pickles to") as info:
        big = {"w": torch.arange(4.0), "blob": b"x" * (17 << 20)}  # a value past the DCP plug-in's limit
        dcp.save(big, storage_writer=acp.dcp.Writer(url))
    assert "503 Slow Down" not in str(info.value)
    storage, final = storage_for(url)
    assert not storage.is_committed(final)
