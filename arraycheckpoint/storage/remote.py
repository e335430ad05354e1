"""Backends for URLs that are neither local paths nor ``memory://``: tensorstore drivers first, fsspec else."""

from __future__ import annotations

from . import storage_options
from .base import Storage


def remote_storage(scheme: str) -> Storage:
    """A fresh backend for ``scheme://`` URLs, with the options set by :func:`configure` for it.

    ``s3`` uses tensorstore's own S3 driver (:class:`~.s3.S3Storage`); every other scheme fsspec knows
    goes through :class:`~.fsspec_store.FsspecStorage`.

    Raises:
        StorageError: fsspec has no implementation for ``scheme`` (the message lists how to install one).
    """
    options = storage_options(scheme)
    if scheme == "s3":
        from .s3 import S3Storage

        return S3Storage(**options)
    from .fsspec_store import FsspecStorage

    return FsspecStorage(scheme, options)
