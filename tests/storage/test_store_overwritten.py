"""``checkpoint_store`` on S3 (s3fs) reads a checkpoint overwritten at the same URL as it is now.

s3fs keeps the listings it makes on a file system object that fsspec reuses for the same options, for the
life of the process, and answers sizes from them. A store over a checkpoint recording no fill target lists
``.acp/packs/`` once (:class:`arraycheckpoint.audit.packcount.PackCounts`); the checkpoint overwritten at the
same URL with packs of other sizes, a store opened next took the old sizes from that listing, read the wrong
end of each pack and refused the checkpoint as "not a ZIP archive as a save writes it". A store now drops
what the file system cached of its root when it opens (:func:`arraycheckpoint.interop.zarrranks.forget_listings`).
Real processes' saves, a real S3 server on loopback (moto), zarr-python reading; bit-exact.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

zarr = pytest.importorskip("zarr")
pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

from ends_helpers import upload  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.zarr import checkpoint_store  # noqa: E402

RANKS = 2
NAMES = [f"t{i:02d}" for i in range(8)]


def _state(seed: int, n: int) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    return {"model": {k: rng.standard_normal(n).astype(np.float32) for k in NAMES}}


@pytest.fixture(scope="module")
def saved(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    """Two checkpoints of other values and other pack sizes (256 and 300 floats per tensor)."""
    from simworld import run_ranks

    out = {}
    opts = acp.PlanOptions(min_chunk_bytes=2048)
    for seed, n in ((1, 256), (2, 300)):
        path = tmp_path_factory.mktemp(f"overwritten-{seed}") / "ck"
        run_ranks(RANKS, lambda c, p=path, s=seed, m=n: acp.save(p, _state(s, m), comm=c, plan_options=opts))
        out[n] = path
    return out


def _upload(s3: Any, local: Path, prefix: str, untargeted: bool) -> None:
    """``local`` at ``prefix``, replacing what was there; ``untargeted``: no fill target in the metadata."""
    for key in s3.keys(prefix + "/"):
        s3.client.delete_object(Bucket=s3.bucket, Key=key)
    upload(s3, local, untargeted=untargeted, prefix=prefix)


def _read(url: str, endpoint: str) -> dict[str, np.ndarray]:
    store = checkpoint_store(url, storage_options={"endpoint_url": endpoint})
    group = zarr.open_group(store, mode="r")
    return {k: group[f"model/{k}"][...] for k in NAMES}


@pytest.mark.parametrize("then", ["target", "no-target"])
@pytest.mark.parametrize("first", ["target", "no-target"])
def test_a_store_opened_after_an_overwrite_reads_the_new_checkpoint(
    s3_server: Any, saved: dict[int, Path], first: str, then: str
) -> None:
    prefix = f"overwritten-{first}-{then}"
    url = f"s3://{s3_server.bucket}/{prefix}"
    for n, seed, untargeted in ((256, 1, first == "no-target"), (300, 2, then == "no-target")):
        _upload(s3_server, saved[n], prefix, untargeted)  # the second: the checkpoint overwritten in place
        got = _read(url, s3_server.endpoint)  # a store opened on it, in the same process
        want = _state(seed, n)["model"]
        assert all(np.array_equal(got[k], v) for k, v in want.items())
