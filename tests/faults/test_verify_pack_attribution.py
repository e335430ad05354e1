"""`verify` reports a damaged member of a rank's pack against the array whose member it is, naming the pack;
the other arrays of that pack are OK, and a load of them reads them bit-exactly (a member's damaged directory
entry, like its damaged bytes, concerns its own array: the array is refused, the pack's others are not).
A pack whose ZIP structure is broken (members overlapping) cannot be read at all: every array in it is
reported, with the pack's error (docs/security.md)."""

from __future__ import annotations

import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from faults.packtools import flip_member_byte, members, pack_of, replace_member, rewrite_pack, write_members

import arraycheckpoint as acp
from arraycheckpoint.errors import CorruptCheckpointError
from arraycheckpoint.tools.verify import verify

NAMES = ("a", "b", "c", "s")
BAD = "model/c"


def _state() -> dict[str, torch.Tensor]:
    out = {n: torch.arange(16, dtype=torch.float32) * (i + 1) for i, n in enumerate(NAMES[:-1])}
    out["s"] = torch.arange(4096, dtype=torch.float32)
    return out


def _deflate(pack: Path) -> None:
    write_members(pack, members(pack), lambda n: zipfile.ZIP_DEFLATED if n == f"{BAD}/c.0" else 0)


def _grow(pack: Path) -> None:
    data = dict(members(pack))[f"{BAD}/c.0"]
    replace_member(pack, f"{BAD}/c.0", data[:10] + b"\0" + data[10:])


def _flip(pack: Path) -> None:
    flip_member_byte(pack, f"{BAD}/c.0", 3)


@pytest.mark.parametrize(
    "damage, says, without_data",
    [
        pytest.param(_deflate, "compressed (method 8)", True, id="deflated"),
        pytest.param(_grow, "more than its encoding can be", True, id="oversized"),
        pytest.param(_flip, "crc32c does not match", False, id="bytes"),
    ],
)
def test_a_damaged_member_is_reported_against_its_own_array(
    tmp_path: Path, damage: Callable[[Path], None], says: str, without_data: bool
) -> None:
    ck = tmp_path / "ck"
    acp.save(ck, {"model": _state()})
    pack = pack_of(ck, BAD)
    assert all(pack_of(ck, f"model/{n}") == pack for n in NAMES)  # one pack holds them all
    damage(pack)
    for read_data in (True, False) if without_data else (True,):
        report = verify(ck, read_data=read_data)
        assert {p.tensor for p in report.problems} == {BAD}, [str(p) for p in report.problems]
        for p in report.problems:
            assert says in p.message and str(pack) in p.message, p.message
            assert "'model/a'" not in p.message and "'model/s'" not in p.message
    with pytest.raises(CorruptCheckpointError, match=f"'{BAD}'"):
        acp.load(ck, {"model": {"c": torch.zeros(16)}}, strict=False)
    want = _state()
    got = acp.load(ck, {"model": {n: torch.zeros_like(want[n]) for n in NAMES if n != "c"}}, strict=False)
    for n in NAMES:
        if n != "c":
            assert torch.equal(got["model"][n], want[n]), n


def test_a_foreign_member_fails_the_whole_pack_naming_the_pack(tmp_path: Path) -> None:
    """A member none of the pack's arrays has (here a chunk outside model/c's grid) makes the pack hostile:
    every array read from it is refused, each reported with the pack's error, never as another tensor's."""
    ck = tmp_path / "ck"
    acp.save(ck, {"model": _state()})
    pack = pack_of(ck, BAD)
    rewrite_pack(pack, lambda ms: ms + [(f"{BAD}/c.7", b"\0" * 64)])
    report = verify(ck)
    assert {p.tensor for p in report.problems} == {f"model/{n}" for n in NAMES}
    for p in report.problems:
        assert p.message.startswith(f"stored in packs: {pack} holds the member '{BAD}/c.7'"), p.message
