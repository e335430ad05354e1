"""ZIP directories of packs: the central directory parsed, bounded, and cross-checked with the local headers.

A pack (format 5 on) is an uncompressed ZIP file of complete zarr v3 chunk files. Its central directory is
parsed here with every size bounded (ZIP64 fields included), members must be stored uncompressed and lie
before the directory, and each local header must agree with the central directory (tensorstore's ``zip``
driver decodes by the local header), so nothing is ever inflated and no member overlaps another.
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np

from ..errors import (
    CorruptCheckpointError,
)


def _check_member(e: Any, name: str, where: str, limit: int) -> None:
    """A pack member ``e`` of tensor ``name`` is stored uncompressed and at most ``limit`` bytes."""
    if e.compress_type != 0:
        raise CorruptCheckpointError(
            f"tensor {name!r}: member {e.filename!r} of {where} is compressed (method "
            f"{e.compress_type}); packs store members uncompressed, nothing is inflated"
        )
    if e.compress_size != e.file_size:
        raise CorruptCheckpointError(
            f"tensor {name!r}: member {e.filename!r} of {where} is stored in {e.compress_size} bytes for "
            f"{e.file_size}; packs store members uncompressed, nothing is inflated"
        )
    if e.file_size > limit:
        raise CorruptCheckpointError(
            f"tensor {name!r}: member {e.filename!r} of {where} is {e.file_size} bytes, more "
            f"than its encoding can be ({limit}); the checkpoint is damaged"
        )


class PackMember(NamedTuple):
    """One entry of a pack's ZIP central directory (the attribute names of :class:`zipfile.ZipInfo`; a
    tuple: a pack of thousands of members makes thousands of them per load)."""

    filename: str
    compress_type: int
    compress_size: int
    file_size: int
    header_offset: int
    flag_bits: int
    raw_name: bytes


#: A directory entry's bytes besides its name: the 46-byte record and at most a zip64 extra field (28 bytes);
#: a save writes no entry comment.
_CD_ENTRY_BYTES = 46 + 32
_EOCD = struct.Struct("<4s4H2LH")  # end of central directory record (22 bytes)
_ZIP64_LOCATOR = struct.Struct("<4sLQL")  # zip64 end of central directory locator (20 bytes)
_ZIP64_EOCD = struct.Struct("<4sQ2H2L4Q")  # zip64 end of central directory record, no extensible data (56)
_CENTRAL = struct.Struct("<4s6H3L5H2L")  # central directory file header (46 bytes)
_LOCAL = struct.Struct("<4s5H3L2H")  # local file header (30 bytes)
_U32 = 0xFFFFFFFF
_EOCD_SIG, _LOCATOR_SIG, _ZIP64_EOCD_SIG = b"PK\x05\x06", b"PK\x06\x07", b"PK\x06\x06"
_CENTRAL_SIG, _LOCAL_SIG = b"PK\x01\x02", b"PK\x03\x04"
#: General-purpose flag bits a member may have: only bit 11 (UTF-8 name). Refused: encryption (bits 0, 6,
#: 13) and a data descriptor (bit 3: the sizes follow the data, and a reader would take them from there).
_ALLOWED_FLAGS = 0x0800
#: Info-ZIP Unicode Path extra field: a second name for a member, which tensorstore checks and uses and
#: Python's zipfile (before 3.12) ignores; refused in every pack, so that every reader sees one name.
UNICODE_PATH_TAG = 0x7075


def _parse_zip_directory(
    path: str,
    tail: bytes,
    size: int | None,
    bound: int,
    read_many: Callable[[list[tuple[int, int]]], list[bytes]],
    max_directory_bytes: int | None,
) -> tuple[list[PackMember], int, int]:
    """The central directory of the ZIP archive whose last bytes are ``tail``: ``(entries, archive size,
    directory offset)``.

    Only the layout :mod:`zipfile` writes for a save is accepted, strictly enough that every reader finds the
    same directory: the end record is the archive's last 22 bytes (no comment, and the last end signature in
    the file, which is the record tensorstore looks for), a zip64 locator and record (if any) sit right before
    it, the directory ends where they start (nothing prepended: Python's :mod:`zipfile` would shift every
    offset by what was, tensorstore would not), the record's entry count is the number of entries the
    directory holds and they fill it exactly, every name is ASCII (or flagged UTF-8) without NUL (Python cuts
    a name at NUL, tensorstore does not), and no member's header and data overlap the next one's. Sizes and
    offsets in zip64 extra fields are read as tensorstore reads them.
    """

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{path} is not a ZIP archive as a save writes it: {why}; the checkpoint is damaged or hostile"
        )

    if len(tail) < _EOCD.size:
        raise bad(f"{len(tail)} bytes are too few for an end-of-central-directory record")
    at = len(tail) - _EOCD.size
    sig, disk, cd_disk, n_disk, n, cd_size, cd_offset, comment = _EOCD.unpack_from(tail, at)
    if sig != _EOCD_SIG or tail.rfind(_EOCD_SIG) != at:
        raise bad("no end-of-central-directory record as its last 22 bytes")
    if comment or disk or cd_disk or n_disk != n:
        raise bad("a comment, several disks or inconsistent entry counts in its end record")
    trailer = _EOCD.size
    loc_at = at - _ZIP64_LOCATOR.size
    if loc_at >= 0 and tail[loc_at : loc_at + 4] == _LOCATOR_SIG:
        _sig, z_disk, z_offset, disks = _ZIP64_LOCATOR.unpack_from(tail, loc_at)
        rec_at = loc_at - _ZIP64_EOCD.size
        if rec_at < 0 or z_disk or disks > 1:
            raise bad("a zip64 locator without its record, or several disks")
        sig, rec_size, _made, _need, disk, cd_disk, n_disk, n, cd_size, cd_offset = _ZIP64_EOCD.unpack_from(
            tail, rec_at
        )
        if sig != _ZIP64_EOCD_SIG or rec_size != _ZIP64_EOCD.size - 12 or disk or cd_disk or n_disk != n:
            raise bad("a zip64 end record that is not the plain one right before its locator")
        trailer += _ZIP64_LOCATOR.size + _ZIP64_EOCD.size
        if z_offset != cd_offset + cd_size:
            raise bad("its zip64 locator and record are not right after its central directory")
    elif n == 0xFFFF or cd_size == _U32 or cd_offset == _U32:
        raise bad("zip64 values in its end record but no zip64 record")
    archive = cd_offset + cd_size + trailer
    if size is None:
        if archive > bound:
            raise CorruptCheckpointError(
                f"{path} declares {archive} bytes, more than its arrays can be stored in ({bound} bytes at "
                "most); the checkpoint is damaged or hostile"
            )
        if archive < len(tail):
            raise bad("its directory does not end where its end records begin")
        size = archive
    elif archive != size:
        raise bad("its directory does not end where its end records begin (data before or after the archive)")
    if max_directory_bytes is not None and cd_size > max_directory_bytes:
        raise bad(f"a directory of {cd_size} bytes, more than its arrays' take ({max_directory_bytes})")
    if cd_size < n * _CENTRAL.size:
        raise bad(f"{n} entries cannot fit in a central directory of {cd_size} bytes")
    start = size - len(tail)
    if cd_offset >= start:
        directory = tail[cd_offset - start : cd_offset - start + cd_size]
    else:
        (directory,) = read_many([(cd_offset, cd_size)])
    if len(directory) != cd_size:
        raise bad("its central directory is cut short")
    plain = _plain_entries(directory, n, cd_offset) if n >= VECTOR_ENTRIES else None
    if plain is not None:
        return plain, size, cd_offset
    entries: list[PackMember] = []
    pos = 0
    for _ in range(n):
        if pos + _CENTRAL.size > cd_size:
            raise bad("its central directory is cut short")
        (
            sig,
            _made,
            _need,
            flags,
            method,
            _time,
            _date,
            _crc,
            csize,
            usize,
            name_len,
            extra_len,
            comment_len,
            disk,
            _internal,
            _external,
            offset,
        ) = _CENTRAL.unpack_from(directory, pos)
        pos += _CENTRAL.size
        end = pos + name_len + extra_len + comment_len
        if sig != _CENTRAL_SIG or end > cd_size:
            raise bad("a damaged central directory entry")
        raw = bytes(directory[pos : pos + name_len])
        usize, csize, offset = _zip64_fields(
            bytes(directory[pos + name_len : pos + name_len + extra_len]), usize, csize, offset, bad
        )
        pos = end
        if flags & ~_ALLOWED_FLAGS or disk:
            raise bad(f"member {raw!r} is encrypted, has a data descriptor or another disk ({flags:#x})")
        entries.append(PackMember(_member_name(raw, flags, bad), method, csize, usize, offset, flags, raw))
    if pos != cd_size:
        raise bad(f"its central directory holds {cd_size - pos} bytes after its {n} entries")
    ordered = sorted(entries, key=lambda e: e.header_offset)
    for e, after in zip(ordered, ordered[1:] + [None]):
        limit = after.header_offset if after is not None else cd_offset
        if e.header_offset + _LOCAL.size + len(e.raw_name) + e.compress_size > limit:
            raise bad(f"member {e.filename!r} overlaps the next one or the central directory")
    return entries, size, cd_offset


#: entries from which a directory is first checked all at once (:func:`_plain_entries`); fewer are parsed one
#: by one straight away (the numpy check costs about 40 us whatever the count, the exact parse about 2 us an
#: entry: a pack of a few large chunks, the FSDP2 case, pays 3x less)
VECTOR_ENTRIES = 24

#: a central directory entry's fixed part (:data:`_CENTRAL`) as a numpy record, to check thousands at once
_CENTRAL_RECORD = np.dtype(
    {
        "names": [
            "sig",
            "flags",
            "method",
            "csize",
            "usize",
            "name_len",
            "extra_len",
            "comment_len",
            "disk",
            "offset",
        ],
        "formats": ["<u4", "<u2", "<u2", "<u4", "<u4", "<u2", "<u2", "<u2", "<u2", "<u4"],
        "offsets": [0, 8, 10, 20, 24, 28, 30, 32, 34, 42],
        "itemsize": _CENTRAL.size,
    }
)


def _plain_entries(directory: bytes, n: int, cd_offset: int) -> list[PackMember] | None:
    """The ``n`` entries of a central directory of ``len(directory)`` bytes as a save writes it, checked
    together (numpy) rather than one by one, or None when anything is not plain: an entry signature out of
    its place, an extra field (zip64), a 0xFFFFFFFF size or offset, a flag besides UTF-8, another disk, a
    non-ASCII name not flagged UTF-8, a NUL, members that overlap. The exact parse of
    :func:`_parse_zip_directory` then says what is wrong (or reads the zip64 fields): this is only its fast
    path, and accepts nothing it refuses."""
    size = len(directory)
    if n == 0 or size < n * _CENTRAL.size:
        return None
    directory = bytes(directory)
    buf = np.frombuffer(directory, np.uint8)
    # every entry starts with its signature: n of them in the directory, chained by the entries' lengths
    found = (buf[:-3] == 0x50) & (buf[1:-2] == 0x4B) & (buf[2:-1] == 0x01) & (buf[3:] == 0x02)
    starts = np.flatnonzero(found)
    if len(starts) != n or starts[0] != 0 or starts[-1] + _CENTRAL.size > size:
        return None
    rec = buf[starts[:, None] + np.arange(_CENTRAL.size)].view(_CENTRAL_RECORD)[:, 0]
    name_len = rec["name_len"].astype(np.int64)
    ends = starts + _CENTRAL.size + name_len + rec["comment_len"]
    if (
        (ends[:-1] != starts[1:]).any()
        or ends[-1] != size
        or rec["extra_len"].any()
        or (rec["flags"] & (0xFFFF & ~_ALLOWED_FLAGS)).any()
        or rec["disk"].any()
        or (rec["csize"] == _U32).any()
        or (rec["usize"] == _U32).any()
        or (rec["offset"] == _U32).any()
    ):
        return None
    # members in offset order: each one's header and data end before the next one (or the directory)
    offsets = rec["offset"].astype(np.int64)
    order = np.argsort(offsets, kind="stable")
    reach = (offsets + _LOCAL.size + name_len + rec["csize"])[order]
    if (reach > np.append(offsets[order][1:], cd_offset)).any():
        return None
    first = (starts + _CENTRAL.size).tolist()
    raws = [directory[a : a + k] for a, k in zip(first, name_len.tolist())]
    flags = rec["flags"].tolist()
    if b"\0" in b"".join(raws):
        return None
    try:
        if any(flags):  # some names flagged UTF-8
            names = [r.decode("utf-8" if f else "ascii") for r, f in zip(raws, flags)]
        else:
            names = [r.decode("ascii") for r in raws]
    except UnicodeDecodeError:
        return None
    columns = (rec["method"].tolist(), rec["csize"].tolist(), rec["usize"].tolist(), offsets.tolist())
    return list(map(PackMember._make, zip(names, *columns, flags, raws)))


def _member_name(raw: bytes, flags: int, bad: Callable[[str], Exception]) -> str:
    """A member's name from its stored bytes: UTF-8 when flagged so, else ASCII; never with a NUL."""
    if b"\0" in raw:
        raise bad(f"the member name {raw!r} holds a NUL byte")
    try:
        return raw.decode("utf-8" if flags & 0x0800 else "ascii")
    except UnicodeDecodeError:
        raise bad(f"the member name {raw!r} is neither ASCII nor flagged UTF-8") from None


def _zip64_fields(
    extra: bytes, usize: int, csize: int, offset: int | None, bad: Callable[[str], Exception]
) -> tuple[int, int, int | None]:
    """Sizes (and header offset) of an entry after its extra field, read as tensorstore reads them: a zip64
    field (at most one) supplies, in this order, each 32-bit value that is 0xFFFFFFFF. The extra fields must
    tile the extra data exactly, and every 0xFFFFFFFF value must be supplied."""
    pos, seen = 0, False
    values = [usize, csize] + ([] if offset is None else [offset])
    while pos < len(extra):
        if pos + 4 > len(extra):
            raise bad("a damaged extra field")
        tag, length = struct.unpack_from("<HH", extra, pos)
        pos += 4
        if pos + length > len(extra):
            raise bad("a damaged extra field")
        if tag == UNICODE_PATH_TAG:
            raise bad(
                "a Unicode Path extra field (0x7075), which some readers (tensorstore) take as the member's "
                "name and others (Python's zipfile) ignore; a save writes none"
            )
        if tag == 1:
            if seen:
                raise bad("two zip64 extra fields in one header")
            seen = True
            body, used = extra[pos : pos + length], 0
            for i, v in enumerate(values):
                if v == _U32:
                    if used + 8 > len(body):
                        raise bad("a zip64 extra field without the value its header defers to it")
                    (values[i],) = struct.unpack_from("<Q", body, used)
                    used += 8
        pos += length
    if not seen and _U32 in values:
        raise bad("a size or offset deferred to a zip64 extra field that is not there")
    return values[0], values[1], (values[2] if offset is not None else None)


def _check_local_headers(
    path: str,
    members: list[PackMember],
    entries: list[PackMember],
    cd_offset: int,
    read_many: Callable[[list[tuple[int, int]]], list[bytes]],
) -> None:
    """Every local header of ``members`` says what the central directory says.

    tensorstore's ``zip`` driver finds a member through the central directory but decodes it as its *local*
    header says (method, sizes): a member stored in the directory but deflated in its local header would be
    inflated. Each header must be there, stored, with the directory's sizes and name, no data descriptor, no
    encryption, and its data must end before the next member's header (tensorstore reads only up to there).
    """

    if not members:
        return
    following = next_offsets(entries, cd_offset)
    ranges = []
    for e in members:
        room = following[e.header_offset] - e.header_offset - _LOCAL.size - len(e.raw_name) - e.compress_size
        ranges.append((e.header_offset, _LOCAL.size + len(e.raw_name) + min(room, 64)))
    heads = read_many(ranges)
    for e, head in zip(members, heads):
        check_local_header(path, e, head, following[e.header_offset], read_many)


def next_offsets(entries: list[PackMember], cd_offset: int) -> dict[int, int]:
    """``header offset -> where the next member's header (or the central directory) starts`` of a pack's
    ``entries`` (what :func:`check_local_header` bounds a member's data by)."""
    offsets = sorted({e.header_offset for e in entries} | {cd_offset})
    return {o: offsets[i + 1] for i, o in enumerate(offsets[:-1])}


def check_local_header(
    path: str,
    e: PackMember,
    head: bytes,
    following: int,
    read_many: Callable[[list[tuple[int, int]]], list[bytes]],
) -> int:
    """The local header ``head`` (its first bytes at least: signature to name) of the member ``e`` of the
    pack ``path`` says what the central directory says (see :func:`_check_local_headers`; ``following``: where
    the next member's header or the directory starts); ``read_many`` fetches the header whole when its extra
    field lies beyond ``head``. Returns the header's length (where the member's data starts)."""
    if len(head) >= _LOCAL.size:  # the header a save writes (no extra field), accepted in one test
        sig, _need, flags, method, _time, _date, _crc, csize, usize, name_len, extra_len = _LOCAL.unpack_from(
            head
        )
        end = _LOCAL.size + name_len
        if (
            sig == _LOCAL_SIG
            and not flags & ~_ALLOWED_FLAGS
            and method == 0
            and not extra_len
            and end <= len(head)
            and csize == usize == e.file_size != _U32
            and bytes(head[_LOCAL.size : end]) == e.raw_name
            and e.header_offset + end + e.file_size <= following
        ):
            return end
    return _check_local_header(path, e, head, following, read_many)


def _check_local_header(
    path: str,
    e: PackMember,
    head: bytes,
    following: int,
    read_many: Callable[[list[tuple[int, int]]], list[bytes]],
) -> int:
    """:func:`check_local_header`, each condition in turn: raises saying which one fails."""
    what = f"the local header of member {e.filename!r}"
    array = e.filename.rpartition("/")[0]  # the members checked are an array's zarr.json and chunks

    def bad(why: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"tensor {array!r}: {path}: {why}; the pack is damaged or hostile (nothing was inflated)"
        )

    if len(head) < _LOCAL.size:
        raise bad(f"{what} is cut short")
    sig, _need, flags, method, _time, _date, _crc, csize, usize, name_len, extra_len = _LOCAL.unpack_from(
        head
    )
    if sig != _LOCAL_SIG:
        raise bad(f"{what} is missing (no local header signature at offset {e.header_offset})")
    if flags & ~_ALLOWED_FLAGS:
        raise bad(f"{what} declares encryption or a data descriptor (flags {flags:#x})")
    if method != 0:
        raise bad(f"{what} declares compression method {method} where the central directory says stored (0)")
    end = _LOCAL.size + name_len + extra_len
    if end > len(head):
        room = following - e.header_offset - e.compress_size
        if end > room:
            raise bad(f"{what} runs into the next member")
        (head,) = read_many([(e.header_offset, end)])
        if len(head) < end:
            raise bad(f"{what} is cut short")
    if bytes(head[_LOCAL.size : _LOCAL.size + name_len]) != e.raw_name:
        raise bad(f"{what} names another member")
    if extra_len or _U32 in (csize, usize):
        extra = bytes(head[_LOCAL.size + name_len : end])
        usize, csize, _ = _zip64_fields(extra, usize, csize, None, lambda w: bad(f"{what}: {w}"))
    if csize != e.file_size or usize != e.file_size:
        raise bad(
            f"{what} declares {csize} stored and {usize} decoded bytes, the central directory {e.file_size}"
        )
    if e.header_offset + end + e.file_size > following:
        raise bad(f"the data of member {e.filename!r} runs into the next member")
    return end
