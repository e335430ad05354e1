"""A checkpoint served over plain HTTP loads through fsspec's HTTP file system (read-only).

Before, every ``http://`` load failed with "the path does not exist": the backend stripped the scheme from
paths that HTTP's file system keeps as whole URLs. The loopback server is Python's ``http.server``, which
ignores ``Range`` (every ranged read returns the whole object): the reads are cut to the range asked for.
"""

from __future__ import annotations

import functools
import http.server
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("aiohttp", reason="fsspec's HTTP file system needs aiohttp (s3fs brings it)")

import arraycheckpoint as acp  # noqa: E402


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, str]]:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(_Quiet, directory=tmp_path))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield tmp_path, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("packed", [True, False])
def test_a_checkpoint_served_over_http_loads_bit_exact(served: tuple[Path, str], packed: bool) -> None:
    root, base = served
    rng = np.random.default_rng(5)
    state = {"m": {f"w{i:02d}": rng.standard_normal(1024).astype(np.float32) for i in range(30)}}
    options = {} if packed else {"plan_options": acp.PlanOptions(pack_array_bytes=0)}
    acp.save(root / "ck", state, **options)
    assert (root / "ck" / ".acp" / "packs").exists() == packed
    picked = ["w02", "w17", "w29"]
    back = {"m": {k: np.zeros(1024, np.float32) for k in picked}}
    acp.load(f"{base}/ck", back, strict=False)
    for k in picked:
        assert np.array_equal(back["m"][k], state["m"][k]), k
