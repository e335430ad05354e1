"""``arraycheckpoint verify`` scales with the checkpoint's packs, not tensors x packs (issue 24).

A checkpoint of thousands of tiny tensors in many packs (format 6): verify must read each pack's ZIP directory a
bounded number of times (the load's own check, once), and a damaged pack must be narrowed down by bisection, not
by one full check per tensor. Counted, not timed: the number of pack-directory reads and pack checks.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.audit import packdir, rankpacks  # noqa: E402
from arraycheckpoint.errors import CorruptCheckpointError  # noqa: E402
from arraycheckpoint.planning.plan import PlanOptions  # noqa: E402
from arraycheckpoint.tools.verify import VerifyReport, _check_rank_packs, verify  # noqa: E402

TENSORS = 5000


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``TENSORS`` tensors of 4 floats in about 80 packs (a 64 KiB fill target)."""
    path = tmp_path_factory.mktemp("verify_scale") / "ck"
    state = {"model": {f"t{i}": torch.full((4,), float(i)) for i in range(TENSORS)}}
    acp.save(path, state, plan_options=PlanOptions(min_chunk_bytes=64 << 10))
    return path


def _packs(path: Path) -> list[Path]:
    return sorted((path / ".acp" / "packs").glob("*.zip"))


class _Count:
    """Counts calls of a module function, patched in place."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, module: object, name: str) -> None:
        self.calls = 0
        real = getattr(module, name)

        def counted(*args: object, **kwargs: object) -> object:
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)


def test_verify_reads_each_pack_directory_once(many: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    packs = len(_packs(many))
    assert packs >= 20  # the case the issue measured: many packs, thousands of packed chunks
    directories = _Count(monkeypatch, packdir, "_pack_directory")
    checks = _Count(monkeypatch, rankpacks, "check_rank_packs")
    report = verify(many)
    assert report.ok, report.problems[:3]
    assert (report.tensors, report.chunks) == (TENSORS, TENSORS)
    assert checks.calls == 1  # the load's own check; not again beforehand, never per tensor
    assert directories.calls == packs  # each pack's directory once (no probe past the last one)


def test_verify_no_data_checks_packs_once(many: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    directories = _Count(monkeypatch, packdir, "_pack_directory")
    report = verify(many, read_data=False)
    assert report.ok, report.problems[:3]
    assert directories.calls <= len(_packs(many)) + 1


def test_damaged_pack_is_narrowed_down_by_bisection(
    many: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(many, ck)
    victim = _packs(ck)[3]
    victim.write_bytes(victim.read_bytes()[:-200])  # its central directory cut: the pack is unreadable
    checks = _Count(monkeypatch, rankpacks, "check_rank_packs")
    report = verify(ck)
    assert not report.ok
    bad = {p.tensor for p in report.problems}
    assert bad and all(p.message.startswith("stored in packs") for p in report.problems)
    assert all(t.startswith("model/t") for t in bad)
    assert len(bad) < TENSORS // 10  # the arrays with a member in the cut pack, each named
    # the load's check, then one check naming every array of the cut pack, then one of the rest: not one per array
    assert checks.calls <= 4


def test_bisection_pins_one_damaged_array(monkeypatch: pytest.MonkeyPatch) -> None:
    """Damage that concerns one array of thousands costs a few checks (log2 of the arrays), not one each."""
    names = {f"model/t{i}" for i in range(TENSORS)}
    calls = []

    def check(_storage: object, _root: str, _meta: object, part: list[str], *_args: object) -> dict[str, int]:
        calls.append(len(part))
        if "model/t1234" in part:  # an error naming no tensor (no ``tensors``): bisected
            raise CorruptCheckpointError("model/t1234/c.0 is in none of rank 0's packs")
        return {}

    monkeypatch.setattr(rankpacks, "check_rank_packs", check)
    report = VerifyReport("ck")
    assert _check_rank_packs(None, "ck", None, report, names) == names - {"model/t1234"}  # type: ignore[arg-type]
    assert [(p.tensor, p.message) for p in report.problems] == [
        ("model/t1234", "stored in packs: model/t1234/c.0 is in none of rank 0's packs")
    ]
    assert len(calls) <= 2 * TENSORS.bit_length() + 1
