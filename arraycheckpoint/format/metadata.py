"""Checkpoint metadata: frozen dataclasses and their strict JSON (de)serialisation.

The metadata document (``.acp/metadata.json``; ``.metadata.json`` in formats 1 and 2, see
:data:`CONTROL`) maps every stored tensor to its global shape, dtype, chunk grid and the regions that were
saved (:class:`ShardMeta`), plus the JSON objects of the checkpoint. Loading validates every field before any
byte of tensor data is touched: malformed, hostile or absurd metadata raises :class:`MetadataError` and
nothing is executed (there is no pickle here; pickled user objects are opaque strings only decoded on request).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from ..checks.names import check_name as check_name  # the one validator of entry names (saves use it too)
from ..checks.names import check_name_tree
from ..errors import ArrayCheckpointError, MetadataError
from ..planning.packing import PACK_KEY, RANK_PACKS, packs_rank
from ..planning.regions import Box
from .layoutgroups import parse_layout_groups
from .writers import CYCLIC, HELD, ReaderBudget, Writers

#: 8: a tensor with many replicated chunks stores ``"writers": ["cyclic", shift]``: the chunks of each holder
#: set, in row-major order, go round its sorted holders starting ``shift`` places on
#: (:func:`arraycheckpoint.planning.owners.cyclic_writers`), one number instead of one rank per chunk.
#: 7: a tensor whose every chunk is written by the one rank holding the region that holds most of it stores
#: ``"writers": "held"`` instead of a list: readers derive the writers from its regions and chunk grid
#: (:class:`Writers`, :func:`arraycheckpoint.planning.flatgrid.held_writers`), so the metadata grows with
#: ranks and tensors, not with chunks. Only worst-fit (replicated) writers are listed.
#: 6: every chunk file below the target size is in its writer's packs; a packed array's ``pack`` is
#: ``.acp/packs/<creator>`` (the rank whose packs hold its ``zarr.json``), chunk ``i`` lies in the packs of
#: ``writers[i]`` (found by key in their central directories: nothing per chunk in the metadata).
#: 5: small arrays one rank writes whole are stored in packs, uncompressed ZIP files holding complete zarr v3
#: arrays (:mod:`arraycheckpoint.planning.packing`); a tensor's ``pack`` names its file.
#: 4: per-rank objects whose ranks share one structure are stored as one template plus numeric rows
#: (:mod:`arraycheckpoint.format.rankdoc`); 3: control files in the ``.acp/`` node (:data:`CONTROL`) and chunk keys
#: ``c.i.j``; 2: regions stored as layout rules (format 1 listed every rank's region). Versions 1 and 2 keep
#: their control files in the root (:data:`LEGACY_CONTROL`) and chunk keys ``c/i/j``.
FORMAT_VERSION = 8
READABLE_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)


def chunk_key_separator(format_version: int) -> str:
    """The separator of every array's chunk keys in a checkpoint of ``format_version``.

    Format 3 stores ``<array>/c.<i>.<j>`` (zarr's ``default`` encoding with ``"."``): one file per chunk and no
    directory per grid dimension (a 2-d tensor's array was three directories and two files, now one directory
    and two files). Formats 1 and 2 used ``"/"`` (``<array>/c/<i>/<j>``).
    """
    return "." if format_version >= 3 else "/"


@dataclass(frozen=True)
class ControlFiles:
    """Where one on-disk layout keeps a checkpoint's control files (keys relative to the checkpoint root)."""

    metadata: str  # the global metadata (:class:`CheckpointMetadata` as JSON)
    committed: str  # the commit marker: a checkpoint without it does not load
    metrics: str  # complete save metrics (commit phase included), written after the commit
    load_metrics: str  # the most recent opt-in load record
    node: str | None = None  # the zarr.json making the control directory an empty zarr array (format 3)


#: The directory of format 3's control files: an empty zarr v3 array node, so zarr-python never lists inside
#: it (a group listing warns about every key that is not a zarr node). Entry names cannot start with ".".
#: the ``framework`` of a Hugging Face safetensors directory read as a load source (:mod:`arraycheckpoint.sources`)
SAFETENSORS_FRAMEWORK = "safetensors"
CONTROL_DIR = ".acp"
#: Format 3 (what every save writes).
CONTROL = ControlFiles(
    metadata=f"{CONTROL_DIR}/metadata.json",
    committed=f"{CONTROL_DIR}/committed",
    metrics=f"{CONTROL_DIR}/metrics.json",
    load_metrics=f"{CONTROL_DIR}/metrics-load.json",
    node=f"{CONTROL_DIR}/zarr.json",
)
#: Formats 1 and 2: the control files sit in the checkpoint root (still read, and kept by tools rewriting them).
LEGACY_CONTROL = ControlFiles(".metadata.json", ".committed", ".metrics.json", ".metrics-load.json")
#: Every layout a reader looks for, the current one first.
CONTROL_LAYOUTS = (CONTROL, LEGACY_CONTROL)
METADATA_FILE = CONTROL.metadata
COMMIT_MARKER = CONTROL.committed
METRICS_FILE = CONTROL.metrics
LOAD_METRICS_FILE = CONTROL.load_metrics


def marker_owner(key: str) -> str | None:
    """The checkpoint (its path relative to a listing's root, ``""`` for the root itself) whose commit marker
    the listed ``key`` is, in any layout; None when ``key`` is no commit marker."""
    for files in CONTROL_LAYOUTS:
        if key == files.committed:
            return ""
        if key.endswith("/" + files.committed):
            return key[: -len(files.committed) - 1]
    return None


MAX_ELEMENTS = 1 << 50  # refuse absurd shapes before allocating anything
MAX_NDIM = 64


@dataclass(frozen=True)
class ShardMeta:
    """One saved region of a tensor: global offsets/lengths and the rank that held it at save time."""

    offsets: tuple[int, ...]
    lengths: tuple[int, ...]
    rank: int

    @property
    def box(self) -> Box:
        return Box(self.offsets, self.lengths)


@dataclass(frozen=True)
class TensorMeta:
    """A stored tensor: one Zarr v3 array at ``<ckpt>/<name>`` with its global shape."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # zarr v3 data_type name
    chunk_shape: tuple[int, ...]  # one stored file per chunk (sharding_indexed outer chunk)
    inner_chunk_shape: tuple[int, ...]
    compression: str | None
    shards: Sequence[ShardMeta]  # a tuple (format 1) or regions expanded on first use from rules (format 2)
    # writer rank per stored chunk, row-major over the chunk grid: listed, or derived (format 7, Writers)
    writers: Sequence[int] = ()
    regions: tuple[tuple[int, Any], ...] = ()  # format 2: (layout group, rule) pairs the shards follow from
    # a stacked per-rank array: the leading dimension is the saving rank (extent world_size); see perrank.py
    rank_rows: bool = False
    # format 5: the pack file (key relative to the root) holding the whole array; format 6: the packs of the
    # array's creator (``.acp/packs/<rank>``, holding its zarr.json; chunk i is in the packs of writers[i]);
    # None: ``<ckpt>/<name>/``
    pack: str | None = None

    @cached_property
    def pack_rank(self) -> int | None:
        """Format 6: the rank whose packs hold this packed array's ``zarr.json`` (None: not in that form);
        computed once per tensor (a load asks for it several times per tensor)."""
        return packs_rank(self.pack)

    @property
    def nbytes(self) -> int:
        from ..codecs import numpy_dtype

        return math.prod(self.shape) * numpy_dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ObjectMeta:
    """A JSON object entry. ``scope="global"`` holds one value; ``scope="rank"`` one value per saving rank:
    either ``per_rank`` (rank -> value) or, in template form (format 4, :mod:`arraycheckpoint.format.rankdoc`), one
    ``template`` for every rank of the world whose numeric leaves are rows of the arrays ``rows`` names."""

    name: str
    scope: str  # "global" | "rank"
    value: Any = None
    per_rank: Mapping[int, Any] = field(default_factory=dict)
    template: Any = None
    rows: Mapping[str, str] | None = None  # kind -> stacked array; None: not in template form


@dataclass(frozen=True)
class CheckpointMetadata:
    """Everything ``.metadata.json`` holds."""

    framework: str
    world_size: int
    tensors: Mapping[str, TensorMeta]
    objects: Mapping[str, ObjectMeta]
    step: int | None = None
    topology: Mapping[str, Any] = field(default_factory=dict)
    roles: tuple[str, ...] = ()
    metrics: Mapping[str, Any] = field(default_factory=dict)
    library_version: str = ""
    format_version: int = FORMAT_VERSION
    codec_preset: int = 0  # arraycheckpoint.codecs.CODEC_PRESET the arrays were written with (0: unknown)
    layout_groups: tuple[Any, ...] = ()  # format 2: [{"meshes": [...], "ranks": <ranges>}], see rules.py

    def to_json(self) -> str:
        """Serialise to the canonical JSON text of ``.metadata.json`` (:func:`.metatext.metadata_text`)."""
        from .metatext import metadata_text

        return metadata_text(self)

    @staticmethod
    def from_json(text: str | bytes, what: str = METADATA_FILE) -> CheckpointMetadata:
        """Parse and validate the metadata document; raises :class:`MetadataError` on anything malformed
        (naming ``what``: the file it was read from)."""
        from ..checks.bounds import MAX_METADATA_BYTES, load_json_bounded

        doc = load_json_bounded(text, max_bytes=MAX_METADATA_BYTES, what=what)
        return _parse(doc)


def _req(doc: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(doc, Mapping) or key not in doc:
        raise MetadataError(f"metadata: {where} lacks required field {key!r}")
    value = doc[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _as_tuple(kind)):
        raise MetadataError(f"metadata: {where}.{key} has type {type(value).__name__}, expected {kind}")
    return value


def _as_tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _ints(value: Any, minimum: int, limit: int) -> tuple[int, ...] | None:
    """:func:`_int_list` of a valid value (the common case, without building its error text), else None."""
    if type(value) is list and len(value) <= limit:
        for v in value:
            if type(v) is not int or v < minimum or v > MAX_ELEMENTS:
                return None
        return tuple(value)
    return None


def _int_list(value: Any, where: str, minimum: int = 0, limit: int = MAX_NDIM) -> tuple[int, ...]:
    """A list of at most ``limit`` integers (dimensions by default; chunk counts for writer lists)."""
    if type(value) is list and len(value) <= limit:  # the common case, checked without a call per item
        for v in value:
            if type(v) is not int or v < minimum or v > MAX_ELEMENTS:
                break
        else:
            return tuple(value)
    if not isinstance(value, list) or len(value) > limit:
        raise MetadataError(f"metadata: {where} must be a list of at most {limit} integers")
    out = []
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool) or v < minimum or v > MAX_ELEMENTS:
            raise MetadataError(f"metadata: {where} holds {v!r}; expected integers in [{minimum}, 2**50]")
        out.append(v)
    return tuple(out)


def _parse(doc: Any) -> CheckpointMetadata:

    if not isinstance(doc, dict):
        raise MetadataError("metadata: top level must be a JSON object")
    version = _req(doc, "format_version", int, "metadata")
    if version not in READABLE_VERSIONS:
        raise MetadataError(
            f"checkpoint format_version {version} is not supported by this arraycheckpoint "
            f"(which reads versions {list(READABLE_VERSIONS)}); upgrade arraycheckpoint"
        )
    world_size = _req(doc, "world_size", int, "metadata")
    from ..planning.rules import MAX_MESH_RANKS

    if not 1 <= world_size <= MAX_MESH_RANKS:  # a larger world could not describe its meshes
        raise MetadataError(f"metadata: world_size {world_size} must be between 1 and {MAX_MESH_RANKS}")
    groups = parse_layout_groups(doc.get("layout_groups", []), world_size) if version >= 2 else ()
    tensors: dict[str, TensorMeta] = {}
    memo = _TensorMemo()
    for name, t in _req(doc, "tensors", dict, "metadata").items():
        tensors[name] = _parse_tensor(name, t, version, world_size, groups, memo)
    check_name_tree(tensors)  # an array inside an array never loads (a save refuses it too)
    objects = {
        name: _parse_object(name, o, version, tensors, world_size)
        for name, o in _req(doc, "objects", dict, "metadata").items()
    }
    step = doc.get("step")
    if step is not None and (not isinstance(step, int) or isinstance(step, bool)):
        raise MetadataError("metadata: step must be an integer or null")
    roles = doc.get("roles", [])
    if not isinstance(roles, list) or not all(isinstance(r, str) for r in roles):
        raise MetadataError("metadata: roles must be a list of strings")
    return CheckpointMetadata(
        framework=_req(doc, "framework", str, "metadata"),
        world_size=world_size,
        tensors=tensors,
        objects=objects,
        step=step,
        topology=doc.get("topology") if isinstance(doc.get("topology"), dict) else {},
        roles=tuple(roles),
        metrics=doc.get("metrics") if isinstance(doc.get("metrics"), dict) else {},
        library_version=str(doc.get("library_version", "")),
        format_version=version,
        codec_preset=doc.get("codec_preset") if isinstance(doc.get("codec_preset"), int) else 0,
        layout_groups=tuple(doc.get("layout_groups", [])) if version >= 2 else (),
    )


class _TensorMemo:
    """What :func:`_parse_tensor` checked once per distinct value, not once per tensor: layouts (shape, dtype,
    chunks, compression: their chunk count), regions per shape and pack entries. Keys are validated tuples of
    exact ints and strings, or the ``repr`` of raw JSON (which tells ``1`` from ``True`` and ``1.0``)."""

    def __init__(self) -> None:
        self.layouts: dict[tuple[Any, ...], int] = {}
        self.regions: dict[tuple[tuple[int, ...], str], tuple[tuple[int, Any], ...]] = {}
        self.packs: set[tuple[Any, ...]] = set()
        self.writers: dict[tuple[Any, ...], Writers] = {}
        self.cycles: dict[tuple[Any, ...], Any] = {}  # per layout: its cyclic writers' tables (format 8)
        self.pack_ranks: dict[str | None, int | None] = {}  # pack entry -> TensorMeta.pack_rank
        self.budget = ReaderBudget()  # what deriving the distinct writers above costs, bounded


def _parse_tensor(
    name: str, t: Any, version: int, world_size: int, groups: tuple[Any, ...], memo: _TensorMemo
) -> TensorMeta:
    """One entry of ``tensors``, validated field by field (what was checked for an equal value is not checked
    again: ``memo``)."""
    check_name(name)
    where = f"tensors[{name!r}]"
    get = t.get if type(t) is dict else None
    shape = _ints(get("shape") if get else None, 0, MAX_NDIM)
    if shape is None:
        shape = _int_list(_req(t, "shape", list, where), f"{where}.shape")
    dtype = get("dtype") if get else None
    if type(dtype) is not str:
        dtype = _req(t, "dtype", str, where)
    chunk = _ints(get("chunk_shape") if get else None, 1, MAX_NDIM)
    if chunk is None:
        chunk = _int_list(_req(t, "chunk_shape", list, where), f"{where}.chunk_shape", minimum=1)
    inner = _ints(get("inner_chunk_shape") if get else None, 1, MAX_NDIM)
    if inner is None:
        inner = _int_list(_req(t, "inner_chunk_shape", list, where), f"{where}.inner_chunk_shape", minimum=1)
    compression = t.get("compression")
    layout = (shape, dtype, chunk, inner, repr(compression))  # repr: None is not 'None'
    nchunks = memo.layouts.get(layout)
    if nchunks is None:
        from ..codecs import SUPPORTED_DTYPES

        if math.prod(shape) > MAX_ELEMENTS:
            raise MetadataError(f"metadata: {where} has an absurd shape {shape}")
        if dtype not in SUPPORTED_DTYPES:
            raise MetadataError(f"metadata: {where} has unsupported dtype {dtype!r}")
        if len(chunk) != len(shape) or len(inner) != len(shape) or any(c % i for c, i in zip(chunk, inner)):
            raise MetadataError(
                f"metadata: {where} has an inconsistent chunk grid {chunk} / {inner} for {shape}"
            )
        if compression not in (None, "zstd"):
            raise MetadataError(f"metadata: {where} has unknown compression {compression!r}")
        nchunks = memo.layouts[layout] = math.prod(-(-n // c) for n, c in zip(shape, chunk)) if shape else 1
    if version == 1:
        shards = _parse_shards(t, where, shape, world_size)
        regions: tuple[tuple[int, Any], ...] = ()
    else:
        raw = _req(t, "regions", list, where)
        key = (shape, repr(raw))
        cached = memo.regions.get(key)
        regions = cached if cached is not None else _parse_regions(raw, where, shape, groups)
        if cached is None:
            memo.regions[key] = regions
        shards = LazyShards(name, shape, regions, groups, memo.budget)
    raw = t.get("writers", [])
    writers: Sequence[int]
    shift = _cyclic_shift(raw, where, world_size) if version >= 8 and type(raw) is list else None
    if (raw == HELD and version >= 7) or shift is not None:
        # parsed regions are kept (memo.regions): one object per value
        wkey = (shape, chunk, id(regions), shift)
        writers = memo.writers.get(wkey)
        if writers is None:
            memo.budget.charge(where, nchunks, shape, regions, groups)
            writers = memo.writers[wkey] = Writers.derive(
                name, shape, chunk, regions, groups, nchunks, shift, memo.cycles
            )
    else:
        listed = _ints(raw, 0, nchunks)
        writers = listed if listed is not None else _int_list(raw, f"{where}.writers", limit=nchunks)
        if writers and (len(writers) != nchunks or max(writers) >= world_size):
            raise MetadataError(
                f"metadata: {where}.writers lists {len(writers)} writers for {nchunks} chunks, or a rank "
                f"outside the world of {world_size}"
            )
    rank_rows = t.get("rank_rows", False)
    if rank_rows is not False and (rank_rows is not True or not shape or shape[0] != world_size):
        raise MetadataError(
            f"metadata: {where}.rank_rows must be true or absent, and a stacked per-rank array's leading "
            f"dimension must be the world size {world_size} (shape {list(shape)})"
        )
    pack = t.get("pack")
    if pack is not None:
        key = (pack if isinstance(pack, str) else repr(pack), layout, len(writers))
        if key not in memo.packs:
            _parse_pack(pack, where, version, world_size, compression, shape, chunk, writers)
            memo.packs.add(key)
    meta = TensorMeta(
        name, shape, dtype, chunk, inner, compression, shards, writers, regions, rank_rows, pack
    )
    # pack_rank, asked several times per tensor by a load: set now, once per distinct pack entry (a cached
    # property computed on first use costs a lock and a regular expression per tensor)
    rank = memo.pack_ranks.get(pack, _UNSET) if type(pack) is str or pack is None else _UNSET
    if rank is _UNSET:
        rank = packs_rank(pack)
        if type(pack) is str or pack is None:
            memo.pack_ranks[pack] = rank
    meta.__dict__["pack_rank"] = rank
    return meta


_UNSET = object()


def _cyclic_shift(raw: list, where: str, world_size: int) -> int | None:
    """The shift of a format-8 ``["cyclic", shift]`` writers entry (an int in ``[0, world_size)``), None for
    a list of ranks; :class:`MetadataError` naming the tensor for any other list starting with the tag."""
    if not raw or raw[0] != CYCLIC:
        return None
    shift = raw[1] if len(raw) == 2 else None
    if type(shift) is not int or not 0 <= shift < max(1, world_size):
        raise MetadataError(
            f"metadata: {where}.writers must be ['cyclic', shift] with an integer shift in [0, {world_size}), "
            f"not {str(raw)[:80]}"
        )
    return shift


def _parse_pack(
    pack: Any,
    where: str,
    version: int,
    world_size: int,
    compression: str | None,
    shape: tuple[int, ...],
    chunk: tuple[int, ...],
    writers: Sequence[int] = (),
) -> str | None:
    """A tensor's ``pack`` entry: absent; (format 5) a pack key of a rank of the world holding an
    uncompressed array of whole chunks; (format 6) the packs ``.acp/packs/<rank>`` of a rank of the world
    holding an uncompressed array whose every chunk has its writer listed. Anything else is no valid
    checkpoint."""
    if pack is None:
        return None
    if version >= 6:
        m = RANK_PACKS.match(pack) if isinstance(pack, str) else None
        nchunks = math.prod(-(-n // c) for n, c in zip(shape, chunk)) if shape else 1
        if m is None or int(m.group(1)) >= world_size:
            raise MetadataError(
                f"metadata: {where}.pack {pack!r} names no rank's packs of this checkpoint (format {version} "
                f"of {world_size} ranks names '.acp/packs/<rank>')"
            )
        if compression is not None or len(writers) != nchunks:
            raise MetadataError(
                f"metadata: {where} is packed but compressed, or does not list the writer of every chunk"
            )
        return pack
    m = PACK_KEY.match(pack) if isinstance(pack, str) and version >= 5 else None
    if m is None or int(m.group(1)) >= world_size:
        raise MetadataError(
            f"metadata: {where}.pack {pack!r} is not a pack of this checkpoint (format {version} of "
            f"{world_size} ranks names packs '.acp/packs/<rank>.<index>.zip' from format 5 on)"
        )
    if compression is not None or any(s % c for s, c in zip(shape, chunk)):
        raise MetadataError(f"metadata: {where} is packed but compressed or not in whole chunks")
    return pack


def _parse_object(
    name: str, o: Any, version: int, tensors: Mapping[str, TensorMeta], world_size: int
) -> ObjectMeta:
    """One object entry: global, per-rank (``per_rank``: at most one value per rank of the world) or, from
    format 4, a template whose rows are stacked arrays (checked by :func:`arraycheckpoint.format.rankdoc.check`)."""
    from . import rankdoc

    check_name(name)
    where = f"objects[{name!r}]"
    scope = _req(o, "scope", str, where)
    if scope == "global":
        return ObjectMeta(name, "global", value=o.get("value"))
    if scope != "rank":
        raise MetadataError(f"metadata: {where} has unknown scope {scope!r}")
    if version >= 4 and "template" in o:
        problem = rankdoc.check(o["template"], _req(o, "rows", dict, where), tensors, world_size)
        if problem is not None:
            raise MetadataError(f"metadata: {where}: {problem}")
        return ObjectMeta(name, "rank", template=o["template"], rows=dict(o["rows"]))
    per_rank = _req(o, "per_rank", dict, where)
    try:
        parsed = {int(r): v for r, v in per_rank.items()}
    except ValueError:
        raise MetadataError(f"metadata: {where}.per_rank keys must be ranks") from None
    if any(not 0 <= r < world_size for r in parsed):
        raise MetadataError(f"metadata: {where}.per_rank names a rank outside the world of {world_size}")
    return ObjectMeta(name, "rank", per_rank=parsed)


def _parse_shards(t: Any, where: str, shape: tuple[int, ...], world_size: int) -> tuple[ShardMeta, ...]:
    """Format 1: one [offsets, lengths, rank] record per saved region."""
    shards = []
    for s in _req(t, "shards", list, where):
        if not isinstance(s, list) or len(s) != 3:
            raise MetadataError(f"metadata: {where}.shards entries must be [offsets, lengths, rank]")
        box = Box(_int_list(s[0], f"{where}.offsets"), _int_list(s[1], f"{where}.lengths"))
        if not box.within(shape) or not isinstance(s[2], int) or not 0 <= s[2] < world_size:
            raise MetadataError(f"metadata: {where} has a shard {s} outside shape {shape} or world")
        shards.append(ShardMeta(box.offsets, box.lengths, s[2]))
    return tuple(shards)


def _parse_regions(raw: list, where: str, shape: tuple[int, ...], groups: tuple[Any, ...]) -> tuple:
    from ..planning.rules import check_rule

    out = []
    for entry in raw:
        if not isinstance(entry, list) or len(entry) != 2 or not isinstance(entry[0], int):
            raise MetadataError(f"metadata: {where}.regions entries must be [group, rule]")
        g, rule = entry
        if not 0 <= g < len(groups):
            raise MetadataError(f"metadata: {where}.regions names layout group {g} of {len(groups)}")
        try:
            check_rule(shape, rule, groups[g][0].meshes)
        except ArrayCheckpointError as e:
            raise MetadataError(f"metadata: {where}: {e}") from None
        if rule[0] == "boxes":
            for o, n in rule[1]:
                box = Box(_int_list(o, f"{where}.regions"), _int_list(n, f"{where}.regions"))
                if not box.within(shape):
                    raise MetadataError(f"metadata: {where} has a region {box} outside shape {shape}")
        out.append((g, rule))
    return tuple(out)


class LazyShards(Sequence):
    """The saved regions of a format-2 tensor, expanded from its rules only when asked for (tools)."""

    def __init__(
        self,
        name: str,
        shape: tuple[int, ...],
        regions: tuple,
        groups: tuple,
        budget: ReaderBudget | None = None,
    ) -> None:
        self._args = (name, shape, regions, groups)
        self._budget = budget  # shared by a parsed checkpoint's tensors: expansions cached and bounded

    @cached_property
    def _items(self) -> tuple[ShardMeta, ...]:
        held = (self._budget or ReaderBudget()).regions(*self._args)
        return tuple(ShardMeta(b.offsets, b.lengths, min(r)) for b, r in held)

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i):  # type: ignore[override]
        return self._items[i]

    def __iter__(self) -> Iterator[ShardMeta]:
        return iter(self._items)
