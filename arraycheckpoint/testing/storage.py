"""The storage conformance suite: every backend's test module subclasses :class:`StorageTests`.

A subclass supplies fixtures only:

* ``base_url`` (required): a URL or path, unique per test, under which the test may create checkpoints;
  nothing exists there yet;
* ``zarr_store`` (optional): a function ``root -> zarr store`` that lets plain zarr-python read what the
  backend stored under ``root``; the default skips the zarr-python test.

Example (``tests/storage/test_local.py``)::

    class TestLocal(StorageTests):
        @pytest.fixture
        def base_url(self, tmp_path):
            return str(tmp_path / "ckpts")

The suite checks the contract the engine and the checkpoint manager rely on: small-object
read/write/list/delete, commit and abort per the backend's commit strategy, the save lock, leftovers cleanup,
and an ``acp.save``/``acp.load`` round trip (bit-exact, torch tensors) through :func:`storage_for`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from ..errors import CheckpointExistsError, CheckpointNotFoundError
from ..format.metadata import COMMIT_MARKER, CONTROL_LAYOUTS, LEGACY_CONTROL, METADATA_FILE
from ..storage import Storage, storage_for


class StorageTests:
    """Conformance tests of one :class:`Storage` backend (see the module docstring for the fixtures)."""

    @pytest.fixture
    def base_url(self) -> str:
        raise NotImplementedError("a backend's test class must define the base_url fixture")

    @pytest.fixture
    def zarr_store(self) -> Callable[[str], Any] | None:
        return None

    @pytest.fixture
    def store(self, base_url: str) -> tuple[Storage, str]:
        """``(backend, root)`` of a fresh checkpoint root ``<base_url>/ckpt``."""
        return storage_for(f"{base_url}/ckpt")

    # Small objects ---------------------------------------------------------------------------------
    def test_normalize_is_idempotent(self, store: tuple[Storage, str]) -> None:
        backend, root = store
        assert backend.normalize(root) == root
        assert backend.normalize(root + "/") == root

    def test_write_read_overwrite(self, store: tuple[Storage, str]) -> None:
        backend, root = store
        assert backend.read(root, "a/b.bin") is None
        assert not backend.exists(root, "a/b.bin")
        backend.write(root, "a/b.bin", b"\x00\x01payload")
        assert backend.read(root, "a/b.bin") == b"\x00\x01payload"
        assert backend.exists(root, "a/b.bin")
        backend.write(root, "a/b.bin", b"second")
        assert backend.read(root, "a/b.bin") == b"second"
        backend.write(root, "empty", b"")
        assert backend.read(root, "empty") == b""

    def test_list_is_relative_and_sorted(self, store: tuple[Storage, str]) -> None:
        backend, root = store
        assert backend.list(root) == []
        for key in ("z.json", "a/x/1", "a/x/0", "b"):
            backend.write(root, key, key.encode())
        assert backend.list(root) == ["a/x/0", "a/x/1", "b", "z.json"]
        assert backend.list(backend.join(root, "a")) == ["x/0", "x/1"]
        assert backend.children(root) == ["a", "b", "z.json"]

    def test_delete_stays_inside_root(self, base_url: str) -> None:
        backend, root = storage_for(f"{base_url}/ck")
        _, sibling = storage_for(f"{base_url}/ck2")
        backend.write(root, "x/1", b"1")
        backend.write(sibling, "x/1", b"keep")
        backend.delete(root)
        assert backend.list(root) == []
        assert backend.read(sibling, "x/1") == b"keep"
        backend.delete(root)  # deleting nothing is fine
        backend.write(sibling, "y", b"2")
        backend.delete_key(sibling, "y")
        backend.delete_key(sibling, "y")
        assert backend.list(sibling) == ["x/1"]

    # Commit protocol -------------------------------------------------------------------------------
    def _stage(self, backend: Storage, final: str, token: str, payload: bytes) -> str:
        staging = backend.staging_root(final, token)
        import tensorstore as ts

        from ..runtime.tscontext import context

        kv = ts.KvStore.open(backend.kvstore_spec(backend.join(staging, "arr")), context=context()).result()
        kv.write("c/0", payload).result()
        backend.flush(staging)
        return staging

    def test_commit_makes_visible(self, store: tuple[Storage, str]) -> None:
        backend, final = store
        assert backend.commit_strategy in ("rename", "marker")
        backend.check_target(final, overwrite=False)
        backend.acquire(final, "t1")
        staging = self._stage(backend, final, "t1", b"data-1")
        assert not backend.is_committed(final)
        backend.commit(staging, final, overwrite=False)
        backend.release(final, "t1")
        assert backend.is_committed(final)
        assert backend.read(backend.join(final, "arr"), "c/0") == b"data-1"
        assert backend.read(final, COMMIT_MARKER) is not None
        fresh, root = storage_for(final)
        assert fresh.is_committed(root)
        with pytest.raises(CheckpointExistsError):
            fresh.check_target(root, overwrite=False)

    def test_commit_overwrite_replaces(self, store: tuple[Storage, str]) -> None:
        backend, final = store
        for i, token in enumerate(("t1", "t2")):
            b, _ = storage_for(final)
            b.check_target(final, overwrite=True)
            b.acquire(final, token)
            staging = self._stage(b, final, token, f"data-{i}".encode())
            if i == 0:
                b.write(b.join(staging, "arr"), "old-only", b"x")
                b.flush(staging)
            b.commit(staging, final, overwrite=True)
            b.release(final, token)
        assert backend.is_committed(final)
        assert backend.read(backend.join(final, "arr"), "c/0") == b"data-1"
        assert backend.read(backend.join(final, "arr"), "old-only") is None

    def test_abort_leaves_nothing_visible(self, store: tuple[Storage, str]) -> None:
        backend, final = store
        backend.check_target(final, overwrite=False)
        backend.acquire(final, "t1")
        staging = self._stage(backend, final, "t1", b"doomed")
        backend.abort(staging, final)
        backend.release(final, "t1")
        assert not backend.is_committed(final)
        assert backend.read(backend.join(final, "arr"), "c/0") is None
        parent, _ = backend.parent(final)
        assert [c for c in backend.children(parent) if "acp-staging" in c] == []
        backend.acquire(final, "t2")  # the lock was released
        backend.release(final, "t2")

    def test_lock_is_exclusive(self, store: tuple[Storage, str]) -> None:
        backend, final = store
        backend.acquire(final, "holder")
        other, _ = storage_for(final)
        with pytest.raises(CheckpointExistsError, match="in progress"):
            other.acquire(final, "intruder")
        other.release(final, "intruder")  # someone else's token releases nothing
        with pytest.raises(CheckpointExistsError):
            other.acquire(final, "intruder")
        backend.release(final, "holder")
        backend.release(final, "holder")  # idempotent
        other.acquire(final, "intruder")
        other.release(final, "intruder")

    def test_cleanup_removes_stale_lock(self, base_url: str) -> None:
        backend, final = storage_for(f"{base_url}/step_1")
        backend.acquire(final, "crashed")
        _crash(backend, final, "crashed")
        parent, _ = backend.parent(final)
        removed = backend.cleanup_leftovers(parent)
        assert removed, "the stale lock was not reported"
        backend.acquire(final, "next")
        backend.release(final, "next")

    def test_remove_checkpoint(self, store: tuple[Storage, str]) -> None:
        backend, final = store
        backend.acquire(final, "t")
        backend.commit(self._stage(backend, final, "t", b"x"), final, overwrite=False)
        backend.release(final, "t")
        assert backend.is_committed(final)
        backend.remove_checkpoint(final)
        assert not backend.is_committed(final)
        assert backend.list(final) == []

    def test_overwrite_of_a_format2_checkpoint_leaves_no_old_marker(self, base_url: str) -> None:
        """An older checkpoint (control files in its root) saved over: only the new layout remains, and the
        old marker never outlives the old data (marker backends delete it first)."""
        import arraycheckpoint as acp

        url = f"{base_url}/old"
        backend, root = storage_for(url)
        if backend.commit_strategy == "rename":
            backend.write(root, "zarr.json", b"{}")  # the directory exists
        backend.write(root, "model/w/c/0/0", b"old data")
        backend.write(root, LEGACY_CONTROL.metadata, b"{}")
        backend.write(root, LEGACY_CONTROL.committed, b"committed\n")
        assert backend.is_committed(root) and backend.control_files(root) == LEGACY_CONTROL
        with pytest.raises(CheckpointExistsError):
            acp.save(url, self._state(5))
        acp.save(url, self._state(5), overwrite=True)
        fresh, root = storage_for(url)
        assert fresh.control_files(root) == CONTROL_LAYOUTS[0]
        keys = fresh.list(root)
        assert LEGACY_CONTROL.committed not in keys and LEGACY_CONTROL.metadata not in keys
        assert COMMIT_MARKER in keys and METADATA_FILE in keys
        assert acp.read_metadata(url).objects["extra_state"].value is not None
        fresh.remove_checkpoint(root)
        assert not fresh.is_committed(root)

    # Through the public API ------------------------------------------------------------------------
    def _state(self, seed: int) -> dict[str, Any]:
        torch = pytest.importorskip("torch")
        g = torch.Generator().manual_seed(seed)
        return {
            "model": {
                "w": torch.randn(33, 17, generator=g),
                "b": torch.randn(17, generator=g).to(torch.bfloat16),
                "i": torch.randint(-(2**40), 2**40, (5, 3), generator=g, dtype=torch.int64),
            },
            "extra_state": {"epoch": seed, "tag": "conformance"},
        }

    def test_acp_round_trip(self, base_url: str) -> None:
        import arraycheckpoint as acp

        torch = pytest.importorskip("torch")
        url = f"{base_url}/rt"
        saved = self._state(1)
        meta = acp.save(url, saved, step=7)
        assert meta.step == 7
        target = {"model": {k: torch.zeros_like(v) for k, v in saved["model"].items()}, "extra_state": {}}
        out = acp.load(url, target)
        for k, v in saved["model"].items():
            assert torch.equal(target["model"][k], v), k
        assert out["extra_state"] == {"epoch": 1, "tag": "conformance"}
        assert acp.read_metadata(url).step == 7
        with pytest.raises(CheckpointExistsError):
            acp.save(url, self._state(2))
        acp.save(url, self._state(2), overwrite=True)
        acp.load(url, target)
        assert torch.equal(target["model"]["w"], self._state(2)["model"]["w"])

    @pytest.mark.parametrize("layout", range(len(CONTROL_LAYOUTS)), ids=["format3", "format2"])
    def test_uncommitted_reads_as_absent(self, base_url: str, layout: int) -> None:
        import arraycheckpoint as acp

        url = f"{base_url}/half"
        backend, root = storage_for(url)
        backend.write(root, CONTROL_LAYOUTS[layout].metadata, b"{}")
        backend.write(root, "zarr.json", b"{}")
        assert backend.control_files(root) == CONTROL_LAYOUTS[layout]
        with pytest.raises(CheckpointNotFoundError, match="no commit marker"):
            acp.load(url, self._state(0))
        with pytest.raises(CheckpointNotFoundError, match="does not exist"):
            acp.read_metadata(f"{base_url}/never")

    def test_save_over_uncommitted_leftovers(self, base_url: str) -> None:
        import arraycheckpoint as acp

        url = f"{base_url}/left"
        backend, root = storage_for(url)
        backend.write(root, "model/stale/c/0", b"from a crashed save")
        backend.write(root, METADATA_FILE, b"{")
        acp.save(url, self._state(4))
        assert backend.read(root, "model/stale/c/0") is None
        assert "model/stale/c/0" not in backend.list(root)
        assert acp.read_metadata(url).objects["extra_state"].value is not None

    def test_save_keeps_what_is_not_a_checkpoint(
        self, base_url: str, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        """A target holding objects that are not a checkpoint (not committed, no control files or lock of a
        crashed save) is refused with or without overwrite, naming what is there, and nothing is deleted;
        where the backend has a bounded listing, the refusal never walks the whole prefix."""
        import arraycheckpoint as acp

        url = f"{base_url}/mine"
        backend, root = storage_for(url)
        mine = {"notes.txt": b"keep me", **{f"tb_logs/{i:02d}": b"event %d" % i for i in range(15)}}
        for key, data in mine.items():
            backend.write(root, key, data)
        if type(backend).sample is not Storage.sample:

            def no_walk(*args: Any) -> list[str]:
                raise AssertionError("the target check walked the whole prefix")

            monkeypatch.setattr(type(backend), "list", no_walk)
        for overwrite in (False, True):
            with pytest.raises(CheckpointExistsError, match=r"(?s)not a checkpoint.*(notes\.txt|tb_logs)"):
                acp.save(url, self._state(6), overwrite=overwrite)
        monkeypatch.undo()
        assert {key: backend.read(root, key) for key in mine} == mine
        assert backend.list(root) == sorted(mine) and not backend.is_committed(root)

    def test_zarr_python_reads_array(self, base_url: str, zarr_store: Callable[[str], Any] | None) -> None:
        if zarr_store is None:
            pytest.skip("this backend's bytes are not reachable by zarr-python")
        import zarr

        import arraycheckpoint as acp

        url = f"{base_url}/z"
        saved = self._state(3)
        acp.save(url, saved)
        _, root = storage_for(url)
        from arraycheckpoint.zarr import checkpoint_store

        # small tensors are packed (format 5): the checkpoint store shows them at their paths
        group = zarr.open_group(checkpoint_store(zarr_store(root)), mode="r")
        w = group["model"]["w"]
        assert w.shape == (33, 17)
        assert np.array_equal(w[...], saved["model"]["w"].numpy())
        assert np.array_equal(group["model/i"][...], saved["model"]["i"].numpy())


def _crash(backend: Storage, final: str, token: str) -> None:
    """What a crash of the saving process does to its lock: a local file system's lock file stays, its flock
    goes (the kernel drops it when the process ends); other backends' locks stay, no longer refreshed (here:
    last refreshed an hour ago, so a lease ran out: a live one is kept by a cleanup)."""
    import time

    from ..storage import lease, local

    if isinstance(backend, local.LocalStorage):
        with local._HELD_LOCK:
            fd = local._HELD.pop((str(backend._lock(final)), token))
        os.close(fd)
        return
    lease.drop(backend, final, token)
    if backend._leases():
        backend.write(final, ".acp-lock", lease.body(token, time.time() - 3600))
