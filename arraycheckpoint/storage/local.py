"""POSIX file systems: tensorstore's ``file`` kvstore, atomic rename commit, a lock file per target, syncfs."""

from __future__ import annotations

import ctypes
import os
import shutil
from pathlib import Path
from typing import Any

from ..errors import CheckpointExistsError, StorageError
from ..metadata import COMMIT_MARKER
from .base import Storage


class LocalStorage(Storage):
    """A local or shared POSIX file system (``/path`` or ``file:///path``)."""

    commit_strategy = "rename"

    def normalize(self, url: str) -> str:
        if url.startswith("file://"):
            url = url[len("file://") :]
        return str(Path(url).expanduser().absolute())

    def kvstore_spec(self, root: str) -> dict[str, Any]:
        return {"driver": "file", "path": root.rstrip("/") + "/"}

    def staging_root(self, final: str, token: str) -> str:
        p = Path(final)
        return str(p.parent / f".{p.name}.acp-staging-{token}")

    def _lock(self, final: str) -> Path:
        p = Path(final)
        return p.parent / f".{p.name}.acp-lock"

    def acquire(self, final: str, token: str) -> None:
        lock = self._lock(final)
        lock.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = lock.read_text(errors="replace").strip() if lock.exists() else "?"
            raise CheckpointExistsError(
                f"another save to {final} is in progress (lock {lock} held by save {holder}); wait for it, or, "
                "if no save is running, a crashed run left the lock: remove it or run CheckpointManager cleanup"
            ) from None
        with os.fdopen(fd, "w") as f:
            f.write(token)

    def release(self, final: str, token: str) -> None:
        lock = self._lock(final)
        try:
            if lock.read_text().strip() == token:
                lock.unlink()
        except FileNotFoundError:
            pass

    def flush(self, root: str) -> None:
        path = root if os.path.isdir(root) else os.path.dirname(root)
        if not os.path.isdir(path):
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            if _syncfs(fd) != 0:
                os.sync()
        finally:
            os.close(fd)

    def commit(self, staging: str, final: str, overwrite: bool) -> None:
        self.write(staging, COMMIT_MARKER, b"committed\n")
        marker = os.path.join(staging, COMMIT_MARKER)
        _fsync_path(marker)
        old = None
        if os.path.lexists(final):
            if not overwrite and self.is_committed(final):
                raise CheckpointExistsError(f"{final} was committed by someone else during this save")
            old = final + f".acp-old-{os.path.basename(staging)}"
            os.rename(final, old)
        try:
            os.rename(staging, final)
        except OSError as e:
            raise StorageError(f"commit rename {staging} -> {final} failed: {e}") from e
        _fsync_path(os.path.dirname(final))
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)

    def abort(self, staging: str, final: str) -> None:
        if staging != final:
            shutil.rmtree(staging, ignore_errors=True)


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_libc: Any = None


def _syncfs(fd: int) -> int:
    """``syncfs(2)`` on the file system holding ``fd``: one flush for every file this rank wrote there."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.syncfs.argtypes = [ctypes.c_int]
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return -1
    return int(_libc.syncfs(fd))
