"""``checkpoint_store`` and the capacity count read packs' ends ahead on object stores; no probe past a rank's
last pack where the metadata records no fill target.

Counted on the wire by the proxy in front of the loopback S3 server (moto), which holds every request and
records how many GETs of packs it answers at once (no wall-clock assertion):

- ``checkpoint_store`` (zarr-python through s3fs) read every pack's directory one after another, one walk per
  member asked for, however many members zarr-python asked for at once: the members asked for together are
  now walked together, their packs' ends read ahead by the load's own mechanism
  (:class:`arraycheckpoint.audit.ahead.EndReads`): the same requests, several at once, bit-exact.
- A rank of more than 65,536 members spread over several packs: the capacity count (before a key is built per
  chunk) read their directories one after another; now ahead, in the load (``s3://``: tensorstore and
  botocore; ``s3a://``: s3fs) and in ``checkpoint_store`` alike.
- A checkpoint whose metadata records no fill target (the first format-6 code): every reader of a whole rank
  sent a request for the pack after its last one (absent); one listing of ``.acp/packs/`` replaces those, and
  every pack's end is then read ahead too.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

from ends_helpers import PACKS, RANKS, save_packs  # noqa: E402
from ends_helpers import state as _state  # noqa: E402
from ends_helpers import upload as _upload  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.audit import ahead, capacity  # noqa: E402
from arraycheckpoint.tools.verify import verify  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

N = 70_000  # chunks of one rank, above capacity.REMOTE_CAPACITY_FREE


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_packs(tmp_path_factory.mktemp("store-ends") / "ck")


@pytest.fixture(scope="module")
def many(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """``model/w`` of 70,000 chunks of one float, in 8 packs of rank 0 (about 10 MB)."""
    path = tmp_path_factory.mktemp("store-many") / "ck"
    opts = acp.PlanOptions(min_chunk_bytes=256 << 10, max_chunk_bytes=4, inner_chunk_bytes=4)
    acp.save(path, {"model": {"w": np.arange(N, dtype=np.float32)}}, plan_options=opts)
    assert len(list((path / ".acp" / "packs").iterdir())) > 4
    return path


def _alone(m: pytest.MonkeyPatch) -> None:
    """Every pack's end read by the walk itself, one after another (what readers did before)."""
    m.setattr(ahead, "EndReads", lambda *a: None)
    m.setattr(capacity, "EndReads", lambda *a: None)


def _alone_then_ahead(
    proxy: Any, monkeypatch: pytest.MonkeyPatch, read: Callable[[], None]
) -> list[tuple[str, str, str | None]]:
    """``read()`` with each pack's end read by the walk itself, then read ahead: the same requests for packs
    (returned), one end at a time, then more than one and at most the bound."""
    runs = {}
    for variant in ("alone", "ahead"):
        with monkeypatch.context() as m:
            if variant == "alone":
                _alone(m)
            _reset(proxy)
            read()
            runs[variant] = (_pack_requests(proxy), _ends_peak(proxy))
    (alone, alone_peak), (ahead_requests, peak) = runs["alone"], runs["ahead"]
    assert alone_peak == 1, alone_peak
    assert ahead_requests == alone, (ahead_requests, alone)  # the same requests, the same ranges
    assert 1 < peak <= ahead.WORKERS, peak
    return alone


def _reset(proxy: Any) -> None:
    proxy.requests.clear()
    proxy.timed.clear()
    proxy.peak = 0


def _ends_peak(proxy: Any) -> int:
    """The most packs' ends (each pack's first GET: its directory) read at once (members' reads, which
    zarr-python sends several at once anyway, not counted)."""
    return int(proxy.peak_of(proxy.first_pack_gets()))


def _pack_requests(proxy: Any) -> list[tuple[str, str, str | None]]:
    return sorted((m, p, r) for m, p, r, _n in proxy.requests if "/.acp/packs/" in p)


def _listings(proxy: Any) -> list[str]:
    """The listings of the packs (``.acp/packs/``) sent."""
    return [
        p
        for m, p, _r, _n in proxy.requests
        if m == "GET" and ("list-type" in p or "delimiter" in p) and "packs" in p
    ]


def _read_store(url: str, endpoint: str) -> dict[str, np.ndarray]:
    store = checkpoint_store(url, storage_options={"endpoint_url": endpoint})
    members = zarr.open_group(store, mode="r").members(max_depth=None)  # zarr fetches documents at once
    arrays = {k: v for k, v in members if isinstance(v, zarr.Array) and k.startswith("model/")}
    return {k.split("/", 1)[1]: a[...] for k, a in sorted(arrays.items())}


@pytest.mark.parametrize("untargeted", [False, True], ids=["target", "no-target"])
def test_the_store_reads_pack_ends_ahead(
    s3_server: Any, proxied: Any, small: Path, monkeypatch: pytest.MonkeyPatch, untargeted: bool
) -> None:
    """zarr-python lists and reads every tensor through ``checkpoint_store``: the same requests for packs as
    when each member walked alone, more than one pack GET at once and at most the bound, bit-exact."""
    url = f"s3://{s3_server.bucket}/{_upload(s3_server, small, untargeted)}"
    proxied.delay = 0.02
    want = _state()["model"]

    def read() -> None:
        got = _read_store(url, proxied.endpoint)
        assert set(got) == set(want) and all(np.array_equal(got[k], v) for k, v in want.items())

    alone = _alone_then_ahead(proxied, monkeypatch, read)
    assert not any(f".{PACKS}.zip" in p for _m, p, _r in alone), alone  # no pack past a rank's last one
    heads = [p for m, p, _r in alone if m == "HEAD"]
    # each pack's size, once (s3fs may answer them from its cache of the listing of the packs where it made one)
    assert len(heads) == len(set(heads)) and len(heads) in (
        (0, RANKS * PACKS) if untargeted else (RANKS * PACKS,)
    )


@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_an_untargeted_checkpoint_is_listed_once_not_probed_per_rank(
    s3_server: Any, proxied: Any, small: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No fill target in the metadata: a whole load and ``verify`` ask for no pack past a rank's last one
    (each asked for ``<rank>.16.zip`` before), list the packs once each, and read every pack's end ahead;
    bit-exact."""
    url = f"{scheme}://{s3_server.bucket}/{_upload(s3_server, small, untargeted=True)}"
    proxied.delay = 0.02
    want = _state()["model"]
    back = {"model": {k: np.zeros_like(v) for k, v in want.items()}}
    _reset(proxied)
    acp.load(url, back)
    assert all(np.array_equal(back["model"][k], v) for k, v in want.items())
    asked = {p.rpartition("/")[2].partition("?")[0] for _m, p, _r in _pack_requests(proxied)}
    assert asked == {f"{r}.{k}.zip" for r in range(RANKS) for k in range(PACKS)}, sorted(asked)
    assert len(_listings(proxied)) == 1, _listings(proxied)
    assert 1 < _ends_peak(proxied) <= ahead.WORKERS, _ends_peak(proxied)
    for read_data in (False, True):
        _reset(proxied)
        assert verify(url, read_data=read_data).ok
        assert not any(f".{PACKS}.zip" in p for _m, p, _r in _pack_requests(proxied))
        assert len(_listings(proxied)) == 1, (read_data, _listings(proxied))
    assert 1 < _ends_peak(proxied) <= ahead.WORKERS, _ends_peak(proxied)


@pytest.mark.parametrize("reader", ["s3", "s3a", "store", "s3 no-target", "store no-target"])
def test_the_capacity_count_reads_directories_ahead(
    s3_server: Any, proxied: Any, many: Path, reader: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A rank of 70,000 chunks over several packs: the count of their directories' entries (before a key is
    built per chunk) sends the same requests as when it read them one after another, several at once;
    each directory read once; bit-exact. Without a recorded fill target too (the packs listed once)."""
    untargeted = reader.endswith(" no-target")
    reader = reader.removesuffix(" no-target")
    prefix = _upload(s3_server, many, untargeted=untargeted)
    scheme = "s3" if reader == "store" else reader
    url = f"{scheme}://{s3_server.bucket}/{prefix}"
    proxied.delay = 0.02
    picked = [7, 65_537, N - 1]

    def read() -> None:
        if reader == "store":
            store = checkpoint_store(url, storage_options={"endpoint_url": proxied.endpoint})
            got = zarr.open_array(store, path="model/w", mode="r")[picked]
            assert np.array_equal(got, np.array(picked, dtype=np.float32))
        else:
            back = {"model": {"w": np.zeros(N, dtype=np.float32)}}
            acp.load(url, back)
            assert np.array_equal(back["model"]["w"], np.arange(N, dtype=np.float32))

    alone = _alone_then_ahead(proxied, monkeypatch, read)
    packs = len(list((many / ".acp" / "packs").iterdir()))
    assert len({p for m, p, _r in alone if m == "GET"}) == packs, sorted(alone)  # none past the last
    assert all(r is not None for m, _p, r in alone if m == "GET")  # ranged, never a pack whole


def test_a_damaged_pack_among_those_read_together_fails_its_own_tensor(
    s3_server: Any, proxied: Any, small: Path
) -> None:
    """The members zarr-python asks for at once are walked together: a pack whose end record is cut fails
    the read of its own tensor, naming it and the pack, and no other; every other tensor still reads
    bit-exactly through the same store."""
    import zipfile

    from arraycheckpoint.errors import CorruptCheckpointError

    damaged = ".acp/packs/2.9.zip"
    with zipfile.ZipFile(small / damaged) as zf:
        (inside,) = {n.rpartition("/")[0] for n in zf.namelist()}
    url = f"s3://{s3_server.bucket}/{_upload(s3_server, small, damage=damaged)}"
    store = checkpoint_store(url, storage_options={"endpoint_url": proxied.endpoint})
    with pytest.raises(CorruptCheckpointError, match=rf"{inside}.*2\.9\.zip|2\.9\.zip.*{inside}"):
        zarr.open_group(store, mode="r").members(max_depth=None)
    want = _state()["model"]
    for name, value in want.items():
        if f"model/{name}" != inside:
            assert np.array_equal(zarr.open_array(store, path=f"model/{name}", mode="r")[...], value), name
    with pytest.raises(CorruptCheckpointError, match=r"2\.9\.zip"):
        zarr.open_array(store, path=inside, mode="r")[...]
