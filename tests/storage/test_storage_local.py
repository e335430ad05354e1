"""Local POSIX backend: the conformance suite plus what only the rename strategy has."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from arraycheckpoint.errors import CheckpointExistsError
from arraycheckpoint.storage import LocalStorage, storage_for
from arraycheckpoint.testing.storage import StorageTests


class TestLocal(StorageTests):
    @pytest.fixture
    def base_url(self, tmp_path: Path) -> str:
        return str(tmp_path / "ckpts")

    @pytest.fixture
    def zarr_store(self):
        import zarr

        return lambda root: zarr.storage.LocalStore(root, read_only=True)


class TestLocalFileUrl(StorageTests):
    @pytest.fixture
    def base_url(self, tmp_path: Path) -> str:
        return f"file://{tmp_path}/ckpts"

    @pytest.fixture
    def zarr_store(self):
        import zarr

        return lambda root: zarr.storage.LocalStore(root, read_only=True)


def test_staging_is_a_hidden_sibling_and_rename_is_atomic(tmp_path: Path) -> None:
    backend, final = storage_for(tmp_path / "step_1")
    assert isinstance(backend, LocalStorage) and backend.commit_strategy == "rename"
    staging = backend.staging_root(final, "tok")
    assert os.path.dirname(staging) == str(tmp_path) and os.path.basename(staging).startswith(
        ".step_1.acp-staging-"
    )
    backend.acquire(final, "tok")
    assert (tmp_path / ".step_1.acp-lock").read_text() == "tok"
    backend.write(staging, "x", b"1")
    inode = os.stat(staging).st_ino
    backend.commit(staging, final, overwrite=False)
    backend.release(final, "tok")
    assert os.stat(final).st_ino == inode  # the very directory was renamed, not copied
    assert sorted(os.listdir(tmp_path)) == ["step_1"]


def test_commit_refuses_a_checkpoint_committed_meanwhile(tmp_path: Path) -> None:
    backend, final = storage_for(tmp_path / "c")
    s1 = backend.staging_root(final, "a")
    s2 = backend.staging_root(final, "b")
    backend.write(s1, "x", b"1")
    backend.write(s2, "x", b"2")
    backend.commit(s1, final, overwrite=False)
    with pytest.raises(CheckpointExistsError, match="committed by someone else"):
        backend.commit(s2, final, overwrite=False)
    assert backend.read(final, "x") == b"1"


def test_cleanup_leftovers_keeps_checkpoints(tmp_path: Path) -> None:
    backend = LocalStorage()
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / ".committed").write_text("committed\n")
    (tmp_path / ".step_2.acp-staging-abc").mkdir()
    (tmp_path / ".step_2.acp-staging-abc" / "data").write_bytes(b"x")
    (tmp_path / ".step_2.acp-lock").write_text("abc")
    (tmp_path / "step_1.acp-old-.step_1.acp-staging-x").mkdir()
    (tmp_path / ".step_3.acp-trash-1234").mkdir()
    (tmp_path / "notes.txt").write_text("user file")
    removed = backend.cleanup_leftovers(str(tmp_path))
    assert len(removed) == 4
    assert sorted(os.listdir(tmp_path)) == ["notes.txt", "step_1"]
