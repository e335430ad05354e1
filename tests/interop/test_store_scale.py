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

ROWS = 6000  # one chunk per row: 6000 packed chunks of 16 bytes


@pytest.fixture(scope="module")
def chunky(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, np.ndarray]:
    path = tmp_path_factory.mktemp("store_scale") / "ck"
    w = torch.arange(ROWS * 4, dtype=torch.float32).reshape(ROWS, 4)
    # [1, 4] chunks of 16 bytes, packs filled to 16 KiB: a few dozen packs
    opts = PlanOptions(max_chunk_bytes=16, inner_chunk_bytes=16, min_chunk_bytes=16 << 10)
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
