"""Storage backends behind one seam. :func:`storage_for` picks the backend from a path or URL."""

from __future__ import annotations

from .base import Storage
from .local import LocalStorage
from .memory import MemoryStorage

__all__ = ["LocalStorage", "MemoryStorage", "Storage", "storage_for"]


def storage_for(url: str) -> tuple[Storage, str]:
    """The backend for ``url`` and the normalised checkpoint root.

    Local paths and ``file://`` use :class:`LocalStorage`; ``memory://`` uses :class:`MemoryStorage`.
    """
    import os

    url = os.fspath(url)
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme == "file":
        backend: Storage = LocalStorage()
    elif scheme == "memory":
        backend = MemoryStorage()
    else:
        from .remote import remote_storage  # object stores and fsspec URLs

        backend = remote_storage(scheme)
    return backend, backend.normalize(url)
