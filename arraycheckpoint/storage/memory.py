"""``memory://`` checkpoints: tensorstore's in-process memory kvstore (tests, fast scratch checkpoints)."""

from __future__ import annotations

import threading
from typing import Any

from ..errors import CheckpointExistsError
from .base import Storage

_locks: set[str] = set()
_guard = threading.Lock()


class MemoryStorage(Storage):
    """Process-local storage; lives as long as the process. Commit is the marker strategy."""

    commit_strategy = "marker"

    def normalize(self, url: str) -> str:
        return "memory://" + url[len("memory://") :].strip("/")

    def kvstore_spec(self, root: str) -> dict[str, Any]:
        return {"driver": "memory", "path": root[len("memory://") :].rstrip("/") + "/"}

    def acquire(self, final: str, token: str) -> None:
        with _guard:
            if final in _locks:
                raise CheckpointExistsError(f"another save to {final} is in progress in this process")
            _locks.add(final)

    def release(self, final: str, token: str) -> None:
        with _guard:
            _locks.discard(final)
