"""On object stores, the reads of packs' ends (their ZIP directories) overlap: one round trip, not one per pack.

A load, ``verify`` or ``export`` checks every pack it reads, rank after rank, each from one read of its end
(a suffix GET). Those ran one after another: 64 packs behind a store 50 ms away cost 64 round trips in a row.
They are now issued ahead of the walk (:class:`arraycheckpoint.audit.ahead.EndReads`), at most
:data:`~arraycheckpoint.audit.ahead.WORKERS` at once; the walk parses and checks each as before.

Counted on the wire by the proxy in front of the loopback S3 server (moto), which holds every request 50 ms
and records how many GETs of packs it answers at once: 4 simulated ranks wrote 16 small packs each. Through
``s3://`` (tensorstore and botocore's suffix GET) and ``s3a://`` (fsspec, s3fs): the same requests with the
same ranges as the walk alone sends, more than one and at most the bound at once, bit-exact (and the
same for ``verify``, and for a load of half the tensors: only their packs); a damaged
directory among them still fails naming its pack and tensor, and a store that stops answering still fails the
load within its ``timeout=``.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

from ends_helpers import PACKS, RANKS, save_packs  # noqa: E402
from ends_helpers import state as _state  # noqa: E402
from ends_helpers import upload as _upload  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.audit import ahead, rankpacks  # noqa: E402
from arraycheckpoint.errors import CorruptCheckpointError  # noqa: E402
from arraycheckpoint.tools.verify import verify  # noqa: E402


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_packs(tmp_path_factory.mktemp("ends") / "ck")


def _load(url: str, **kw: Any) -> dict[str, np.ndarray]:
    back = {"model": {k: np.zeros_like(v) for k, v in _state()["model"].items()}}
    acp.load(url, back, **kw)
    return back["model"]


def _pack_gets(proxy: Any) -> list[tuple[str, str | None]]:
    return sorted((p, r) for m, p, r, _n in proxy.requests if m == "GET" and "/.acp/packs/" in p)


@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_pack_ends_are_read_concurrently_within_the_bound(
    s3_server: Any, proxied: Any, local: Path, scheme: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = f"{scheme}://{s3_server.bucket}/{_upload(s3_server, local)}"
    proxied.delay = 0.05
    want = _state()["model"]
    runs = {}
    for variant in ("alone", "ahead"):
        with monkeypatch.context() as m:
            if variant == "alone":  # the walk reads each end itself: what a load did before
                m.setattr(rankpacks, "EndReads", lambda *a: None)
            proxied.requests.clear()
            proxied.peak = 0
            got = _load(url)
            runs[variant] = (_pack_gets(proxied), proxied.peak)
        assert all(np.array_equal(got[k], v) for k, v in want.items()), variant
    (alone, alone_peak), (ahead_gets, peak) = runs["alone"], runs["ahead"]
    assert len(alone) == RANKS * PACKS and alone_peak == 1, runs["alone"]  # each pack's end, once, in a row
    assert ahead_gets == alone, (ahead_gets, alone)  # the same requests, the same ranges
    assert 1 < peak <= ahead.WORKERS, peak
    proxied.requests.clear()
    proxied.peak = 0
    assert verify(url, read_data=False).ok  # verify walks the packs as the load does
    assert _pack_gets(proxied) == alone and 1 < proxied.peak <= ahead.WORKERS, proxied.peak
    proxied.requests.clear()
    proxied.peak = 0
    half = {"model": {k: np.zeros_like(v) for k, v in list(want.items())[::2]}}
    acp.load(
        url, half, strict=False
    )  # a part of the tensors: only the packs predicted to hold them, read ahead
    assert all(np.array_equal(v, want[k]) for k, v in half["model"].items())
    assert len(_pack_gets(proxied)) == RANKS * PACKS // 2 and 1 < proxied.peak <= ahead.WORKERS, proxied.peak


@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_a_damaged_directory_among_many_fails_naming_its_pack(
    s3_server: Any, proxied: Any, local: Path, scheme: str
) -> None:
    prefix = _upload(s3_server, local, damage=".acp/packs/2.9.zip")
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'model/t\d\d'.*2\.9\.zip") as err:
        _load(f"{scheme}://{s3_server.bucket}/{prefix}")
    assert len(err.value.tensors) == 1, err.value.tensors  # type: ignore[attr-defined]


@pytest.mark.parametrize("scheme", ["s3", "s3a"])
def test_a_stalled_store_fails_the_load_within_its_timeout(
    s3_server: Any, proxied: Any, local: Path, scheme: str
) -> None:
    url = f"{scheme}://{s3_server.bucket}/{_upload(s3_server, local)}"
    proxied.stall.set()  # every GET of a pack waits: the store stops answering
    outcome: dict[str, Any] = {}

    def run() -> None:
        start = time.monotonic()
        try:
            _load(url, timeout=2)
        except Exception as e:  # noqa: BLE001 - any error will do; hanging is the defect
            outcome["error"] = e
        outcome["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(40)
    proxied.release.set()
    assert not thread.is_alive(), "still waiting on a stalled store"
    error = outcome.get("error")
    assert error is not None and ".acp/packs/" in str(error), outcome
    assert outcome["seconds"] < 30, outcome
