"""The storage seam: where checkpoint bytes live and how a checkpoint becomes visible (commit).

A :class:`Storage` resolves a checkpoint root to a tensorstore kvstore spec (the engine opens arrays on it),
offers small-object reads/writes for metadata (also through tensorstore, so every backend shares one code path),
and implements a commit strategy:

* ``rename`` (POSIX file systems): ranks write into a private staging root; the coordinator writes the
  metadata and commit marker there and renames the staging root onto the final path. A crash leaves only a
  staging directory that no reader looks at.
* ``marker`` (object stores, memory): ranks write in place; the commit marker ``.committed`` is written last.
  Readers treat a root without the marker as absent.

Call order (the engine's): ``check_target`` and ``acquire`` on the coordinator at snapshot time, then every rank
writes under ``staging_root``, calls ``flush`` on what it wrote, then the coordinator writes metadata and calls
``commit`` (or ``abort`` on failure) and finally ``release``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from ..errors import CheckpointExistsError, StorageError
from ..metadata import COMMIT_MARKER


class Storage(ABC):
    """One storage backend, bound to one URL scheme."""

    #: "rename" or "marker"; see the module docstring.
    commit_strategy: str = "marker"

    @abstractmethod
    def kvstore_spec(self, root: str) -> dict[str, Any]:
        """The tensorstore kvstore spec of the directory/prefix ``root`` (with trailing slash semantics)."""

    def normalize(self, url: str) -> str:
        """The canonical root string of ``url`` for this backend."""
        return url.rstrip("/")

    # Small objects through tensorstore --------------------------------------------------------------
    def _kv(self, root: str) -> Any:
        import tensorstore as ts

        from .._tscontext import context

        return ts.KvStore.open(self.kvstore_spec(root), context=context()).result()

    def read(self, root: str, key: str) -> bytes | None:
        """The bytes stored at ``root/key``, or None when absent."""
        try:
            result = self._kv(root).read(key).result()
        except Exception as e:  # noqa: BLE001 - tensorstore raises ValueError/OSError variants
            raise StorageError(f"reading {root}/{key} failed: {e}") from e
        return bytes(result.value) if result.state == "value" else None

    def write(self, root: str, key: str, data: bytes) -> None:
        """Store ``data`` at ``root/key`` (overwriting)."""
        try:
            self._kv(root).write(key, data).result()
        except Exception as e:  # noqa: BLE001
            raise StorageError(f"writing {root}/{key} failed: {e}") from e

    def exists(self, root: str, key: str) -> bool:
        return self.read(root, key) is not None

    def list(self, root: str) -> list[str]:
        """Every key below ``root`` (relative)."""
        return sorted(k.decode() if isinstance(k, bytes) else k for k in self._kv(root).list().result())

    def delete(self, root: str) -> None:
        """Remove everything below ``root``."""
        import tensorstore as ts

        self._kv(root).delete_range(ts.KvStore.KeyRange()).result()

    def is_committed(self, root: str) -> bool:
        return self.exists(root, COMMIT_MARKER)

    # Commit strategy -----------------------------------------------------------------------------------
    def staging_root(self, final: str, token: str) -> str:
        """Where ranks write before commit. Marker strategy writes in place."""
        return final

    def check_target(self, final: str, overwrite: bool) -> None:
        """Refuse to save over a committed checkpoint unless ``overwrite``."""
        if not overwrite and self.is_committed(final):
            raise CheckpointExistsError(
                f"a committed checkpoint already exists at {final}; pass overwrite=True to replace it "
                "or save to a new path (CheckpointManager uses one directory per step)"
            )

    @abstractmethod
    def acquire(self, final: str, token: str) -> None:
        """Claim ``final`` for one save; raise :class:`CheckpointExistsError` if another save holds it."""

    @abstractmethod
    def release(self, final: str, token: str) -> None:
        """Drop the claim taken by :meth:`acquire` (idempotent)."""

    def flush(self, root: str) -> None:
        """Make this rank's writes under ``root`` durable (one batched flush; a no-op where writes are)."""

    def commit(self, staging: str, final: str, overwrite: bool) -> None:
        """Make the checkpoint visible: the marker is written last."""
        if overwrite and staging == final:
            pass  # data was written in place; the new marker below supersedes the old one
        self.write(final, COMMIT_MARKER, b"committed\n")

    def abort(self, staging: str, final: str) -> None:
        """Remove what a failed save wrote (best effort)."""
        try:
            self.delete(staging)
        except Exception:  # noqa: BLE001 - cleanup must not mask the save's own error
            pass
