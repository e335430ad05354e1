"""``rename`` of a checkpoint whose packs are damaged where the pack checks do not look (a member's bytes, a
directory field Python's zipfile refuses): the rename rewrites those packs, so it must refuse before its journal
exists, naming the pack, and leave the checkpoint committed and loadable as it was. In process, tiny tensors."""

from __future__ import annotations

import json
import os
import re
import zipfile

import pytest
import torch

import arraycheckpoint as acp
from arraycheckpoint.cli import EXIT_USAGE, main

JOURNAL = ".acp-rename.json"


@pytest.fixture
def packed(tmp_path):
    """A checkpoint whose two arrays are spread over rank 0's packs (16 and 4 chunks, derived writers)."""
    torch.manual_seed(0)
    state = {"w": torch.randn(64, 4), "b": torch.randn(8, 8)}
    opts = acp.PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=64, inner_chunk_bytes=64)
    path = tmp_path / "ck"
    acp.save(path, {"model": state}, plan_options=opts)
    return path, state


def _member_data_at(pack, name: str) -> int:
    with zipfile.ZipFile(pack) as zf:
        info = zf.getinfo(name)
    raw = pack.read_bytes()
    extra = int.from_bytes(raw[info.header_offset + 28 : info.header_offset + 30], "little")
    return info.header_offset + 30 + len(info.filename.encode()) + extra


def _pack_holding(path, member: str):
    for pack in sorted((path / ".acp" / "packs").iterdir()):
        with zipfile.ZipFile(pack) as zf:
            if member in zf.namelist():
                return pack
    raise AssertionError(member)


def _flip_member_byte(path, member: str):
    pack = _pack_holding(path, member)
    raw = bytearray(pack.read_bytes())
    raw[_member_data_at(pack, member) + 3] ^= 0x5A
    pack.write_bytes(bytes(raw))
    return pack


def _version_needed_too_high(path, member: str):
    """The central directory entry of ``member`` says version 7.8 is needed to extract it (Python's zipfile
    refuses to open the archive; the library's own parser ignores the field)."""
    pack = _pack_holding(path, member)
    raw = bytearray(pack.read_bytes())
    at = raw.index(b"PK\x01\x02")
    while True:
        name_len = int.from_bytes(raw[at + 28 : at + 30], "little")
        if raw[at + 46 : at + 46 + name_len] == member.encode():
            break
        at = raw.index(b"PK\x01\x02", at + 4)
    raw[at + 6 : at + 8] = (78).to_bytes(2, "little")
    pack.write_bytes(bytes(raw))
    return pack


@pytest.mark.parametrize(
    "damage, named", [(_flip_member_byte, "model/w/c.3.0"), (_version_needed_too_high, "zip file version")]
)
def test_rename_refuses_a_pack_it_cannot_rewrite_before_touching_anything(
    packed, tmp_path, capsys, damage, named
):
    path, state = packed
    pack = damage(path, "model/w/c.3.0")
    listing = sorted(os.listdir(path))
    mapping = tmp_path / "map.json"
    mapping.write_text(json.dumps({"model/w": "model/w2", "model/b": "model/b2"}))
    code = main(["rename", "--map", str(mapping), str(path)])
    err = capsys.readouterr().err
    assert "Traceback" not in err and code == EXIT_USAGE, err
    assert str(pack) in err and named in err, err
    assert sorted(os.listdir(path)) == listing and not (path / JOURNAL).exists()
    # still committed: what was sound still loads under the old names
    out = {"b": torch.zeros(8, 8)}
    acp.load(path, {"model": out}, strict=False)
    assert torch.equal(out["b"], state["b"])


def test_store_reads_a_pack_zipfile_cannot_open_as_the_load_does(packed):
    """The "version needed to extract" field is no check of the library's ZIP parser, which the load, verify
    and checkpoint_store share (the store used zipfile, which refused the pack the load read): all read it."""
    import zarr

    from arraycheckpoint.tools.verify import verify
    from arraycheckpoint.zarr import checkpoint_store

    path, state = packed
    _version_needed_too_high(path, "model/w/c.3.0")
    out = {"w": torch.zeros(64, 4)}
    acp.load(path, {"model": out}, strict=False)
    assert torch.equal(out["w"], state["w"]) and verify(path).ok
    root = zarr.open_group(checkpoint_store(path), mode="r")
    assert torch.equal(torch.from_numpy(root["model/w"][...]), state["w"])


def test_a_grid_the_packs_cannot_hold_is_refused_before_its_chunks_are_listed(packed, tmp_path, capsys):
    """A 40-byte change of shape declares 2^13 derived chunks of ``model/w`` in rank 0's packs, which hold a
    few KB: every entry point refuses from the packs' sizes, naming the tensor, before building a key per chunk
    (at 2^26 chunks: gigabytes of keys, minutes, MemoryError)."""
    import zarr

    from arraycheckpoint.errors import ArrayCheckpointError
    from arraycheckpoint.tools.verify import verify
    from arraycheckpoint.zarr import checkpoint_store

    path, _state = packed
    meta = path / ".acp" / "metadata.json"
    doc = json.loads(meta.read_text())
    doc["tensors"]["model/w"].update(shape=[1 << 13, 4], chunk_shape=[1, 4], inner_chunk_shape=[1, 4])
    meta.write_text(json.dumps(doc))
    why = "chunks in them, which take at least"
    with pytest.raises(ArrayCheckpointError, match=f"model/w.*{why}"):
        acp.load(path, {"model": {"w": torch.zeros(1 << 13, 4)}}, strict=False)
    report = verify(path)
    assert any(p.tensor == "model/w" and why in p.message for p in report.problems), report.problems[:3]
    with pytest.raises(ArrayCheckpointError, match=f"model/w.*{why}"):
        zarr.open_group(checkpoint_store(path), mode="r")["model/w"][...]
    for args in (["diff", path, path], ["export", path, tmp_path / "out"]):
        code = main([str(a) for a in args])
        err = capsys.readouterr().err
        assert code == EXIT_USAGE and "model/w" in err and why in err, err


def test_an_object_store_grid_the_packs_cannot_hold_is_refused_from_their_directories():
    """The same on an object store (no sizes without reads): the entries of the rank's pack directories are
    counted before a key is built per chunk (2^24 chunks: 28 s and MemoryError under 4 GB before)."""
    from arraycheckpoint.errors import ArrayCheckpointError
    from arraycheckpoint.storage import storage_for
    from arraycheckpoint.tools.verify import verify

    url = "memory://hostile-grid"
    opts = acp.PlanOptions(min_chunk_bytes=1 << 10, max_chunk_bytes=64, inner_chunk_bytes=64)
    acp.save(url, {"model": {"w": torch.randn(64, 4), "b": torch.randn(8, 8)}}, plan_options=opts)
    storage, root = storage_for(url)
    doc = json.loads(storage.read(root, ".acp/metadata.json"))
    doc["tensors"]["model/w"].update(shape=[1 << 17, 4], chunk_shape=[1, 4], inner_chunk_shape=[1, 4])
    storage.write(root, ".acp/metadata.json", json.dumps(doc).encode())
    why = "members in all, but the metadata puts 13107[0-9] chunks in them"
    report = verify(url)
    assert any(p.tensor == "model/w" and re.search(why, p.message) for p in report.problems), report.problems
    with pytest.raises(ArrayCheckpointError, match=f"model/w.*{why}"):
        acp.load(url, {"model": {"w": torch.zeros(1 << 17, 4)}}, strict=False)
