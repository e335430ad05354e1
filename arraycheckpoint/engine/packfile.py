"""Write packs: uncompressed ZIP files of small zarr v3 arrays (the layout is :mod:`arraycheckpoint.planning.packing`).

A pack's members are the exact keys the arrays would have in the checkpoint directory (``<name>/zarr.json``
and the chunk files :mod:`.shardfile` encodes), plus a group ``zarr.json`` for the pack's root and every
directory above a member. The container is :mod:`zipfile`'s (``ZIP_STORED``: a member's bytes are its
file's bytes, so tensorstore's ``zip`` driver and zarr-python's ``ZipStore`` read them with ranged reads and
nothing to inflate); on a local file system :mod:`.packstream` writes zipfile's exact bytes member by member,
as each is encoded, from the header and directory records built here. Fixed timestamps make a pack's bytes a
function of its arrays alone.
"""

from __future__ import annotations

import io
import json
import struct
import zipfile
import zlib
from typing import IO, Any

import numpy as np

from ..planning.packing import group_keys

Buffer = bytes | np.ndarray

#: (member key, the buffers of its bytes in order)
Member = tuple[str, list[Buffer]]

_EPOCH = (1980, 1, 1, 0, 0, 0)
_GROUP_DOC = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()


def members_with_groups(arrays: list[str], members: list[Member]) -> list[Member]:
    """``members`` preceded by the group documents of the pack holding ``arrays``."""
    return [(key, [_GROUP_DOC]) for key in group_keys(arrays)] + members


def write_zip(out: IO[bytes], members: list[Member]) -> None:
    """Write ``members`` as an uncompressed ZIP archive to ``out`` (positioned at its start)."""
    with zipfile.ZipFile(out, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
        for key, parts in members:
            info = zipfile.ZipInfo(key, date_time=_EPOCH)
            info.compress_type = zipfile.ZIP_STORED
            info.external_attr = 0o644 << 16
            nbytes = sum(_nbytes(p) for p in parts)
            with zf.open(info, "w", force_zip64=nbytes >= zipfile.ZIP64_LIMIT) as w:
                for p in parts:
                    w.write(memoryview(_flat(p)) if isinstance(p, np.ndarray) else p)


def zip_bytes(members: list[Member]) -> bytes:
    """The archive of ``members`` in memory (for key-value stores, which take one value per object)."""
    buf = io.BytesIO()
    write_zip(buf, members)
    return buf.getvalue()


def _zip_crc32() -> Any:
    """ZIP's CRC-32 function: zlib-ng's (carry-less multiply: ~90 GB/s on a cached block here, against 5.6 for
    the system zlib's), or :func:`zlib.crc32` where zlib-ng is not installed (same values)."""
    try:
        from zlib_ng.zlib_ng import crc32
    except ImportError:  # pragma: no cover - a dependency; kept working without it
        return zlib.crc32
    return crc32


#: ZIP's CRC-32 (releases the GIL on large buffers, as zlib's does)
_ZIP_CRC32 = _zip_crc32()


def _crc32(buf: bytes | np.ndarray, crc: int) -> int:
    """ZIP's CRC-32 of ``buf`` (bytes or a C-contiguous array) continuing ``crc``."""
    return _ZIP_CRC32(buf, crc)


def _member_info(key: str) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(key, date_time=_EPOCH)
    info.compress_type = zipfile.ZIP_STORED
    info.external_attr = 0o644 << 16
    info.flag_bits = 0
    return info


#: the fields zipfile gives every member of a pack (:func:`_member_info`): only the name, CRC, size and offset differ
_PROTO = _member_info("m")
_DOS_TIME = _EPOCH[3] << 11 | _EPOCH[4] << 5 | (_EPOCH[5] // 2)
_DOS_DATE = (_EPOCH[0] - 1980) << 9 | _EPOCH[1] << 5 | _EPOCH[2]
_LOCAL = struct.Struct(zipfile.structFileHeader)
_CENTRAL = struct.Struct(zipfile.structCentralDir)

#: one member as a pack records it: (key, CRC-32, bytes, offset of its local header)
Record = tuple[str, int, int, int]


def _name_flags(key: str) -> tuple[bytes, int]:
    """The name bytes and flag bits zipfile writes for ``key`` (``ZipInfo._encodeFilenameFlags``)."""
    if key.isascii():
        return key.encode("ascii"), _PROTO.flag_bits
    return key.encode("utf-8"), _PROTO.flag_bits | 0x800


def _plain(key: str, nbytes: int) -> bool:
    """Whether zipfile writes member ``key`` of ``nbytes`` bytes without zip64 records and under its own name
    (no NUL: ``ZipInfo`` would cut the name there), so :func:`local_header` may build its header."""
    return nbytes < zipfile.ZIP64_LIMIT and "\0" not in key


def local_header(record: Record) -> bytes:
    """The local file header zipfile writes for a stored member (``ZipInfo.FileHeader``): built directly for a
    member without zip64 sizes (a ``ZipInfo`` per member cost more than writing the member's bytes, with
    100,000 small tensors), through zipfile otherwise. The same bytes either way (``tests/test_packstream.py``)."""
    key, crc, nbytes, offset = record
    if not _plain(key, nbytes):
        return _record_info(record).FileHeader(nbytes >= zipfile.ZIP64_LIMIT)
    name, flags = _name_flags(key)
    return _plain_local_header(flags, crc, nbytes, len(name)) + name


def _plain_local_header(flags: int, crc: int, nbytes: int, name_len: int) -> bytes:
    """The fixed part of a stored member's local header without zip64 fields (no extra field)."""
    return _LOCAL.pack(
        zipfile.stringFileHeader,
        _PROTO.extract_version,
        _PROTO.reserved,
        flags,
        _PROTO.compress_type,
        _DOS_TIME,
        _DOS_DATE,
        crc,
        nbytes,
        nbytes,
        name_len,
        0,
    )


def header_parts(members: list[tuple[str, int]]) -> list[tuple[bytes, bytes] | None]:
    """Per member ``(key, bytes)`` of a pack: its :func:`local_header` before and after the CRC-32 (the only
    field not known before the member is encoded), or None for a member :func:`local_header` builds through
    zipfile. The sizes and name lengths of all members are packed at once (numpy)."""
    plain = [_plain(key, n) for key, n in members]
    names = [_name_flags(key) for key, _n in members]
    fixed = np.zeros(len(members), dtype=_AFTER_CRC)
    fixed["csize"] = fixed["usize"] = [n if p else 0 for (_key, n), p in zip(members, plain)]
    fixed["name_len"] = [len(name) for name, _flags in names]
    raw = fixed.tobytes()
    step = _AFTER_CRC.itemsize
    heads: dict[int, bytes] = {}  # flag bits -> the header's bytes before the CRC-32
    out: list[tuple[bytes, bytes] | None] = []
    for i, ((name, flags), p) in enumerate(zip(names, plain)):
        if not p:
            out.append(None)
            continue
        head = heads.get(flags)
        if head is None:
            head = heads[flags] = _plain_local_header(flags, 0, 0, 0)[:_CRC_AT]
        out.append((head, raw[i * step : (i + 1) * step] + name))
    return out


#: where a local header's CRC-32 lies, and what follows it before the name (sizes, name and extra lengths)
_CRC_AT = 14
_AFTER_CRC = np.dtype([("csize", "<u4"), ("usize", "<u4"), ("name_len", "<u2"), ("extra_len", "<u2")])


def _record_info(record: Record) -> zipfile.ZipInfo:
    key, crc, nbytes, offset = record
    info = _member_info(key)
    info.file_size = info.compress_size = nbytes
    info.CRC = crc
    info.header_offset = offset
    return info


def central_directory(records: list[Record], start_dir: int) -> bytes:
    """:func:`_central_directory` of the members ``records``: each entry built directly when no member needs
    zip64 records, through ``ZipInfo`` objects otherwise (the same bytes)."""
    limit = zipfile.ZIP64_LIMIT
    if not all(_plain(key, n) and offset <= limit for key, _c, n, offset in records):
        return _central_directory([_record_info(r) for r in records], start_dir)
    # the fixed part of every entry at once (one structured array), each followed by its name
    names = [_name_flags(key) for key, _c, _n, _o in records]
    fixed = np.zeros(len(records), dtype=_CENTRAL_DTYPE)
    fixed["sig"] = int.from_bytes(zipfile.stringCentralDir, "little")
    fixed["create_version"] = _PROTO.create_version
    fixed["create_system"] = _PROTO.create_system
    fixed["extract_version"] = _PROTO.extract_version
    fixed["reserved"] = _PROTO.reserved
    fixed["flags"] = [flags for _name, flags in names]
    fixed["method"] = _PROTO.compress_type
    fixed["time"] = _DOS_TIME
    fixed["date"] = _DOS_DATE
    fixed["crc"] = [crc for _k, crc, _n, _o in records]
    fixed["csize"] = fixed["usize"] = [n for _k, _c, n, _o in records]
    fixed["name_len"] = [len(name) for name, _flags in names]
    fixed["internal_attr"] = _PROTO.internal_attr
    fixed["external_attr"] = _PROTO.external_attr
    fixed["offset"] = [o for _k, _c, _n, o in records]
    raw = fixed.tobytes()
    size = _CENTRAL.size
    out = []
    for i, (name, _flags) in enumerate(names):
        out += (raw[i * size : (i + 1) * size], name)
    return _end_records(b"".join(out), len(records), start_dir)


#: one central directory entry before its name (``zipfile.structCentralDir``), as a numpy record
_CENTRAL_DTYPE = np.dtype(
    [
        ("sig", "<u4"),
        ("create_version", "u1"),
        ("create_system", "u1"),
        ("extract_version", "u1"),
        ("reserved", "u1"),
        ("flags", "<u2"),
        ("method", "<u2"),
        ("time", "<u2"),
        ("date", "<u2"),
        ("crc", "<u4"),
        ("csize", "<u4"),
        ("usize", "<u4"),
        ("name_len", "<u2"),
        ("extra_len", "<u2"),
        ("comment_len", "<u2"),
        ("disk", "<u2"),
        ("internal_attr", "<u2"),
        ("external_attr", "<u4"),
        ("offset", "<u4"),
    ]
)
assert _CENTRAL_DTYPE.itemsize == _CENTRAL.size


def _central_directory(infos: list[zipfile.ZipInfo], start_dir: int) -> bytes:
    """The central directory and end records zipfile's ``ZipFile.close`` writes for ``infos`` (stored
    members, no archive comment) when the directory starts at ``start_dir``."""
    limit = zipfile.ZIP64_LIMIT
    out = []
    for zinfo in infos:
        dt = zinfo.date_time
        dosdate = (dt[0] - 1980) << 9 | dt[1] << 5 | dt[2]
        dostime = dt[3] << 11 | dt[4] << 5 | (dt[5] // 2)
        extra = []
        if zinfo.file_size > limit or zinfo.compress_size > limit:
            extra += [zinfo.file_size, zinfo.compress_size]
            file_size = compress_size = 0xFFFFFFFF
        else:
            file_size, compress_size = zinfo.file_size, zinfo.compress_size
        if zinfo.header_offset > limit:
            extra.append(zinfo.header_offset)
            header_offset = 0xFFFFFFFF
        else:
            header_offset = zinfo.header_offset
        extra_data = zinfo.extra
        min_version = 0
        if extra:
            extra_data = struct.pack("<HH" + "Q" * len(extra), 1, 8 * len(extra), *extra) + extra_data
            min_version = zipfile.ZIP64_VERSION
        extract_version = max(min_version, zinfo.extract_version)
        create_version = max(min_version, zinfo.create_version)
        filename, flag_bits = zinfo._encodeFilenameFlags()
        out.append(
            struct.pack(
                zipfile.structCentralDir,
                zipfile.stringCentralDir,
                create_version,
                zinfo.create_system,
                extract_version,
                zinfo.reserved,
                flag_bits,
                zinfo.compress_type,
                dostime,
                dosdate,
                zinfo.CRC,
                compress_size,
                file_size,
                len(filename),
                len(extra_data),
                len(zinfo.comment),
                0,
                zinfo.internal_attr,
                zinfo.external_attr,
                header_offset,
            )
        )
        out += [filename, extra_data, zinfo.comment]
    return _end_records(b"".join(out), len(infos), start_dir)


def _end_records(entries: bytes, count: int, start_dir: int) -> bytes:
    """The central directory's ``entries`` followed by the end records zipfile writes after them."""
    limit = zipfile.ZIP64_LIMIT
    out = [entries]
    size, offset = len(entries), start_dir
    if count > zipfile.ZIP_FILECOUNT_LIMIT or offset > limit or size > limit:
        end = start_dir + size
        out.append(
            struct.pack(
                zipfile.structEndArchive64,
                zipfile.stringEndArchive64,
                44,
                45,
                45,
                0,
                0,
                count,
                count,
                size,
                offset,
            )
        )
        out.append(
            struct.pack(zipfile.structEndArchive64Locator, zipfile.stringEndArchive64Locator, 0, end, 1)
        )
        count, size, offset = min(count, 0xFFFF), min(size, 0xFFFFFFFF), min(offset, 0xFFFFFFFF)
    out.append(
        struct.pack(zipfile.structEndArchive, zipfile.stringEndArchive, 0, 0, count, count, size, offset, 0)
    )
    return b"".join(out)


def _nbytes(p: Any) -> int:
    return int(p.nbytes) if isinstance(p, np.ndarray) else len(p)


def _flat(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)
