"""A damaged directory entry of one array's member fails that array alone through ``checkpoint_store``, as it
does in ``acp.load`` and ``verify``, also where another array's members share its pack.

One pack holds ``model/a/c.0`` and ``model/b/c.0``; the central directory says ``model/b/c.0`` is deflated
(method 8). The load of ``model/a`` alone never looks at ``model/b``'s entry and reads it bit-exactly;
``verify`` reports ``model/b`` only. The zarr store read every member predicted in the pack together and
refused the whole pack naming ``model/b``, so ``model/a`` could not be read through zarr-python at all. Now
the store serves ``model/a`` bit-exactly and refuses ``model/b`` naming it, whether the two are asked for
one after another or together (zarr-python's ``members()``), and whether the metadata records the packs'
fill target or not (the whole rank walked at once).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.errors import CorruptCheckpointError  # noqa: E402
from arraycheckpoint.tools.verify import verify  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

A = np.arange(64, dtype=np.float32)
B = np.arange(64, dtype=np.float32) + 1


def _deflated_in_directory(pack: Path, member: str) -> None:
    """``member``'s central-directory entry in ``pack`` says method 8 (deflate); nothing else changes."""
    raw = bytearray(pack.read_bytes())
    cd_size, cd_off = struct.unpack_from("<LL", raw, len(raw) - 22 + 12)
    p, hit = cd_off, False
    while p < cd_off + cd_size:
        nl, el, cl = struct.unpack_from("<HHH", raw, p + 28)
        if raw[p + 46 : p + 46 + nl].decode() == member:
            struct.pack_into("<H", raw, p + 10, 8)
            hit = True
        p += 46 + nl + el + cl
    assert hit, member
    pack.write_bytes(bytes(raw))


@pytest.fixture(params=["target", "no-target"])
def damaged(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    ck = tmp_path / "ck"
    acp.save(ck, {"model": {"a": A, "b": B}})
    (pack,) = (ck / ".acp" / "packs").iterdir()
    _deflated_in_directory(pack, "model/b/c.0")
    if request.param == "no-target":  # as the first format-6 code wrote it: the whole rank walked at once
        meta = ck / ".acp" / "metadata.json"
        doc = json.loads(meta.read_text())
        for t in doc["tensors"].values():
            if t.get("pack"):
                t["pack"] = t["pack"].partition("@")[0]
        meta.write_text(json.dumps(doc))
    return ck


def test_the_readers_agree_per_tensor(damaged: Path) -> None:
    back = {"model": {"a": np.zeros_like(A)}}
    acp.load(damaged, back, strict=False)
    assert np.array_equal(back["model"]["a"], A)
    with pytest.raises(CorruptCheckpointError, match=r"model/b.*compressed"):
        acp.load(damaged, {"model": {"b": np.zeros_like(B)}}, strict=False)
    assert sorted({p.tensor for p in verify(damaged).problems}) == ["model/b"]


@pytest.mark.parametrize("first", ["a", "b"])
def test_the_store_serves_the_healthy_array_and_refuses_the_damaged_one(damaged: Path, first: str) -> None:
    store = checkpoint_store(damaged)
    for name in (first, "b" if first == "a" else "a"):
        if name == "a":
            assert np.array_equal(zarr.open_array(store, path="model/a", mode="r")[...], A)
        else:
            with pytest.raises(CorruptCheckpointError, match=r"tensor 'model/b'.*compressed") as err:
                zarr.open_array(store, path="model/b", mode="r")[...]
            assert "model/a" not in str(err.value)


def test_asked_for_together(damaged: Path) -> None:
    """Both arrays' documents asked for at once (zarr-python's ``members()``), then both chunks at once (one
    walk of the pack for the two requests): ``model/b``'s read fails naming it, ``model/a``'s is bit-exact."""
    import asyncio

    from zarr.api.asynchronous import open_array
    from zarr.core.sync import sync

    store = checkpoint_store(damaged)
    found = {k for k, _v in zarr.open_group(store, mode="r").members(max_depth=None)}
    assert {"model/a", "model/b"} <= found, found

    async def both() -> list[object]:
        arrays = [await open_array(store=store, path=f"model/{n}", mode="r") for n in "ab"]
        return list(await asyncio.gather(*(a.getitem(...) for a in arrays), return_exceptions=True))

    got_a, got_b = sync(both())
    assert isinstance(got_a, np.ndarray) and np.array_equal(got_a, A)
    assert isinstance(got_b, CorruptCheckpointError) and "tensor 'model/b'" in str(got_b), got_b
    assert "model/a" not in str(got_b)
