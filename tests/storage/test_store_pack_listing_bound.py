"""``checkpoint_store`` lists ``.acp/packs/`` of a checkpoint without a fill target within a bound.

The listing that replaced the probe past each rank's last pack
(:class:`arraycheckpoint.audit.packcount.PackCounts`) read the whole directory, a page of 1,000 names per
request one after another, before the first read: a directory of millions of objects cost thousands of
requests where the probe cost one per rank. It now stops after ``world * LISTED_PER_RANK`` names (S3 through
s3fs: the pages stop there) and the walk probes instead, as before. Counted on the wire (the proxy in front of
moto on loopback); bit-exact.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

from ends_helpers import PACKS, RANKS, save_packs  # noqa: E402
from ends_helpers import state as _state  # noqa: E402
from ends_helpers import upload as _upload  # noqa: E402

from arraycheckpoint.audit import packcount  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

STRAYS = 1_000  # objects in .acp/packs/ that are no pack: the directory takes two pages to list


@pytest.fixture(scope="module")
def crowded(tmp_path_factory: pytest.TempPathFactory, s3_server: Any) -> str:
    """4 ranks of 16 packs, no fill target recorded, and 1,000 stray objects among the packs: the prefix."""
    prefix = _upload(s3_server, save_packs(tmp_path_factory.mktemp("listing-bound") / "ck"), untargeted=True)
    for i in range(STRAYS):
        s3_server.client.put_object(
            Bucket=s3_server.bucket, Key=f"{prefix}/.acp/packs/stray-{i:04d}", Body=b""
        )
    return prefix


def _listings(proxy: Any) -> list[str]:
    """The pages of the listing of ``.acp/packs/`` (not s3fs's check that an absent pack is no directory)."""
    return [p for m, p, _r, _n in proxy.requests if m == "GET" and "list-type" in p and "packs%2F&" in p]


def _read(url: str, endpoint: str) -> None:
    store = checkpoint_store(url, storage_options={"endpoint_url": endpoint})
    group = zarr.open_group(store, mode="r")
    for name, value in _state()["model"].items():
        assert np.array_equal(group[f"model/{name}"][...], value), name


@pytest.mark.parametrize("per_rank", [getattr(packcount, "LISTED_PER_RANK", 1000), 10])
def test_the_listing_stops_at_its_bound(
    s3_server: Any, proxied: Any, crowded: str, monkeypatch: pytest.MonkeyPatch, per_rank: int
) -> None:
    monkeypatch.setattr(packcount, "LISTED_PER_RANK", per_rank, raising=False)
    proxied.requests.clear()
    _read(f"s3://{s3_server.bucket}/{crowded}", proxied.endpoint)
    probes = {p for m, p, _r, _n in proxied.requests if f".{PACKS}.zip" in p and "/.acp/packs/" in p}
    if per_rank * RANKS >= RANKS * PACKS + STRAYS:  # the whole directory listed (two pages), no probe
        assert len(_listings(proxied)) == 2, _listings(proxied)
        assert not probes, probes
    else:  # past the bound after one page (1,000 names, more than 4 * 10): each rank probed, as before
        assert len(_listings(proxied)) == 1, _listings(proxied)
        assert len(probes) == RANKS, probes
