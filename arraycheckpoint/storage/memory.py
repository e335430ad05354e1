"""``memory://`` checkpoints: tensorstore's in-process memory kvstore (tests, fast scratch checkpoints).

All ``memory://`` roots of a process live in the one memory kvstore of the shared tensorstore context
(:mod:`arraycheckpoint.runtime.tscontext`); they vanish with the process. Commit is the marker strategy; the save
lock is the default conditional-create lock object of :class:`~arraycheckpoint.storage.base.Storage`.
"""

from __future__ import annotations

from typing import Any

from .base import Storage


class MemoryStorage(Storage):
    """Process-local storage; lives as long as the process. Commit is the marker strategy."""

    commit_strategy = "marker"

    def normalize(self, url: str) -> str:
        return "memory://" + url[len("memory://") :].strip("/")

    def kvstore_spec(self, root: str) -> dict[str, Any]:
        return {"driver": "memory", "path": root[len("memory://") :].strip("/") + "/"}

    def parent(self, root: str) -> tuple[str, str]:
        head, _, name = root[len("memory://") :].strip("/").rpartition("/")
        return "memory://" + head, name
