"""Where a DCP chunk's bytes are in its ``.distcp`` item, and in which layout.

DCP's default serialization stores each tensor chunk as a ``torch.save`` zip archive: ``data/0`` (stored,
uncompressed) holds the tensor's storage and ``data.pkl`` how the tensor lies in it (storage offset, size,
stride). FileSystemWriter keeps a tensor's memory format (a channels_last convolution weight, a ``.t()``
parameter and its Adam state are saved with their permuted strides), so the storage is C-order only for a
contiguous tensor. ``data.pkl`` is read with a restricted unpickler that knows only the few globals of a
plain tensor's record (it constructs nothing): a dense layout (offset 0, strides a permutation of C-order
strides filling the storage) is read as the C-order storage of the permuted shape and transposed back; any
other record is refused naming the tensor. DCP's raw (safetensors) serialization stores C-order bytes.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError, MetadataError
from ..planning.regions import Box

_EOCD = b"PK\x05\x06"
_EOCD64 = b"PK\x06\x06"
_CENTRAL = b"PK\x01\x02"
_LOCAL = b"PK\x03\x04"
MAX_RECORD_BYTES = 1 << 20  # a tensor's data.pkl is a few hundred bytes
_HEADER_SLACK = 1024  # a local header's name and extra field (torch pads entries to 64 bytes) fit in this


@dataclass(frozen=True)
class ChunkItem:
    """A chunk of a DCP tensor: its box, its ``.distcp`` file and the item's byte range there."""

    box: Box
    key: str  # relative path of the .distcp file
    offset: int  # item start in the file
    length: int  # item bytes


@dataclass(frozen=True)
class Layout:
    """Where a chunk's storage starts in its file, and ``order``: the chunk's axes in storage order (the
    storage is C-order of ``shape[order]``; the identity for a contiguous chunk)."""

    begin: int
    order: tuple[int, ...]

    def stored_shape(self, lengths: tuple[int, ...]) -> tuple[int, ...]:
        """``lengths`` (of the chunk or a box of it) in storage order."""
        return tuple(lengths[i] for i in self.order)


def data_layout(kv: Any, root: str, name: str, c: ChunkItem, dtype: np.dtype[Any]) -> Layout:
    """The :class:`Layout` of chunk ``c`` of tensor ``name``: raw items as they are, zip items through the
    zip and its ``data.pkl`` (a zip whose records run past their bytes is damage, naming the tensor and the
    file; a layout that is not dense is refused naming the tensor)."""
    try:
        return _zip_layout(kv, root, name, c, dtype)
    except (struct.error, StopIteration):
        raise CorruptCheckpointError(
            f"{root}/{c.key}: tensor {name!r} chunk {list(c.box.offsets)}: a damaged zip record (it runs past "
            "its bytes)"
        ) from None


def _zip_layout(kv: Any, root: str, name: str, c: ChunkItem, dtype: np.dtype[Any]) -> Layout:
    nbytes = math.prod(c.box.lengths) * dtype.itemsize
    identity = tuple(range(len(c.box.lengths)))
    if c.length == nbytes:
        return Layout(c.offset, identity)  # DCP's raw (safetensors-style) serialization
    where = f"{root}/{c.key}: tensor {name!r} chunk {list(c.box.offsets)}"
    tail_len = min(c.length, (1 << 16) + 22)
    tail_at = c.length - tail_len
    tail = read_range(kv, c.key, c.offset + tail_at, tail_len, where)

    def item(begin: int, n: int) -> bytes:  # bytes [begin, begin + n) of the item: from the tail when there
        if begin >= tail_at and begin + n <= c.length:
            return tail[begin - tail_at : begin - tail_at + n]
        return read_range(kv, c.key, c.offset + begin, n, where)

    at = tail.rfind(_EOCD)
    if at < 0:
        raise CorruptCheckpointError(f"{where}: neither raw bytes nor a zip archive (no end record)")
    entries, cd_size, cd_offset = struct.unpack_from("<HII", tail, at + 10)
    if cd_offset == 0xFFFFFFFF or entries == 0xFFFF:  # zip64: the locator sits right before the end record
        z64 = tail.rfind(_EOCD64, 0, at)
        if z64 < 0:
            raise CorruptCheckpointError(f"{where}: zip64 archive without its zip64 end record")
        entries, cd_size, cd_offset = struct.unpack_from("<QQQ", tail, z64 + 32)
    if cd_offset + cd_size > c.length or cd_size > (64 << 20):
        raise CorruptCheckpointError(f"{where}: zip central directory outside the item")
    cd = item(cd_offset, cd_size)
    found: dict[str, tuple[int, int]] = {}  # "data" / "record" -> (size, local header offset)
    pos = 0
    for _ in range(entries):
        if cd[pos : pos + 4] != _CENTRAL:
            raise CorruptCheckpointError(f"{where}: damaged zip central directory")
        (method,) = struct.unpack_from("<H", cd, pos + 10)
        csize, usize = struct.unpack_from("<II", cd, pos + 20)
        nlen, xlen, clen = struct.unpack_from("<HHH", cd, pos + 28)
        (local,) = struct.unpack_from("<I", cd, pos + 42)
        fname = cd[pos + 46 : pos + 46 + nlen].decode(errors="replace")
        extra = cd[pos + 46 + nlen : pos + 46 + nlen + xlen]
        pos += 46 + nlen + xlen + clen
        kind = "data" if fname.endswith("/data/0") else "record" if fname.endswith("/data.pkl") else None
        if kind is None:
            continue
        csize, usize, local = _zip64_sizes(extra, csize, usize, local)
        if method != 0:
            raise MetadataError(
                f"{where}: the tensor's zip entry {fname} is compressed (method {method}); not supported"
            )
        if csize != usize:
            raise CorruptCheckpointError(
                f"{where}: zip entry {fname} is stored with two sizes ({csize}, {usize})"
            )
        found[kind] = (usize, local)
    if "data" not in found:
        raise MetadataError(f"{where}: the zip archive has no data/0 entry (not a torch.save'd tensor)")
    if "record" not in found:
        raise MetadataError(f"{where}: the zip archive has no data.pkl (not a torch.save'd tensor)")
    usize, local = found["data"]
    if usize != nbytes:
        raise MetadataError(
            f"{where}: the stored storage holds {usize} bytes, the chunk {nbytes}: not a dense chunk"
        )
    start = local + _entry_start(item(local, 30), where)
    if start + nbytes > c.length:
        raise CorruptCheckpointError(f"{where}: tensor data runs past the item")
    rsize, rlocal = found["record"]
    if rsize > MAX_RECORD_BYTES:
        raise MetadataError(f"{where}: its data.pkl is {rsize} bytes, not a plain tensor's record")
    head = item(rlocal, max(30, min(_HEADER_SLACK + rsize, c.length - rlocal)))  # header and record at once
    rstart = rlocal + _entry_start(head, where)
    if rstart + rsize > c.length:
        raise CorruptCheckpointError(f"{where}: data.pkl runs past the item")
    within = rstart - rlocal + rsize <= len(head)
    record = head[rstart - rlocal : rstart - rlocal + rsize] if within else item(rstart, rsize)
    offset, size, stride = tensor_record(record, where)
    if size != tuple(c.box.lengths):
        raise MetadataError(
            f"{where}: data.pkl records shape {list(size)}, the metadata {list(c.box.lengths)}"
        )
    return Layout(c.offset + start, dense_order(size, stride, offset, where))


def _entry_start(head: bytes, where: str) -> int:
    """Where a zip entry's bytes start, from its local header ``head`` (at least its first 30 bytes), relative
    to the header."""
    if head[:4] != _LOCAL:
        raise CorruptCheckpointError(f"{where}: damaged zip local header")
    hn, hx = struct.unpack_from("<HH", head, 26)
    return int(30 + hn + hx)


class _Rebuild:
    """Stands in for ``torch._utils._rebuild_tensor_v2``: records its arguments, constructs nothing."""

    def __init__(self, storage: Any, offset: Any, size: Any, stride: Any, *rest: Any) -> None:
        self.args = (storage, offset, size, stride)


class _Record(pickle.Unpickler):
    """Unpickles a plain tensor's ``data.pkl`` into a :class:`_Rebuild`; any other global is refused."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _Rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name.endswith("Storage") and name.isidentifier():
            return name
        raise pickle.UnpicklingError(f"global {module}.{name} is not part of a plain tensor's record")

    def persistent_load(self, pid: Any) -> Any:
        if isinstance(pid, tuple) and len(pid) >= 3 and pid[0] == "storage":
            return ("storage", str(pid[2]))
        raise pickle.UnpicklingError(f"persistent id {pid!r} is not a storage")


def tensor_record(raw: bytes, where: str) -> tuple[int, tuple[int, ...], tuple[int, ...]]:
    """``(storage offset, size, stride)`` of a ``torch.save``'d plain tensor's ``data.pkl`` (restricted
    unpickling: only the rebuild call, its storage and an empty ``OrderedDict`` of hooks), or
    :class:`MetadataError` naming ``where``."""
    try:
        rec = _Record(io.BytesIO(raw)).load()
    except Exception as e:  # noqa: BLE001 - damaged or foreign pickles raise many kinds
        raise MetadataError(f"{where}: data.pkl is not a plain tensor's record ({e})") from None
    if not isinstance(rec, _Rebuild):
        raise MetadataError(f"{where}: data.pkl is not a plain tensor's record ({type(rec).__name__})")
    storage, offset, size, stride = rec.args
    ints = (
        isinstance(offset, int)
        and isinstance(size, tuple)
        and isinstance(stride, tuple)
        and len(size) == len(stride)
        and all(isinstance(v, int) and v >= 0 for v in (*size, *stride))
    )
    if not ints or storage != ("storage", "0"):
        raise MetadataError(f"{where}: data.pkl records an unreadable layout {rec.args[1:]!r}")
    return offset, size, stride


def dense_order(size: tuple[int, ...], stride: tuple[int, ...], offset: int, where: str) -> tuple[int, ...]:
    """The axes of a tensor of ``size`` and ``stride`` in storage order (outermost first), when its elements
    fill a storage starting at ``offset`` 0 without gaps: C-order is the identity, channels_last of a 4-d
    tensor ``(0, 2, 3, 1)``, a transposed matrix ``(1, 0)``. Any other layout is :class:`MetadataError`."""
    ndim = len(size)
    if math.prod(size) == 0:
        return tuple(range(ndim))
    unit = [i for i in range(ndim) if size[i] == 1]
    by_stride = sorted((i for i in range(ndim) if size[i] != 1), key=lambda i: -stride[i])
    for order in (tuple(range(ndim)), tuple(unit + by_stride)):
        expect = 1
        for i in reversed(order):
            if size[i] != 1 and stride[i] != expect:
                break
            expect *= size[i]
        else:
            if offset == 0:
                return order
    raise MetadataError(
        f"{where}: stored with storage offset {offset}, size {list(size)}, stride {list(stride)}: not a dense "
        "layout of its own storage; load it with torch.distributed.checkpoint"
    )


def _zip64_sizes(extra: bytes, csize: int, usize: int, local: int) -> tuple[int, int, int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, size = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            vals = iter(struct.unpack_from(f"<{size // 8}Q", extra, pos + 4))
            usize = next(vals) if usize == 0xFFFFFFFF else usize
            csize = next(vals) if csize == 0xFFFFFFFF else csize
            local = next(vals) if local == 0xFFFFFFFF else local
        pos += 4 + size
    return csize, usize, local


def read_range(kv: Any, key: str, begin: int, n: int, where: str) -> bytes:
    """``n`` bytes of ``key`` from ``begin`` through the tensorstore kvstore ``kv``; a short file is
    :class:`CorruptCheckpointError` naming ``where``."""
    try:
        res = kv.read(key, byte_range=slice(begin, begin + n)).result()
    except ValueError as e:  # tensorstore: OUT_OF_RANGE for a range starting past the end of the value
        if "OUT_OF_RANGE" not in str(e):
            raise
        raise CorruptCheckpointError(
            f"{where}: {key} is truncated (bytes [{begin}, {begin + n}) asked)"
        ) from None
    if res.state != "value" or len(res.value) != n:
        raise CorruptCheckpointError(f"{where}: {key} is missing or truncated")
    return bytes(res.value)
