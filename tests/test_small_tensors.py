"""Many small tensors in one process: the per-tensor fast paths of a save and a load (issue 22, item 8).

Each fast path (a small member written joined to its header, zip records packed with ``struct`` and numpy,
one-chunk arrays read from a pack's read-ahead window, local headers accepted in one test, plain names
matched by one regular expression, the JSON shape scanned by quote parity, the metadata text written in
parts) must give the bytes and the decisions of the general code, and refuse what it refuses with the same
error. These tests fail if one of them does not.
"""

from __future__ import annotations

import json
import random
import re
import zipfile
from pathlib import Path

import pytest
import torch
from faults.packtools import chunk_member, flip_member_byte, members, pack_of, set_local_header

import arraycheckpoint as acp
from arraycheckpoint.checks import bounds, names, zipdir
from arraycheckpoint.engine import packfile, packread
from arraycheckpoint.errors import CorruptCheckpointError, UnsafeNameError
from arraycheckpoint.format.metadata import CheckpointMetadata

#: shapes of the small tensors: 0-d, empty, 1-D, 2-D and 3-D
_SHAPES = [(), (0,), (1,), (4,), (3, 2), (2, 0, 3), (2, 3, 4), (5, 1)]
_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.int64, torch.bool]


def _mixed_state(count: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """``count`` small tensors of every shape and dtype above, in nested modules' names."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(count):
        shape, dtype = _SHAPES[i % len(_SHAPES)], _DTYPES[(i // len(_SHAPES)) % len(_DTYPES)]
        values = torch.randn(shape, generator=g) * 50
        out[f"layers.{i // 16}.experts.{i % 16}.w"] = values.to(dtype) if dtype != torch.bool else values > 0
    out["big"] = torch.randn(300, 257, generator=g)  # several inner chunks: the general read path beside
    return out


def _junk_like(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {
        k: torch.ones_like(v) if v.dtype == torch.bool else torch.full_like(v, -7) for k, v in state.items()
    }


def test_thousands_of_small_tensors_round_trip_bit_exactly(tmp_path: Path) -> None:
    state = _mixed_state(3000)
    path = tmp_path / "ck"
    acp.save(path, {"model": state})
    target = _junk_like(state)
    # a target that is not contiguous (a transposed view): the one-chunk fast path does not apply to it
    target["layers.0.experts.4.w"] = torch.full((2, 3), -7.0, dtype=state["layers.0.experts.4.w"].dtype).t()
    acp.load(path, {"model": target})
    for k, v in state.items():
        assert torch.equal(target[k], v), k
    packs = sorted((path / ".acp" / "packs").glob("*.zip"))
    assert packs, "the small tensors went into packs"
    # every pack is exactly zipfile's archive of its members, in order (headers, directory, end records)
    for pack in packs:
        rebuilt = tmp_path / "rebuilt.zip"
        with open(rebuilt, "wb") as f:
            packfile.write_zip(f, [(name, [data]) for name, data in members(pack)])
        assert rebuilt.read_bytes() == pack.read_bytes(), pack.name


def test_a_second_save_of_the_same_structure_loads_bit_exactly(tmp_path: Path) -> None:
    """The cached plan (the second save) writes the same members at the same offsets."""
    first, second = _mixed_state(200, seed=1), _mixed_state(200, seed=2)
    acp.save(tmp_path / "a", {"model": first})
    acp.save(tmp_path / "b", {"model": second})
    for path, state in ((tmp_path / "a", first), (tmp_path / "b", second)):
        target = _junk_like(state)
        acp.load(path, {"model": target})
        assert all(torch.equal(target[k], v) for k, v in state.items())


def test_the_metadata_text_is_json_dumps_of_the_document(tmp_path: Path) -> None:
    path = tmp_path / "ck"
    meta = acp.save(
        path, {"model": _mixed_state(300), "extra_state": {"step": 3, "note": 'a "quoted" {text}'}}
    )
    text = (path / ".acp" / "metadata.json").read_text()
    assert text == json.dumps(json.loads(text), separators=(",", ":"), allow_nan=False)
    assert CheckpointMetadata.from_json(text).to_json() == text
    assert meta.to_json() == text
    fixtures = Path(__file__).parent / "fixtures"
    for found in sorted(fixtures.rglob("*metadata.json")):
        raw = found.read_text()
        parsed = CheckpointMetadata.from_json(raw)
        whole = json.loads(parsed.to_json())
        assert parsed.to_json() == json.dumps(whole, separators=(",", ":"), allow_nan=False), found


@pytest.mark.parametrize(
    "record",
    [
        ("model/a/c.0", 123, 40, 0),
        ("model/é/zarr.json", 7, 600, 1000),  # a UTF-8 name: flagged
        ("model/big/c.0", 1, zipfile.ZIP64_LIMIT, 12),  # zip64 sizes: through zipfile
        ("model/far/c.0", 2, 40, zipfile.ZIP64_LIMIT + 5),  # an offset past 4 GiB: zip64 in the directory
    ],
)
def test_zip_records_are_zipfiles_bytes(record: tuple[str, int, int, int]) -> None:
    info = packfile._record_info(record)
    assert packfile.local_header(record) == info.FileHeader(record[2] >= zipfile.ZIP64_LIMIT)
    (parts,) = packfile.header_parts([(record[0], record[2])])  # the streamed writer's header, around its CRC
    if parts is not None:
        assert parts[0] + record[1].to_bytes(4, "little") + parts[1] == packfile.local_header(record)
    else:
        assert record[2] >= zipfile.ZIP64_LIMIT
    plain = ("model/x/c.0", 5, 16, 0)
    for records in ([record], [plain, record], [plain] * 3):
        expected = packfile._central_directory([packfile._record_info(r) for r in records], 99)
        assert packfile.central_directory(list(records), 99) == expected


def test_plain_names_take_the_regex_and_agree_with_the_full_checks(monkeypatch) -> None:
    rng = random.Random(4)
    alphabet = ["a", "b", "0", "_", "-", ".", "/", ":", "\\", "\n", "é", " ", "zarr.json", "__", ".."]
    candidates = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 8))) for _ in range(20000)]

    def verdicts() -> list[str]:
        out = []
        for name in candidates:
            try:
                names.check_name(name)
                out.append("ok")
            except UnsafeNameError as e:
                out.append(str(e))
        return out

    with_regex = verdicts()
    assert sum(names._PLAIN_NAME.match(n) is not None for n in candidates) > 1000  # the fast path is taken
    monkeypatch.setattr(names, "_PLAIN_NAME", re.compile(r"(?!)"))  # never matches: the full checks only
    assert verdicts() == with_regex
    for bad in ("a//b", "/a", ".a", "a/__b", "a/zarr.json", "a:b", "a\x7fb"):
        with pytest.raises(UnsafeNameError):
            names.check_name(bad)


def test_the_name_tree_check_reports_the_first_nested_name_in_order() -> None:
    names.check_name_tree(["a", "ab/c", "b/c/d"])
    with pytest.raises(UnsafeNameError, match="'m/a/b' would be stored inside tensor 'm/a'"):
        names.check_name_tree(["z/y", "m/a/b/c", "m/a", "m/a/b", "z"])


def test_the_json_shape_by_quotes_is_the_regex_scans(monkeypatch) -> None:
    rng = random.Random(9)

    def by_regex(raw: bytes) -> tuple[int, int]:
        monkeypatch.setattr(bounds, "_shape_by_quotes", lambda _raw: None)
        try:
            return bounds.json_shape(raw)
        finally:
            monkeypatch.undo()

    for block in (5, 1 << 20):
        monkeypatch.setattr(bounds, "_SCAN_BLOCK", block)
        for _ in range(2000):
            raw = bytes(rng.choice(b'[]{}"ab,:\\') for _ in range(rng.randint(0, 40)))
            expected = by_regex(raw)
            monkeypatch.setattr(bounds, "_SCAN_BLOCK", block)
            assert bounds.json_shape(raw) == expected, raw


def _damaged_error(path: Path, target: dict[str, torch.Tensor], monkeypatch, general: bool) -> str:
    if general:  # the general read path alone
        monkeypatch.setattr(packread.PackFile, "read_small_chunk", lambda *_a, **_k: False)
    try:
        with pytest.raises(CorruptCheckpointError) as err:
            acp.load(path, {"model": target})
    finally:
        monkeypatch.undo()
    return str(err.value)


@pytest.mark.parametrize("damage", ["data", "crc", "index", "method", "name"])
def test_a_damaged_small_member_is_refused_as_the_general_path_refuses_it(
    tmp_path: Path, monkeypatch, damage: str
) -> None:
    state = {f"p{i}": torch.arange(4, dtype=torch.float32) + i for i in range(50)}
    path = tmp_path / "ck"
    acp.save(path, {"model": state})
    name = "model/p17"
    member = chunk_member(name, (0,))
    pack = pack_of(path, name)
    if damage == "data":
        flip_member_byte(pack, member, 3)
    elif damage == "crc":
        flip_member_byte(pack, member, 16)
    elif damage == "index":
        flip_member_byte(pack, member, -6)
    elif damage == "method":
        set_local_header(pack, member, method=8)
    else:  # the local header names another member of the same length
        with zipfile.ZipFile(pack) as zf:
            offset = zf.getinfo(member).header_offset
        raw = bytearray(pack.read_bytes())
        at = raw.index(member.encode(), offset)
        raw[at + len(member) - 3] ^= 0x01
        pack.write_bytes(bytes(raw))
    fast = _damaged_error(path, _junk_like(state), monkeypatch, general=False)
    general = _damaged_error(path, _junk_like(state), monkeypatch, general=True)
    assert fast == general
    assert "model/p17" in fast


def test_the_one_test_local_header_check_refuses_what_the_full_one_refuses() -> None:
    entry = zipdir.PackMember(
        filename="model/a/c.0",
        compress_type=0,
        compress_size=40,
        file_size=40,
        header_offset=100,
        flag_bits=0,
        raw_name=b"model/a/c.0",
    )
    good = packfile.local_header(("model/a/c.0", 0, 40, 100))
    assert zipdir.check_local_header("p", entry, good, 100 + len(good) + 40, lambda r: []) == len(good)
    cases = {
        "flags": good[:6] + b"\x08\x00" + good[8:],
        "method": good[:8] + b"\x08\x00" + good[10:],
        "size": good[:18] + (41).to_bytes(4, "little") + good[22:],
        "name": good[:-1] + b"1",
        "signature": b"PK\x01\x02" + good[4:],
        "short": good[:20],
    }
    for why, head in cases.items():
        with pytest.raises(CorruptCheckpointError) as fast:
            zipdir.check_local_header("p", entry, head, 100 + len(good) + 40, lambda r: [])
        with pytest.raises(CorruptCheckpointError) as full:
            zipdir._check_local_header("p", entry, head, 100 + len(good) + 40, lambda r: [])
        assert str(fast.value) == str(full.value), why
    with pytest.raises(CorruptCheckpointError, match="runs into the next member"):
        zipdir.check_local_header("p", entry, good, 100 + len(good) + 39, lambda r: [])


def test_the_read_ahead_follows_reads_in_order_and_stays_small_otherwise(tmp_path: Path, monkeypatch) -> None:
    """A full load reads each pack about once; a load of a few members of a pack reads about a member each."""
    state = {f"p{i}": torch.arange(64, dtype=torch.float32) + i for i in range(3000)}
    path = tmp_path / "ck"
    acp.save(path, {"model": state})
    packs = sum(p.stat().st_size for p in (path / ".acp" / "packs").glob("*.zip"))
    asked: list[int] = []
    original = packread.PackFile._read

    def counting(self, offset, nbytes, staging):  # type: ignore[no-untyped-def]
        asked.append(nbytes)
        return original(self, offset, nbytes, staging)

    monkeypatch.setattr(packread.PackFile, "_read", counting)
    target = _junk_like(state)
    acp.load(path, {"model": target})
    assert all(torch.equal(target[k], v) for k, v in state.items())
    assert sum(asked) <= 2 * packs + (1 << 20)  # the directories' ranges and each byte about once
    asked.clear()
    some = {k: target[k].fill_(-7) for k in list(state)[::300]}  # 10 tensors far apart
    acp.load(path, {"model": some}, strict=False)
    assert all(torch.equal(some[k], state[k]) for k in some)
    assert sum(asked) <= len(some) * 2 * (packread._WINDOW_START + 1024)
