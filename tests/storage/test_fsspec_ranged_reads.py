"""An fsspec load reads packed members with merged ranged reads, and no reader probes a pack past the last one.

Counted on the wire by the proxy in front of the loopback S3 server (moto), read through s3fs (``s3a://``,
the fsspec backend: what gcsfs, HTTP and every other fsspec file system get too). Before, an fsspec load
downloaded every pack of the checkpoint whole (one listing, then one GET of each whole pack): a load of 3
small tensors of a 5 MB pack fetched all of it. Now the pack's end (its directory) and the members' merged
spans (:mod:`arraycheckpoint.engine.coalesce`), each a ranged ``cat_file``. Every member is still checked (a
flipped byte, a local header or a central directory that lies are refused naming the tensor and the pack).

A load reading every member of a rank read its packs up to the first absent one: one request per saving rank
for a pack that does not exist. The metadata says how many packs each rank's save wrote (its members and the
fill target in ``pack``: :func:`arraycheckpoint.audit.predict.predicted_fill`), so that request is gone
(counted at 4 simulated saving ranks, on ``s3://`` and through fsspec).
"""

from __future__ import annotations

import os
import struct
import uuid
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("s3fs", reason="s3fs is not installed (the 'dev' extra lists it)")

from faults.packtools import flip_member_byte, set_local_header  # noqa: E402

import arraycheckpoint as acp  # noqa: E402
from arraycheckpoint import storage  # noqa: E402
from arraycheckpoint.audit import packdir  # noqa: E402
from arraycheckpoint.errors import CorruptCheckpointError  # noqa: E402
from arraycheckpoint.storage import configure  # noqa: E402
from arraycheckpoint.storage.fsspec_store import FsspecStorage  # noqa: E402

N = 300  # tensors of 16 KiB: one pack of about 5 MB


@pytest.fixture
def s3a(s3_server: Any, fault_proxy: Any) -> Iterator[Any]:
    """``s3a://`` URLs through fsspec (s3fs) to the loopback server, through the counting proxy."""
    storage.register_scheme("s3a", lambda: FsspecStorage("s3a", {"endpoint_url": fault_proxy.endpoint}))
    try:
        yield fault_proxy
    finally:
        storage.register_scheme("s3a", None)


def _upload(s3_server: Any, local: Path, prefix: str) -> None:
    for path in sorted(p for p in local.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(local).as_posix()}"
        s3_server.client.put_object(Bucket=s3_server.bucket, Key=key, Body=path.read_bytes())


def _pack_gets(proxy: Any) -> list[tuple[str, str | None, int]]:
    """The GETs of packs the proxy forwarded: (path, Range, bytes)."""
    return [(p, r, n) for m, p, r, n in proxy.requests if m == "GET" and "/.acp/packs/" in p]


def _state() -> dict[str, Any]:
    rng = np.random.default_rng(7)
    return {"model": {f"w{i:03d}": rng.standard_normal(4096).astype(np.float32) for i in range(N)}}


def test_an_fsspec_load_of_a_few_members_reads_them_not_the_pack(
    s3_server: Any, s3a: Any, tmp_path: Path
) -> None:
    local = tmp_path / "ck"
    acp.save(local, _state())
    (pack,) = (local / ".acp" / "packs").iterdir()
    size = pack.stat().st_size
    prefix = f"ranged-{uuid.uuid4().hex[:8]}"
    _upload(s3_server, local, prefix)
    url = f"s3a://{s3_server.bucket}/{prefix}"
    want = _state()["model"]
    picked = ["w003", "w150", f"w{N - 1:03d}"]
    s3a.requests.clear()
    few = {"model": {k: np.zeros(4096, np.float32) for k in picked}}
    acp.load(url, few, strict=False)
    assert all(np.array_equal(few["model"][k], want[k]) for k in picked)
    gets = _pack_gets(s3a)
    # its end (the directory, and w299 in it), then one merged span per member before it: never the pack
    assert gets[0][1] == f"bytes=-{packdir._PACK_TAIL_BYTES}" and all(r for _p, r, _n in gets), gets
    assert len(gets) <= 3 and sum(n for *_, n in gets) < packdir._PACK_TAIL_BYTES + 2 * (64 << 10), gets
    assert sum(n for *_, n in gets) < size / 10, (gets, size)  # was the whole pack: 5 MB for 48 KiB

    s3a.requests.clear()
    whole = {"model": {k: np.zeros_like(v) for k, v in want.items()}}
    acp.load(url, whole)
    assert all(np.array_equal(whole["model"][k], v) for k, v in want.items())
    gets = _pack_gets(s3a)
    assert len(gets) == 2, gets  # its end, then one span of every member before it (at most 16 MiB)
    assert sum(n for *_, n in gets) <= size + packdir._PACK_TAIL_BYTES, (gets, size)
    assert not [m for m, p, _r, _n in s3a.requests if "list-type" in p], s3a.requests  # no listing either


def _lie(pack: Path, member: str, how: str) -> None:
    """Make ``pack``'s central directory lie about ``member``: its sizes 100 bytes larger (it then overlaps
    the next member's header), or its local header's offset the first member's."""
    raw = bytearray(pack.read_bytes())
    name = member.encode()
    at = next(i for i in _entries(raw) if raw[i + 46 : i + 46 + len(name)] == name)
    if how == "sizes":
        csize, usize = struct.unpack_from("<2L", raw, at + 20)
        struct.pack_into("<2L", raw, at + 20, csize + 100, usize + 100)
    else:
        struct.pack_into("<L", raw, at + 42, 0)
    pack.write_bytes(bytes(raw))


def _entries(raw: bytearray) -> Iterator[int]:
    at = raw.find(b"PK\x01\x02")
    while at >= 0:
        yield at
        at = raw.find(b"PK\x01\x02", at + 4)


@pytest.mark.parametrize(
    "damage", ["flipped byte", "local header sizes", "directory sizes", "directory offset"]
)
def test_a_damaged_member_read_in_a_span_is_refused_naming_tensor_and_pack(
    s3_server: Any, s3a: Any, tmp_path: Path, damage: str
) -> None:
    """``model/w``'s chunk lies at the pack's start, before the 256 KiB its directory's read fetches from the
    end, so it is read in a merged span: a flipped byte (its crc32c), a local header whose sizes differ from
    the directory's, a directory entry 100 bytes larger than the member (reaching into the next header) or
    pointing at another member's header: each refused as a local load refuses it, naming tensor and pack."""
    local = tmp_path / "ck"
    state = {"model": {"w": np.arange(64 * 32, dtype=np.float32), "x": np.ones((96, 1024), np.float32)}}
    acp.save(local, state)
    pack = local / ".acp" / "packs" / "0.0.zip"
    with zipfile.ZipFile(pack) as zf:
        assert zf.getinfo("model/w/c.0").header_offset < pack.stat().st_size - packdir._PACK_TAIL_BYTES
    if damage == "flipped byte":
        flip_member_byte(pack, "model/w/c.0", 5)
    elif damage == "local header sizes":
        set_local_header(pack, "model/w/c.0", sizes=(100, 100))
    else:
        _lie(pack, "model/w/c.0", damage.split()[1])
    target = {"model": {k: np.zeros_like(v) for k, v in state["model"].items()}}
    with pytest.raises(CorruptCheckpointError) as here:
        acp.load(local, target)
    prefix = f"lie-{uuid.uuid4().hex[:8]}"
    _upload(s3_server, local, prefix)
    s3a.requests.clear()
    with pytest.raises(CorruptCheckpointError) as there:
        acp.load(f"s3a://{s3_server.bucket}/{prefix}", target)
    message = str(there.value)
    assert "model/w" in message and f"{prefix}/.acp/packs/0.0.zip" in message, message
    assert "model/w" in str(here.value), here.value
    assert all(r for _p, r, _n in _pack_gets(s3a)), s3a.requests  # ranged reads only


def test_no_reader_probes_a_pack_past_the_last_one_each_rank_wrote(
    s3_server: Any, s3a: Any, tmp_path: Path
) -> None:
    """4 simulated ranks each wrote one pack (``<rank>.0.zip``); a load of every tensor reads every rank's
    whole pack. On ``s3://`` it then asked for ``<rank>.1.zip`` (absent) of each rank: 4 GETs answered 404
    (through fsspec it listed the packs and downloaded each whole). Now neither asks for a pack past the last
    one each rank wrote; bit-exact."""
    from simworld import run_ranks

    rng = np.random.default_rng(1)
    state = {"model": {f"t{i:02d}": rng.standard_normal(256).astype(np.float32) for i in range(40)}}
    local = tmp_path / "ck"
    run_ranks(4, lambda c: acp.save(local, state, comm=c))
    assert sorted(os.listdir(local / ".acp" / "packs")) == [f"{r}.0.zip" for r in range(4)]
    prefix = f"ranks-{uuid.uuid4().hex[:8]}"
    _upload(s3_server, local, prefix)
    for scheme in ("s3", "s3a"):
        configure("s3", endpoint=s3a.endpoint)
        s3a.requests.clear()
        try:
            back = {"model": {k: np.zeros_like(v) for k, v in state["model"].items()}}
            acp.load(f"{scheme}://{s3_server.bucket}/{prefix}", back)
        finally:
            configure("s3", endpoint=None)
        assert all(np.array_equal(back["model"][k], v) for k, v in state["model"].items()), scheme
        packs = [p for m, p, _r, _n in s3a.requests if "/.acp/packs/" in p]
        assert packs and not [p for p in packs if p.endswith(".1.zip")], (scheme, packs)
        assert {p.rsplit("/", 1)[1] for p in packs} == {f"{r}.0.zip" for r in range(4)}, (scheme, packs)


def test_ranged_reads_answer_as_tensorstore_does(s3_server: Any, s3a: Any) -> None:
    """What the pack readers rely on, through s3fs against the server: a range within the object, one
    reaching past its end (the bytes it holds), one starting past it (S3 answers 416: nothing), the last
    bytes, the whole object, an empty range (no request: fsspec reads ``0-0`` as everything), a missing
    object (``missing``); one GET each."""
    from arraycheckpoint.storage import storage_for

    prefix = f"raw-{uuid.uuid4().hex[:8]}"
    s3_server.client.put_object(Bucket=s3_server.bucket, Key=f"{prefix}/a", Body=b"0123456789")
    backend, root = storage_for(f"s3a://{s3_server.bucket}/{prefix}")
    reads = backend.ranged_reads(root)
    s3a.requests.clear()
    got = [
        reads.read("a", byte_range=r).result()
        for r in (slice(2, 5), slice(8, 20), slice(12, 20), slice(-4, None), None, slice(3, 3))
    ]
    assert [(g.state, g.value) for g in got] == [
        ("value", b"234"),
        ("value", b"89"),
        ("value", b""),
        ("value", b"6789"),
        ("value", b"0123456789"),
        ("value", b""),
    ]
    assert reads.read("gone", byte_range=slice(0, 4)).result().state == "missing"
    assert [m for m, *_ in s3a.requests] == ["GET"] * 6, s3a.requests
    assert backend.read_suffix(root, "a", 4) == (b"6789", None)
    assert backend.read_suffix(root, "a", 64) == (b"0123456789", 10)
    assert backend.read_suffix(root, "gone", 4) is None
    # a check reading many local headers at once queues them on a bounded set of threads
    from arraycheckpoint.storage import ranged

    many = [reads.read("a", byte_range=slice(i % 10, i % 10 + 1)) for i in range(80)]
    assert all(s.workers <= ranged._WORKERS for s in list(ranged._stores.values()))
    assert b"".join(f.result().value for f in many) == b"0123456789" * 8
