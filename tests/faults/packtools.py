"""Damage and forge the packs of a checkpoint (format 5, :mod:`arraycheckpoint.planning.packing`) as a bad disk or a
hostile author would: plain :mod:`zipfile` and byte edits, none of arraycheckpoint's own code.

Importable from every test directory as ``faults.packtools`` (``tests/`` is on ``sys.path``).
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import struct
import threading
import zipfile
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

#: ``acp.save(..., **DIRECTORY)`` keeps every array in its own directory (no packs).
LAYOUTS = ("packed", "directory")


def save_options(layout: str) -> dict:
    """Keyword arguments of ``acp.save`` for ``layout`` ("packed": the default; "directory": no packs)."""
    from arraycheckpoint.planning.plan import PlanOptions

    assert layout in LAYOUTS, layout
    return {} if layout == "packed" else {"plan_options": PlanOptions(pack_array_bytes=0)}


def pack_key(ck: str | os.PathLike[str], name: str) -> str | None:
    """The pack key (relative to the root) of the pack holding the stored array ``name``'s ``zarr.json``,
    from the plain-JSON metadata: format 5 names it; format 6 names the rank (``.acp/packs/<rank>``) whose
    packs ``<rank>.<k>.zip`` hold it, found here with :mod:`zipfile`."""
    with open(Path(ck) / ".acp" / "metadata.json") as f:
        key = json.load(f)["tensors"][name].get("pack")
    if key is None or key.endswith(".zip"):
        return key
    key = key.partition("@")[0]  # format 6: ".acp/packs/<rank>@<fill target>"
    k = 0
    while (Path(ck) / f"{key}.{k}.zip").is_file():
        with zipfile.ZipFile(Path(ck) / f"{key}.{k}.zip") as zf:
            if f"{name}/zarr.json" in zf.namelist():
                return f"{key}.{k}.zip"
        k += 1
    return None


def pack_of(ck: str | os.PathLike[str], name: str) -> Path:
    """The pack file holding ``name`` (asserting that it is packed)."""
    key = pack_key(ck, name)
    assert key is not None, f"{name} is not packed"
    return Path(ck) / key


def chunk_member(name: str, index: Iterable[int] = (0, 0)) -> str:
    return f"{name}/c" + "".join(f".{i}" for i in index)


def member_span(pack: str | os.PathLike[str], member: str) -> tuple[int, int]:
    """``(offset of the member's data in the pack file, its size)``: the local header's offset from the
    central directory plus the local header's own length (30 bytes, the name, the extra field)."""
    with zipfile.ZipFile(pack) as zf:
        info = zf.getinfo(member)
    with open(pack, "rb") as f:
        f.seek(info.header_offset)
        head = f.read(30)
    name_len, extra_len = struct.unpack("<HH", head[26:30])
    return info.header_offset + 30 + name_len + extra_len, info.file_size


def flip_member_byte(pack: str | os.PathLike[str], member: str, at: int, mask: int = 0x10) -> None:
    """Flip bits of one byte of ``member``'s data in place (``at`` < 0 counts from the member's end)."""
    start, size = member_span(pack, member)
    pos = start + (at if at >= 0 else size + at)
    raw = bytearray(Path(pack).read_bytes())
    raw[pos] ^= mask
    Path(pack).write_bytes(bytes(raw))


def members(pack: str | os.PathLike[str]) -> list[tuple[str, bytes]]:
    """Every member (name, bytes) in stored order."""
    with zipfile.ZipFile(pack) as zf:
        return [(i.filename, zf.read(i)) for i in zf.infolist()]


def write_members(
    pack: str | os.PathLike[str],
    items: Iterable[tuple[str, bytes]],
    compression: Callable[[str], int] = lambda _name: zipfile.ZIP_STORED,
) -> None:
    """Rewrite ``pack`` holding ``items`` (duplicates allowed), each member compressed as ``compression``
    says (stored by default, as a save writes them)."""
    import warnings

    tmp = Path(str(pack) + ".tmp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # zipfile warns about duplicate names, which some cases want
        with zipfile.ZipFile(tmp, "w") as zf:
            for name, data in items:
                info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
                info.compress_type = compression(name)
                zf.writestr(info, data)
    os.replace(tmp, pack)


def rewrite_pack(
    pack: str | os.PathLike[str], edit: Callable[[list[tuple[str, bytes]]], Iterable[tuple[str, bytes]]]
) -> None:
    """Rewrite ``pack`` with ``edit(members)`` as its members (a consistent ZIP file: what a tool that
    rewrites the archive, or an attacker with zipfile, produces)."""
    write_members(pack, list(edit(members(pack))))


def delete_member(pack: str | os.PathLike[str], member: str) -> None:
    before = members(pack)
    assert any(n == member for n, _ in before), member
    write_members(pack, [(n, d) for n, d in before if n != member])


def replace_member(pack: str | os.PathLike[str], member: str, data: bytes) -> None:
    write_members(pack, [(n, data if n == member else d) for n, d in members(pack)])


def deflate_raw(data: bytes) -> bytes:
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    return c.compress(data) + c.flush()


def set_local_header(
    pack: str | os.PathLike[str],
    member: str,
    *,
    method: int | None = None,
    sizes: tuple[int, int] | None = None,
    flags: int | None = None,
    data: bytes | None = None,
) -> None:
    """Edit ``member``'s *local* header in place (the central directory keeps what it says): its compression
    ``method``, its ``(compressed, uncompressed)`` sizes, its general-purpose ``flags``, and optionally the
    first bytes of its data (which must fit in the member's stored size)."""
    with zipfile.ZipFile(pack) as zf:
        info = zf.getinfo(member)
    raw = bytearray(Path(pack).read_bytes())
    off = info.header_offset
    assert raw[off : off + 4] == b"PK\x03\x04"
    if flags is not None:
        struct.pack_into("<H", raw, off + 6, flags)
    if method is not None:
        struct.pack_into("<H", raw, off + 8, method)
    if sizes is not None:
        struct.pack_into("<II", raw, off + 18, *sizes)
    if data is not None:
        start, size = member_span(pack, member)
        assert len(data) <= size, (len(data), size)
        raw[start : start + len(data)] = data
    Path(pack).write_bytes(bytes(raw))


def eocd_offset(raw: bytes) -> int:
    at = raw.rfind(b"PK\x05\x06")
    assert at >= 0
    return at


def set_eocd(raw: bytes, **fields: int) -> bytes:
    """``raw`` with fields of its end-of-central-directory record replaced (``entries``, ``cd_size``,
    ``cd_offset``, ``comment_length``)."""
    at = eocd_offset(raw)
    rec = list(struct.unpack("<4s4H2LH", raw[at : at + 22]))
    index = {"entries_disk": 3, "entries": 4, "cd_size": 5, "cd_offset": 6, "comment_length": 7}
    for k, v in fields.items():
        rec[index[k]] = v
        if k == "entries":
            rec[3] = v
    return raw[:at] + struct.pack("<4s4H2LH", *rec) + raw[at + 22 :]


@contextlib.contextmanager
def rescuing_fifo(path: str | os.PathLike[str], after: float = 20.0) -> Iterator[threading.Event]:
    """Within the block, a reader blocked opening the FIFO ``path`` is released after ``after`` seconds by
    a helper thread that opens it for writing; the event yielded is set if that was needed. A test asserts
    it is not set: a regression (a FIFO opened without ``O_NONBLOCK``) then fails instead of hanging."""
    rescued, done = threading.Event(), threading.Event()

    def rescue() -> None:
        while not done.wait(after):
            try:
                if not stat.S_ISFIFO(os.lstat(path).st_mode):
                    continue
                fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO unless a reader waits on it
            except OSError:
                continue
            rescued.set()
            os.close(fd)

    helper = threading.Thread(target=rescue, daemon=True)
    helper.start()
    try:
        yield rescued
    finally:
        done.set()
        helper.join()
