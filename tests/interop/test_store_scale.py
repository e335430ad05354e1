"""``checkpoint_store`` reads an array of many packed chunks with one open per pack (issue 24).

Format 6 puts every small chunk file into its writer's packs; zarr-python asks the store for each chunk (and
its shard index) separately. The store must read each pack's ZIP directory once and keep the pack open, not
open (or parse) it per chunk. Counted, not timed: pack opens and directory reads against the number of packs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
zarr = pytest.importorskip("zarr")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.audit import packdir  # noqa: E402
from arraycheckpoint.interop import zarrfiles, zarrpacks  # noqa: E402
from arraycheckpoint.planning.plan import PlanOptions  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

ROWS = 2000  # one chunk per row: 2000 packed chunks of 16 bytes


@pytest.fixture(scope="module")
def chunky(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("store_scale") / "ck"
    w = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    # [1, 4] chunks of 16 bytes, packs filled to 6 KiB: 14 packs of about 140 rows
    opts = PlanOptions(max_chunk_bytes=16, inner_chunk_bytes=16, min_chunk_bytes=6 << 10)
    acp.save(path, {"model": {"w": w}}, plan_options=opts)
    return path, w.numpy()


def test_reading_many_packed_chunks_opens_each_pack_once(
    chunky: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    path, expected = chunky
    packs = len(list((path / ".acp" / "packs").glob("*.zip")))
    assert packs >= 10
    opens: list[str] = []
    real_open = zarrfiles._open_pack

    def counted_open(root: str, key: str) -> int:
        opens.append(key)
        return real_open(root, key)

    directories: list[str] = []
    real_directory = packdir._pack_directory

    def counted_directory(storage: object, base: str, key: str, *args: object, **kwargs: object) -> object:
        entries, size = real_directory(storage, base, key, *args, **kwargs)
        if size is not None:  # not the probe past the last pack
            directories.append(key)
        return entries, size

    monkeypatch.setattr(zarrfiles, "_open_pack", counted_open)
    monkeypatch.setattr(packdir, "_pack_directory", counted_directory)
    store = checkpoint_store(path)
    try:
        got = zarr.open_group(store, mode="r")["model/w"][...]
    finally:
        store.close()
    assert np.array_equal(got, expected)  # bit-exact, every chunk from its pack
    assert len(directories) == len(set(directories)) == packs  # each directory parsed once
    assert len(opens) == packs  # one open per pack (concurrent first reads of a pack open it once)
    assert len(set(opens)) == packs


def test_open_packs_are_bounded(chunky: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch) -> None:
    """With fewer descriptors allowed than packs, reads still succeed and at most that many stay open."""
    path, expected = chunky
    monkeypatch.setattr(zarrpacks, "MAX_OPEN_PACKS", 4)
    store = checkpoint_store(path)
    try:
        got = zarr.open_group(store, mode="r")["model/w"][...]
        assert store._fds is not None and len(store._fds._open) <= 4
    finally:
        store.close()
    assert np.array_equal(got, expected)
    assert store._fds is not None and not store._fds._open  # closed with the store


def _count_directories(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Pack directories read (and checked) from now on, by key (the probe past a rank's last pack left out)."""
    directories: list[str] = []
    real_directory = packdir._pack_directory

    def counted_directory(storage: object, base: str, key: str, *args: object, **kwargs: object) -> object:
        entries, size = real_directory(storage, base, key, *args, **kwargs)
        if size is not None:
            directories.append(key)
        return entries, size

    monkeypatch.setattr(packdir, "_pack_directory", counted_directory)
    return directories


def test_a_few_chunks_read_only_the_packs_holding_them(
    chunky: tuple[Path, np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rows of three chunks far apart read the directories of the three packs that hold them, each once (the
    store read every pack of the writing rank for its first chunk: dozens); then the whole array, every pack
    once more at most once, bit-exactly."""
    path, expected = chunky
    packs = len(list((path / ".acp" / "packs").glob("*.zip")))
    directories = _count_directories(monkeypatch)
    store = checkpoint_store(path)
    try:
        array = zarr.open_group(store, mode="r")["model/w"]
        rows = [10, ROWS // 2, ROWS - 3]
        assert all(np.array_equal(array[r], expected[r]) for r in rows)
        assert len(directories) == len(set(directories)) == 3, directories
        assert np.array_equal(array[...], expected)
    finally:
        store.close()
    assert len(directories) == len(set(directories)) == packs, directories


def test_a_member_twice_in_a_ranks_packs_is_refused_once_every_pack_is_read(
    chunky: tuple[Path, np.ndarray], tmp_path: Path
) -> None:
    """The writing rank's last pack holding a second copy of a chunk of its first: a read of a few rows reads
    only their packs (as a partial load does), a read of the whole array reads every pack the rank wrote, as
    ``verify`` and a whole load do, and refuses it naming the pack and the member. (A pack past the last one
    the rank wrote is opened by no reader: ``tests/interop/test_store_agreement.py``.)"""
    import re
    import shutil
    import zipfile

    from arraycheckpoint.errors import CorruptCheckpointError

    path, expected = chunky
    ck = tmp_path / "ck"
    shutil.copytree(path, ck)
    packs = len(list((ck / ".acp" / "packs").glob("*.zip")))
    assert packs >= 3, packs
    with zipfile.ZipFile(ck / ".acp" / "packs" / "0.0.zip") as zf:
        member = next(n for n in zf.namelist() if "/c." in n)
        body = zf.read(member)
    with zipfile.ZipFile(ck / ".acp" / "packs" / f"0.{packs - 1}.zip", "a") as zf:
        zf.writestr(member, body)
    store = checkpoint_store(ck)
    try:
        array = zarr.open_group(store, mode="r")["model/w"]
        assert np.array_equal(array[ROWS // 2], expected[ROWS // 2])
        # one row after the other (a pack holds over a hundred rows: every pack is read), not concurrently: no
        # read is left running after the error
        with pytest.raises(
            CorruptCheckpointError, match=re.escape(f"0.{packs - 1}.zip holds the member {member!r}")
        ):
            for row in [*range(0, ROWS, 50), ROWS - 1]:  # the last pack may hold fewer than 50 rows
                assert np.array_equal(array[row], expected[row])
    finally:
        store.close()
