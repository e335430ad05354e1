"""``S3Storage.read_suffix`` against a server that ignores the ``Range`` header (an S3-compatible store or a
proxy answering 200 with the whole object): the caller's documented fallback (``NotImplementedError``: read
through tensorstore) must happen, not a permanent ``StorageError``; the message must not invent a size."""

from __future__ import annotations

import io
from typing import Any

import pytest

from arraycheckpoint.storage import storage_for

pytest.importorskip("botocore")

OBJ = bytes(range(256)) * 64  # a 16 KiB pack


class _Exceptions:
    class NoSuchKey(Exception):
        pass

    class ClientError(Exception):
        pass


class _Server:
    """botocore's ``get_object`` as such a server answers it: ``ContentRange`` only where it honours ranges."""

    exceptions = _Exceptions

    def __init__(self, honours_range: bool) -> None:
        self.honours_range = honours_range

    def get_object(self, **args: Any) -> dict[str, Any]:
        if not self.honours_range:
            return {"Body": io.BytesIO(OBJ)}
        want = int(args["Range"].split("-")[1])
        return {
            "Body": io.BytesIO(OBJ[-want:]),
            "ContentRange": f"bytes {len(OBJ) - want}-{len(OBJ) - 1}/{len(OBJ)}",
        }


def test_a_server_ignoring_the_range_falls_back_to_tensorstore() -> None:
    storage, root = storage_for("s3://bucket/ck")
    storage._client = _Server(honours_range=False)
    with pytest.raises(NotImplementedError, match="without a Content-Range .* size unknown"):
        storage.read_suffix(root, ".acp/packs/0.0.zip", 4096)
    storage._client = _Server(honours_range=True)
    assert storage.read_suffix(root, ".acp/packs/0.0.zip", 4096) == (OBJ[-4096:], len(OBJ))
