"""The save side of packs and array documents: ``zarr.json`` bytes from per-layout templates, and a rank's
packs (:mod:`arraycheckpoint.planning.packing`) filled with its encoded chunk files in the order the metadata
implies. Encodes in memory; the writes are the pipeline's (:mod:`.save`)."""

from __future__ import annotations

import json
from json.encoder import encode_basestring_ascii as _json_string
from typing import Any

import numpy as np

from ..codecs import numpy_dtype
from ..codecs.presets import array_metadata, dimension_names_for
from ..errors import SaveFailedError
from ..planning.packing import DOC_BYTES, chunk_file_bytes, fill_packs, packs_rank
from ..planning.plan import ArrayLayout, RankPlan
from . import shardfile
from .common import open_packs_allowed, wait_write
from .job import SaveJob


def create_arrays(job: SaveJob, writer: Any, layouts: list[ArrayLayout]) -> list[tuple[str, Any]]:
    """Start writing the ``zarr.json`` of every array in ``layouts``; returns ``(name, future)`` pairs.

    One key-value write per array instead of one validating ``ts.open(create=True)`` each (which reads, checks
    and writes the metadata one array at a time): with thousands of small tensors that open dominated the save.
    The staging directory is fresh, so there is no existing metadata to conflict with.
    """
    docs = ZarrJsonDocs()
    return [
        (layout.name, writer.write(f"{layout.name}/zarr.json", [docs.encode(layout)])) for layout in layouts
    ]


class ZarrJsonDocs:
    """Encodes ``zarr.json`` documents; arrays that differ only in the path before their last component
    (``dimension_names`` come from that component: the ``exp_avg`` of every parameter) share one template."""

    def __init__(self) -> None:
        self._templates: dict[tuple[Any, ...], tuple[bytes, ...]] = {}

    def encode(self, layout: ArrayLayout) -> bytes:
        """The ``zarr.json`` bytes of ``layout``'s array."""
        # every field but the name (a dataclasses.replace per array cost more than the join below)
        key = (layout.shape, layout.dtype, layout.chunk_shape, layout.inner_chunk_shape, layout.compression)
        parts = self._templates.get(key)
        if parts is None:
            parts = self._templates[key] = zarr_json_template(layout)
        names = dimension_names_for(layout.name, len(layout.shape))
        # json.dumps of a string, without its per-call dispatch
        return parts[0] + b"".join(_json_string(n).encode() + p for n, p in zip(names, parts[1:]))


class Packs:
    """This rank's packs (:mod:`arraycheckpoint.planning.packing`): the ``zarr.json`` of the packed arrays it creates
    and the chunk files of packed arrays it writes, filled in plan order into packs of about the target file
    size (:func:`~arraycheckpoint.planning.packing.fill_packs`). Every member's size is known from the plan, so
    each pack is laid out up front and opened through ``writer.open_pack`` at its first member; each member
    goes to it as soon as it is encoded (on a local file system it is written then, at its offset:
    :mod:`.packstream`)."""

    def __init__(self, job: SaveJob, plan: RankPlan, layouts: dict[str, ArrayLayout], writer: Any) -> None:
        docs = ZarrJsonDocs()
        self._layouts = layouts
        self._writer = writer
        self.packed = {name for _k, names in plan.packs for name in names}
        self._writes = [w for w in plan.writes if w.name in self.packed]
        created = sorted(name for k, names in plan.packs if packs_rank(k) == plan.rank for name in names)
        self._docs = {f"{n}/zarr.json": [docs.encode(layouts[n])] for n in created}
        # the order packing.PackFill computes from the metadata: by array name, its document (if this rank
        # created it) before its chunks (in row-major order)
        members = [(n, -1, f"{n}/zarr.json", DOC_BYTES) for n in created]
        real = {key: len(parts[0]) for key, parts in self._docs.items()}  # bytes as written
        sizes_of: dict[tuple[Any, ...], int] = {}  # chunk file bytes per (chunk, inner chunk, dtype)
        self._keys: dict[int, str] = {}  # id of a write -> its member key
        first_keys: dict[int, str] = {}  # ndim -> the key of chunk 0 (the one chunk of every small array)
        for w in self._writes:
            layout = layouts[w.name]
            offsets = w.chunk.offsets
            if any(offsets):
                flat = 0  # row-major index of the chunk in its grid
                for o, c, n in zip(offsets, layout.chunk_shape, layout.shape):
                    flat = flat * -(-n // c) + o // c
                suffix = shardfile.chunk_key(layout, w.chunk)
            else:
                flat = 0
                suffix = first_keys.get(len(offsets)) or first_keys.setdefault(
                    len(offsets), shardfile.chunk_key(layout, w.chunk)
                )
            grid = (layout.chunk_shape, layout.inner_chunk_shape, layout.dtype)
            size = sizes_of.get(grid)
            if size is None:
                size = sizes_of[grid] = chunk_file_bytes(layout, numpy_dtype(layout.dtype).itemsize)
            key = self._keys[id(w)] = f"{w.name}/{suffix}"
            members.append((w.name, flat, key, size))
            real[key] = size
        members.sort()
        # an array's document stays with its first chunk here: counted with it (packing.PackFill)
        for i, (name, flat, key, _size) in enumerate(members):
            if flat < 0 and i + 1 < len(members) and members[i + 1][0] == name:
                members[i] = (name, flat, key, 0)
                n, f, k, sz = members[i + 1]
                members[i + 1] = (n, f, k, sz + DOC_BYTES)
        sizes = [(key, size) for _n, _f, key, size in members]
        #: pack key -> its members' (key, bytes) in pack order; member key -> (pack key, index)
        self._layout: dict[str, list[tuple[str, int]]] = {}
        self._where: dict[str, tuple[str, int]] = {}
        for key, keys in fill_packs(sizes, plan.rank, job.options.plan.min_chunk_bytes):
            self._layout[key] = [(m, real[m]) for m in keys]
            self._where.update((m, (key, i)) for i, m in enumerate(keys))
        self._open: dict[str, Any] = {}
        self._last: dict[str, Any] = {}  # the last write future handed out per pack
        #: packs opened and not yet seen finished, oldest first (at most open_packs_allowed() of them when the
        #: plan's order allows: see :meth:`_room`)
        self._unfinished: list[str] = []
        self._max_open = open_packs_allowed()
        #: bytes handed to storage so far (every member's, also those of a batch whose future went out before)
        self.written = 0

    def _key(self, w: Any) -> str:
        return self._keys.get(id(w)) or f"{w.name}/{shardfile.chunk_key(self._layouts[w.name], w.chunk)}"

    def start(self) -> list[tuple[Any, int, str]]:
        """Add the ``zarr.json`` documents of arrays none of whose chunks this rank writes; the writes started
        (``(future, bytes, label)``). The others go with the array's first chunk (:meth:`add`): its neighbour in
        the pack, so the two are written by one ``pwritev`` with the rest of their batch."""
        chunked = {w.name for w in self._writes}
        alone = [key for key in self._docs if key[: -len("/zarr.json")] not in chunked]
        return [started for key in alone for started in self._put(key, self._docs.pop(key))]

    def add(self, w: Any, data: np.ndarray) -> list[tuple[Any, int, str]]:
        """Encode chunk ``w`` of a packed array from ``data`` (an edge chunk padded to the full chunk shape
        with the fill value, as zarr does) and add it to its pack; the writes started (``(future, bytes,
        label)``: none while a pack written whole still waits for members)."""
        layout = self._layouts[w.name]
        doc = self._docs.pop(f"{w.name}/zarr.json", None)
        started = self._put(f"{w.name}/zarr.json", doc) if doc is not None else []
        little = data if data.dtype.byteorder != ">" else data.astype(data.dtype.newbyteorder("<"))
        full = shardfile.padded(little, layout.chunk_shape)
        parts = shardfile.encode(full, layout.inner_chunk_shape, deferred=self._writer.summing)
        return started + self._put(self._key(w), parts)

    def _put(self, member: str, parts: list[Any]) -> list[tuple[Any, int, str]]:
        key, index = self._where[member]
        pack = self._open.get(key)
        if pack is None:
            self._room()
            pack = self._open[key] = self._writer.open_pack(key, self._layout[key])
            self._unfinished.append(key)
        started = pack.add(index, parts)
        if started is not None:
            self.written += started[1]
        if started is None or started[0] is self._last.get(key):
            # a small member joined the batch of the one before it, whose future was handed out: counted
            # with it (the bytes in flight are undercounted by at most one batch per pack)
            return []
        self._last[key] = started[0]
        return [(started[0], started[1], f"{member.rpartition('/')[0]} (pack {key})")]

    def _room(self) -> None:
        """Before a pack is opened: while ``open_packs_allowed()`` packs are open (or their files still wait
        for the write-back thread to close them), wait for the oldest whose every member was handed over
        (its last write closes it), so that a save of thousands of small packs (a small
        ``min_chunk_bytes``, everything within the bytes in flight) holds a bounded number of descriptors. A
        pack still waiting for members (a plan whose order interleaves packs) is not waited for: the save
        then holds more."""
        closing = getattr(self._writer, "closing", 0)
        if len(self._unfinished) + closing < int(self._max_open):
            return
        self._unfinished = [k for k in self._unfinished if not _finished(self._open[k])]
        for key in list(self._unfinished):
            if len(self._unfinished) + closing < int(self._max_open):
                break
            pack, last = self._open[key], self._last.get(key)
            if not pack.complete or last is None:
                continue
            wait_write(last, f"pack {key}")  # a complete pack's last batch is on its way (StreamedPack.add)
            self._unfinished.remove(key)
        if len(self._unfinished) + getattr(self._writer, "closing", 0) >= int(self._max_open):
            getattr(self._writer, "settle", lambda: None)()  # the write-back thread's closes

    def check_done(self) -> None:
        """Every pack got all its members (a plan whose writes miss a member would leave one incomplete)."""
        left = sorted(k for k in self._layout if k not in self._open or not self._open[k].complete)
        if left:
            raise SaveFailedError(f"packs {left} were left incomplete by the save plan")


#: Stands for one dimension name in a ``zarr.json`` template; never part of an encoded layout otherwise.
_PLACEHOLDER = "\0acp-dim\0"
_DIM = json.dumps(_PLACEHOLDER)


def _finished(pack: Any) -> bool:
    """Whether ``pack``'s file is closed (a pack written as it fills: its last member written, or removed)."""
    return getattr(pack, "closed", True)


def zarr_json_template(layout: ArrayLayout) -> tuple[bytes, ...]:
    """``json.dumps`` of ``layout``'s array metadata split around its ``ndim`` dimension names.

    Arrays that differ only in their name (thousands of small tensors of one shape) share everything but
    their ``dimension_names``, so their documents are the template's pieces joined by the JSON-encoded names:
    the same bytes as encoding each document whole (the load's exact-bytes check relies on that), at a string
    join's cost instead of one metadata build and encode per array.
    """
    ndim = len(layout.shape)
    meta = array_metadata(
        layout.shape,
        numpy_dtype(layout.dtype),
        layout.chunk_shape,
        layout.inner_chunk_shape,
        layout.compression,
        dimension_names=[_PLACEHOLDER] * ndim,
    )
    pieces = json.dumps(meta).split(_DIM)
    assert len(pieces) == ndim + 1, "a dimension-name placeholder appeared outside dimension_names"
    return tuple(p.encode() for p in pieces)
