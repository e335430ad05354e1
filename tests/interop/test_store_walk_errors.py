"""A pack's failure kept for a request that was cancelled is not served to a later request for that member.

``checkpoint_store`` walks the members asked for together in one walk (the first request's), and keeps the
error of another request's pack for that request. A request cancelled while it waited (zarr-python cancels
the reads of a failed ``gather``) never took its error, and a later request for the same member was answered
with it without reading anything: an old failure, possibly transient (a timeout, a pack being rewritten).
Only an error of a walk begun after a request counts for it now; the later request reads the pack again.
"""

from __future__ import annotations

import asyncio
import threading
import zipfile
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.errors import CorruptCheckpointError  # noqa: E402
from arraycheckpoint.interop.zarrranks import RankWalks  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

A = np.arange(256, dtype=np.float32)
B = np.arange(256, dtype=np.float32) + 1


def test_a_cancelled_requests_error_is_not_served_later(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ck = tmp_path / "ck"
    acp.save(ck, {"model": {"a": A, "b": B}}, plan_options=acp.PlanOptions(min_chunk_bytes=2048))
    packs = {
        zipfile.ZipFile(p).namelist()[0].rpartition("/")[0]: p for p in (ck / ".acp" / "packs").iterdir()
    }
    assert set(packs) == {"model/a", "model/b"}  # a pack each
    with zipfile.ZipFile(packs["model/b"]) as zf:
        doc_b = zf.read("model/b/zarr.json")
    whole = packs["model/b"].read_bytes()
    packs["model/b"].write_bytes(whole[:-30])  # its end record cut: the walk of model/b's pack fails

    entered, go = threading.Event(), threading.Event()
    walk_members = RankWalks._walk_members

    def gated(self: RankWalks, *args: object) -> None:  # the walk held until the test has cancelled
        entered.set()
        go.wait(30)
        walk_members(self, *args)

    monkeypatch.setattr(RankWalks, "_walk_members", gated)
    store = checkpoint_store(ck)

    async def scenario() -> None:
        first = asyncio.ensure_future(store.get("model/a/zarr.json"))
        second = asyncio.ensure_future(store.get("model/b/zarr.json"))  # walked in the first's walk
        while not entered.is_set():
            await asyncio.sleep(0.01)
        second.cancel()  # while it waits for the walk that reads its pack
        await asyncio.gather(second, return_exceptions=True)
        go.set()
        assert (await first) is not None
        assert second.cancelled()

    from zarr.core.sync import sync

    sync(scenario())
    packs["model/b"].write_bytes(whole)  # the pack whole again
    got = sync(store.get("model/b/zarr.json"))
    assert got is not None and got.to_bytes() == doc_b
    assert np.array_equal(zarr.open_array(store, path="model/b", mode="r")[...], B)
    assert np.array_equal(zarr.open_array(store, path="model/a", mode="r")[...], A)


def test_an_error_of_a_walk_begun_after_the_request_is_served(tmp_path: Path) -> None:
    """The control: two members asked for together, the second's pack damaged: its own request fails naming
    it (the error kept by the first request's walk), the first reads bit-exactly."""
    ck = tmp_path / "ck"
    acp.save(ck, {"model": {"a": A, "b": B}}, plan_options=acp.PlanOptions(min_chunk_bytes=2048))
    for p in (ck / ".acp" / "packs").iterdir():
        if zipfile.ZipFile(p).namelist()[0].startswith("model/b/"):
            p.write_bytes(p.read_bytes()[:-30])
    store = checkpoint_store(ck)

    async def both() -> list[object]:
        keys = ("model/a/zarr.json", "model/b/zarr.json")
        return list(await asyncio.gather(*(store.get(k) for k in keys), return_exceptions=True))

    from zarr.core.sync import sync

    got_a, got_b = sync(both())
    assert got_a is not None and not isinstance(got_a, BaseException)
    assert isinstance(got_b, CorruptCheckpointError) and "model/b" in str(got_b), got_b


def test_a_pack_that_failed_is_read_again_by_the_next_request(tmp_path: Path) -> None:
    """A pack whose read failed (cut short while it was rewritten) is read again by the next request for its
    members, which gets the pack as it is then: the store had counted it as read and answered "missing"."""
    ck = tmp_path / "ck"
    acp.save(ck, {"model": {"a": A, "b": B}}, plan_options=acp.PlanOptions(min_chunk_bytes=2048))
    (pack,) = (
        p
        for p in (ck / ".acp" / "packs").iterdir()
        if zipfile.ZipFile(p).namelist()[0].startswith("model/b/")
    )
    whole = pack.read_bytes()
    pack.write_bytes(whole[:-30])
    store = checkpoint_store(ck)
    with pytest.raises(CorruptCheckpointError, match="not a ZIP archive"):
        zarr.open_array(store, path="model/b", mode="r")
    with pytest.raises(CorruptCheckpointError, match="not a ZIP archive"):  # the same error again
        zarr.open_array(store, path="model/b", mode="r")
    pack.write_bytes(whole)
    assert np.array_equal(zarr.open_array(store, path="model/b", mode="r")[...], B)
    assert np.array_equal(zarr.open_array(store, path="model/a", mode="r")[...], A)
