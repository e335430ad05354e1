"""The central directory of a pack is checked entry by entry only when something in it is unusual: a
directory as a save writes it is checked all at once (numpy, ``checks.zipdir._plain_entries``). The fast path
is only a shortcut: on every byte of a directory and its end records flipped in turn, of a pack a save wrote
and of archives written with plain :mod:`zipfile` (UTF-8 names, entry comments, zip64 fields, a name holding
an entry signature), it returns exactly what the exact parse returns, or refuses with exactly its error."""

from __future__ import annotations

import io
import zipfile
from pathlib import Path

import pytest
import torch
from faults.packtools import pack_of

import arraycheckpoint as acp
from arraycheckpoint.checks import zipdir
from arraycheckpoint.errors import CorruptCheckpointError


def _saved_pack(tmp_path: Path) -> bytes:
    state = {
        "w": torch.arange(12.0).reshape(3, 4),
        "é": torch.ones(2),
        "b": torch.zeros(5, dtype=torch.int64),
    }
    ck = tmp_path / "ck"
    acp.save(ck, {"model": state})
    return pack_of(ck, "model/w").read_bytes()


def _zipfile_archive(kind: str) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as zf:
        names = ["a/zarr.json", "a/c/0", "ü/c/0", "b/c/1"]
        for i, name in enumerate(names + ["x/PK\x01\x02y"] if kind == "signature-in-name" else names):
            info = zipfile.ZipInfo(name)
            if kind == "comments" and i % 2:
                info.comment = b"note"
            with zf.open(info, "w", force_zip64=kind == "zip64") as f:
                f.write(bytes(range(i * 7 % 50)))
    return out.getvalue()


#: for each parse with the fast path on, whether the fast path accepted the directory
FAST: list[bool] = []


def _parse(raw: bytes, fast: bool, monkeypatch: pytest.MonkeyPatch) -> object:
    """What ``_parse_zip_directory`` returns for the archive ``raw`` (read whole), or the error it raises."""
    with monkeypatch.context() as m:
        real = zipdir._plain_entries

        def recorded(*a: object) -> object:
            got = real(*a)  # type: ignore[arg-type]
            FAST.append(got is not None)
            return got

        m.setattr(zipdir, "_plain_entries", recorded)
        m.setattr(zipdir, "VECTOR_ENTRIES", 1)  # these archives are small: the fast path taken all the same
        if not fast:
            m.setattr(zipdir, "_plain_entries", lambda *a: None)

        def read_many(ranges: list[tuple[int, int]]) -> list[bytes]:
            return [raw[o : o + n] for o, n in ranges]

        try:
            entries, size, cd_offset = zipdir._parse_zip_directory(
                "p.zip", raw, len(raw), 1 << 30, read_many, None
            )
        except CorruptCheckpointError as e:
            return ("refused", str(e))
    return [tuple(map(type, e)) + tuple(e) for e in entries], size, cd_offset


@pytest.mark.parametrize("kind", ["saved", "plain", "comments", "zip64", "signature-in-name"])
def test_fast_directory_check_agrees_with_the_exact_one_on_every_flipped_byte(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    raw = _saved_pack(tmp_path) if kind == "saved" else _zipfile_archive(kind)
    at = raw.rfind(b"PK\x05\x06")
    cd_offset = int.from_bytes(raw[at + 16 : at + 20], "little")
    if kind in ("saved", "plain", "comments"):  # they take the fast path (else this test would check nothing)
        n = int.from_bytes(raw[at + 10 : at + 12], "little")
        assert zipdir._plain_entries(raw[cd_offset:at], n, cd_offset) is not None
    assert _parse(raw, True, monkeypatch) == _parse(raw, False, monkeypatch)
    start = cd_offset if kind == "saved" else 0  # an archive of zipfile's: every byte (a few hundred)
    refused = 0
    FAST.clear()
    for i in range(start, len(raw)):
        for bit in (0x01, 0x80):
            bad = bytearray(raw)
            bad[i] ^= bit
            fast = _parse(bytes(bad), True, monkeypatch)
            assert fast == _parse(bytes(bad), False, monkeypatch), (i, bit)
            refused += isinstance(fast, tuple) and fast[0] == "refused"
    assert refused  # the flips do reach the checks
    if kind in ("saved", "plain", "comments"):  # and the fast path accepted many flipped directories
        assert sum(FAST) > 20, sum(FAST)


def test_overlapping_members_are_refused_by_both(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two entries pointing at one local header (a forged offset): found in offset order, same error."""
    raw = _zipfile_archive("plain")
    at = raw.rfind(b"PK\x05\x06")
    cd_offset = int.from_bytes(raw[at + 16 : at + 20], "little")
    second = raw.find(b"PK\x01\x02", cd_offset + 1)
    forged = bytearray(raw)
    forged[second + 42 : second + 46] = (0).to_bytes(4, "little")  # its local header is the first's
    fast = _parse(bytes(forged), True, monkeypatch)
    assert fast == _parse(bytes(forged), False, monkeypatch)
    assert fast[0] == "refused" and "overlaps" in fast[1]  # type: ignore[index]


@pytest.mark.parametrize(
    "field, at, value",
    [
        ("compressed size", 20, b"\xff\xff\xff\xff"),
        ("size", 24, b"\xff\xff\xff\xff"),
        ("header offset", 42, b"\xff\xff\xff\xff"),
        ("flags: data descriptor", 8, b"\x08\x00"),
        ("disk", 34, b"\x01\x00"),
        ("name: NUL", 46, b"\x00"),
        ("name: not ASCII", 46, b"\xc3"),
    ],
)
def test_forged_entry_fields_are_refused_alike(
    tmp_path: Path, field: str, at: int, value: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Values no single flipped bit makes: the fast path leaves them to the exact parse, which refuses."""
    raw = bytearray(_saved_pack(tmp_path))
    end = raw.rfind(b"PK\x05\x06")
    entry = int.from_bytes(raw[end + 16 : end + 20], "little")  # the first directory entry
    raw[entry + at : entry + at + len(value)] = value
    fast = _parse(bytes(raw), True, monkeypatch)
    assert fast == _parse(bytes(raw), False, monkeypatch)
    assert fast[0] == "refused", (field, fast)  # type: ignore[index]


def test_a_small_directory_is_parsed_entry_by_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A directory of fewer than ``VECTOR_ENTRIES`` entries (a pack of a few large chunks) goes straight to
    the exact parse (cheaper there than the check all at once), with the same result; a larger one takes the
    fast path first."""
    raw = _saved_pack(tmp_path)
    calls: list[int] = []
    real = zipdir._plain_entries
    monkeypatch.setattr(zipdir, "_plain_entries", lambda d, n, o: calls.append(n) or real(d, n, o))

    def parse() -> object:
        got = zipdir._parse_zip_directory("p.zip", raw, len(raw), 1 << 30, lambda r: [], None)
        return [tuple(e) for e in got[0]], got[1:]

    small = parse()
    assert calls == [] and len(small[0]) < zipdir.VECTOR_ENTRIES  # type: ignore[arg-type]
    monkeypatch.setattr(zipdir, "VECTOR_ENTRIES", 1)
    assert parse() == small and len(calls) == 1
