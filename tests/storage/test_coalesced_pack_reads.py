"""A load from S3 reads a pack's members in few merged ranged GETs, not one GET per member.

Counted on the wire by the proxy in front of the loopback S3 server (moto's server mode): a load of 48 small
tensors and one of 384 KiB (each a ``zarr.json`` and one chunk in rank 0's pack) sent 101 GETs to the pack
before (its directory, then every member alone); now 2: the read of its end (which holds its directory and
its last members, served from it) and one merged GET of the rest. Every tensor is bit-exact, a flipped byte
in a member is still refused naming the tensor and the pack, and the merge never asks for more than the pack's
members, nor more than its caps (unit tests of :mod:`arraycheckpoint.engine.coalesce` on tensorstore's memory
key-value store, through a wrapper recording each read)."""

from __future__ import annotations

import uuid
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint.audit import packdir  # noqa: E402
from arraycheckpoint.engine import coalesce  # noqa: E402
from arraycheckpoint.errors import CorruptCheckpointError  # noqa: E402
from arraycheckpoint.storage import configure  # noqa: E402

N = 48


def _state() -> dict[str, Any]:
    g = torch.Generator().manual_seed(5)
    model = {f"w{i}": torch.randn(16, generator=g) for i in range(N)}
    model["h"] = torch.randn(8, 6, generator=g).to(torch.bfloat16)
    model["big"] = torch.randn(96, 1024, generator=g)  # 384 KiB, packed: the pack outgrows its first read
    return {"model": model}


def _pack_gets(proxy: Any, packs: list[str]) -> list[tuple[str, int]]:
    """The GETs of the packs ``packs`` (their directories' and their members'): (Range, bytes)."""
    return [(r or "", n) for m, p, r, n in proxy.requests if m == "GET" and p.endswith(tuple(packs))]


def _load(url: str) -> dict[str, torch.Tensor]:
    target = {"model": {k: torch.zeros_like(v) for k, v in _state()["model"].items()}}
    acp.load(url, target)
    return target["model"]


def test_a_load_reads_each_pack_in_merged_ranged_gets(s3_server: Any, fault_proxy: Any) -> None:
    prefix = f"co-{uuid.uuid4().hex[:8]}/ck"
    url = f"s3://{s3_server.bucket}/{prefix}"
    acp.save(url, _state())
    packs = [k for k in s3_server.keys(prefix) if "/.acp/packs/" in k]
    configure("s3", endpoint=fault_proxy.endpoint)
    try:
        got = _load(url)
        merged = _pack_gets(fault_proxy, packs)
        fault_proxy.requests.clear()
        gap, cap, held = coalesce.GAP, coalesce.SPAN_BYTES, packdir.KEEP_HELD_BYTES
        # every member alone, none served from the directory's read: what a load sent before
        coalesce.GAP = coalesce.SPAN_BYTES = packdir.KEEP_HELD_BYTES = 0
        try:
            again = _load(url)
        finally:
            coalesce.GAP, coalesce.SPAN_BYTES, packdir.KEEP_HELD_BYTES = gap, cap, held
        alone = _pack_gets(fault_proxy, packs)
    finally:
        configure("s3", endpoint=None)
    for name, value in _state()["model"].items():
        assert torch.equal(got[name], value) and torch.equal(again[name], value), name
    assert len(alone) >= 2 * N, alone  # a zarr.json and a chunk per tensor
    # each pack: its end (which holds its directory and its last members), then one merged GET of the rest
    assert len(merged) <= 2 * len(packs), (merged, packs)
    sizes = {k: s3_server.client.head_object(Bucket=s3_server.bucket, Key=k)["ContentLength"] for k in packs}
    # each byte once, but a member straddling the start of the pack's end read (its directory's read)
    assert sum(n for _r, n in merged) <= sum(sizes.values()) + packdir._PACK_TAIL_BYTES * len(packs)


def test_a_small_pack_is_read_once_whole_by_its_first_ranged_get(s3_server: Any, fault_proxy: Any) -> None:
    """A pack smaller than its first read (256 KiB from its end): that GET holds every member, which are
    served from it. It was 2 GETs of the whole pack (tensorstore refuses a suffix longer than the object after
    fetching it, then the pack was read whole) and one per member."""
    prefix = f"small-{uuid.uuid4().hex[:8]}/ck"
    url = f"s3://{s3_server.bucket}/{prefix}"
    state = {"model": {f"w{i}": torch.full((4,), float(i)) for i in range(20)}}
    acp.save(url, state)
    packs = [k for k in s3_server.keys(prefix) if "/.acp/packs/" in k]
    configure("s3", endpoint=fault_proxy.endpoint)
    try:
        target = {"model": {k: torch.zeros(4) for k in state["model"]}}
        acp.load(url, target)
    finally:
        configure("s3", endpoint=None)
    assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
    size = s3_server.client.head_object(Bucket=s3_server.bucket, Key=packs[0])["ContentLength"]
    assert len(packs) == 1 and _pack_gets(fault_proxy, packs) == [
        (f"bytes=-{packdir._PACK_TAIL_BYTES}", size)
    ]


def test_a_flipped_byte_in_a_merged_read_is_refused_naming_tensor_and_pack(
    s3_server: Any, s3_prefix: str
) -> None:
    url = f"{s3_prefix}/flip"
    acp.save(url, _state())
    prefix = url.split("/", 3)[3]
    (pack,) = [k for k in s3_server.keys(prefix) if k.endswith("/.acp/packs/0.0.zip")]
    body = bytearray(s3_server.client.get_object(Bucket=s3_server.bucket, Key=pack)["Body"].read())
    import io
    import zipfile

    with zipfile.ZipFile(io.BytesIO(bytes(body))) as z:
        info = z.getinfo("model/w7/c.0")
    at = info.header_offset + 30 + len(info.filename) + 5  # a byte of w7's data
    body[at] ^= 0x40
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=pack, Body=bytes(body))
    with pytest.raises(CorruptCheckpointError, match=r"model/w7.*0\.0\.zip"):
        _load(url)


class _Counted:
    """tensorstore's memory key-value store, recording every ranged read asked of it (a wrapper of the real
    store, which answers every read)."""

    def __init__(self, data: dict[str, bytes]) -> None:
        import tensorstore as ts

        self.kv = ts.KvStore.open({"driver": "memory"}).result()
        for k, v in data.items():
            self.kv.write(k, v).result()
        self.asked: list[tuple[str, int, int]] = []

    def read(self, key: str, byte_range: slice) -> Any:
        self.asked.append((key, byte_range.start, byte_range.stop))
        return self.kv.read(key, byte_range=byte_range)


def test_spans_merge_small_holes_and_stop_at_their_caps() -> None:
    ranges = [(0, 10), (15, 10), (40, 5), (10_000, 100), (10_050, 10)]
    assert coalesce.spans(ranges, gap=20, cap=1_000) == [(0, 45), (10_000, 10_100)]
    assert coalesce.spans(ranges, gap=0, cap=1_000) == [(0, 10), (15, 25), (40, 45), (10_000, 10_100)]
    # the cap: adjacent ranges split into spans of at most ``cap`` bytes; one range above it alone
    assert coalesce.spans([(i * 10, 10) for i in range(10)], gap=1, cap=30) == [
        (0, 30),
        (30, 60),
        (60, 90),
        (90, 100),
    ]
    assert coalesce.spans([(0, 5), (5, 100), (105, 5)], gap=1, cap=30) == [(0, 5), (5, 105), (105, 110)]
    # untrusted offsets and sizes: past the pack's end or negative, left out (read alone, refused there)
    assert coalesce.spans([(0, 10), (5, 1 << 40), (-5, 10), (20, -1)], limit=100, gap=50) == [(0, 10)]


def test_span_reader_serves_views_reads_ahead_within_its_bounds_and_never_past_the_pack() -> None:
    data = {"a.zip": bytes(range(256)) * 40, "b.zip": bytes(reversed(range(256))) * 40}
    kv = _Counted(data)
    plan = [
        ("a.zip", [(i * 100, 60) for i in range(100)], len(data["a.zip"]), None),
        # the second range reaches past the pack's (checked) end; its last bytes were read with its directory
        ("b.zip", [(0, 10), (5_000, 10_000), (9_000, 100)], 8_000, (8_960, data["b.zip"][8_960:])),
    ]
    reader = coalesce.SpanReader(kv, plan, gap=50, cap=2_000, ahead_bytes=4_000, ahead_spans=3)
    assert len(kv.asked) == 2, kv.asked  # issued ahead, within 4,000 bytes
    for i in range(100):
        view = reader.read("a.zip", i * 100, 60)
        assert view is not None and view.tobytes() == data["a.zip"][i * 100 : i * 100 + 60]
        assert len(kv.asked) - i // 20 <= 3  # at most 3 spans (4,000 bytes) issued and not yet passed
    assert reader.read("b.zip", 0, 10).tobytes() == data["b.zip"][:10]  # type: ignore[union-attr]
    assert reader.read("b.zip", 5_000, 10_000) is None  # never merged: read alone, refused there
    assert reader.read("b.zip", 9_000, 100).tobytes() == data["b.zip"][9_000:9_100]  # type: ignore[union-attr]
    assert reader.read("a.zip", 0, 60) is None  # behind the reads: dropped, read alone
    assert all(end - start <= 2_000 for _k, start, end in kv.asked)
    assert all(end <= len(data[k]) for k, _s, end in kv.asked)
    assert sum(end - start for _k, start, end in kv.asked) == 5 * 1_960 + 10
    assert reader.requests == len(kv.asked) == 5 + 1


def test_a_span_the_pack_no_longer_holds_serves_nothing() -> None:
    """The pack shrank after its checks found 1,000 bytes: the span's read is refused (tensorstore's
    OUT_OF_RANGE; S3 answers the bytes it has: the members past them are refused the same way), and every
    member is read alone, where the load names what is wrong."""
    kv = _Counted({"a.zip": b"x" * 50})
    reader = coalesce.SpanReader(kv, [("a.zip", [(0, 10), (40, 20)], 1_000, None)])
    assert reader.read("a.zip", 0, 10) is None
    assert reader.read("a.zip", 40, 20) is None
    assert kv.asked == [("a.zip", 0, 60)]
    short = coalesce.SpanReader(_Counted({"a.zip": b"x" * 50}), [("a.zip", [(0, 10), (40, 10)], 1_000, None)])
    assert np.array_equal(short.read("a.zip", 0, 10), np.frombuffer(b"x" * 10, np.uint8))


def test_a_read_past_spans_never_asked_for_skips_them() -> None:
    """Reads that skip spans (members served otherwise): the span asked for is read, those skipped never."""
    data = bytes(range(256)) * 4
    kv = _Counted({"a.zip": data})
    plan = [("a.zip", [(0, 10), (100, 10), (200, 10), (300, 10)], len(data), None)]
    reader = coalesce.SpanReader(kv, plan, gap=5, ahead_spans=1)
    assert reader.read("a.zip", 300, 10).tobytes() == data[300:310]  # type: ignore[union-attr]
    assert kv.asked == [("a.zip", 0, 10), ("a.zip", 300, 310)]
    assert reader.read("a.zip", 100, 10) is None  # behind: read alone
