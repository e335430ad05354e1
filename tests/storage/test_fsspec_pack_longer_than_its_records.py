"""On fsspec (where a pack's size is not known from its end read, only from its end records), a pack whose
object holds bytes no record accounts for, read whole by a check, is refused: the whole object is fetched
and compared with the size its records say.

Before (review23a, suspicion (b); 05dbd30): the read of a small pack whole asked for ``(0, size)``, the size
its records say, so an object longer than that (100 bytes before its central directory: Python's
:mod:`zipfile` shifts every offset by them, tensorstore does not) came back as long as the records say and
passed the check; the read of the whole object before refused it. A pack whose size the store tells (a local
file) is still refused by its end records."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.audit.scan import check_checkpoint
from arraycheckpoint.errors import CorruptCheckpointError
from arraycheckpoint.storage import storage_for


def test_a_pack_longer_than_its_records_read_whole_is_refused(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(4)
    state = {k: torch.randn(400, 256, generator=g) for k in "awz"}  # one pack of 1.2 MB: 6 members
    url = f"local://{tmp_path / 'ck'}"
    acp.save(url, {"model": state})
    (pack,) = (tmp_path / "ck" / ".acp" / "packs").glob("*.zip")
    storage, root = storage_for(url)
    meta = acp.read_metadata(url)
    check_checkpoint(storage, root, meta)  # intact: its members' headers checked from the pack read whole
    raw = pack.read_bytes()
    at = raw.rfind(b"PK\x05\x06")
    (cd_offset,) = struct.unpack("<L", raw[at + 16 : at + 20])
    pack.write_bytes(raw[:cd_offset] + b"\0" * 100 + raw[cd_offset:])
    with pytest.raises(CorruptCheckpointError, match="is not the size its end records say"):
        check_checkpoint(storage, root, meta)
