"""A ranged read queued behind a slow but live store's calls, each slower than the stall bound but within its
own bound (the stall bound plus a second per MiB), waits for them instead of failing as a stall.

Before (review23a P2): a queued read failed once its store answered nothing for the stall bound, whatever
the calls in flight there: 32 reads of 2 MiB each taking 2 s (bound 3 s with ``timeout=1``) all succeeded,
and a small read of another load queued behind them failed at 1.5 s as "the store stalls"."""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec_helpers import LocalUnder

from arraycheckpoint.storage import ranged
from arraycheckpoint.storage.fsspec_store import FsspecStorage

_BIG = 4 << 20  # bound 1 s + 4 s: a read of it taking 2 s is well within its bound


class _SlowBigFS(LocalUnder):
    protocol = ("acpslowbig",)

    def cat_file(self, path: Any, start: Any = None, end: Any = None, **kw: Any) -> Any:
        if (end or 0) - (start or 0) >= _BIG:
            time.sleep(2.0)  # a live store moving a big range slowly: longer than the stall bound
        return super().cat_file(path, start=start, end=end, **kw)


def test_a_read_queued_behind_slow_live_calls_waits_for_them(tmp_path: Path) -> None:
    fsspec.register_implementation("acpslowbig", _SlowBigFS, clobber=True)
    (tmp_path / "pack").write_bytes(bytes(range(256)) * (_BIG // 256))
    storage = FsspecStorage("acpslowbig", {"acp_test_session": uuid.uuid4().hex})
    storage.stall_timeout = 1.0
    load_a = storage.ranged_reads(f"acpslowbig://{tmp_path}")
    load_b = storage.ranged_reads(f"acpslowbig://{tmp_path}")
    spans = [load_a.read("pack", byte_range=slice(0, _BIG)) for _ in range(ranged._WORKERS)]
    small = load_b.read("pack", byte_range=slice(256, 260))  # queued: every worker holds a slow read
    assert small.result().value == bytes(range(4))
    assert all(f.result().value == bytes(range(256)) * (_BIG // 256) for f in spans)
