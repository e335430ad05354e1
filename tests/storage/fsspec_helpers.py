"""Helpers of the fsspec tests: a local file system under a protocol of its own (a store whose calls a test
slows, stops or records, with a state of its own in :mod:`arraycheckpoint.storage.ranged`)."""

from __future__ import annotations

from typing import Any

from fsspec.implementations.local import LocalFileSystem


class LocalUnder(LocalFileSystem):
    """Local files under the protocol a subclass names first in ``protocol`` (register it with
    ``fsspec.register_implementation``)."""

    @classmethod
    def _strip_protocol(cls, path: Any) -> Any:
        return LocalFileSystem._strip_protocol(str(path).removeprefix(f"{cls.protocol[0]}://"))
