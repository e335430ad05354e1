"""torch.distributed.checkpoint (DCP) directories as a load source: ``acp.load(dcp_dir, state, allow_pickle=True)``.

A DCP directory holds ``.metadata`` (a pickle of DCP's ``Metadata``: every key's global shape, dtype and
chunks, and where each chunk is stored) and ``*.distcp`` files. ``.metadata`` is only unpickled with
``allow_pickle=True``; without it, loading fails saying so. Non-tensor values (DCP pickles them too:
``step``, ``param_groups``) are read once when the directory is opened: :class:`arraycheckpoint.dcp.Reader`
hands them back to DCP, and :func:`arraycheckpoint.load` restores an optimizer's ``param_groups``.

Tensor chunks are stored either as a ``torch.save`` zip archive each (DCP's default) or as raw bytes (DCP's
safetensors serialization). From a zip only the stored (uncompressed) ``data/0`` entry is read, found
through the zip's central directory; its ``data.pkl`` (the tensor's storage offset, size and stride: DCP
keeps a channels_last or transposed tensor's strides) is read with a restricted unpickler and the storage
re-laid to the tensor's shape (:mod:`.dcpzip`). A compressed entry, a layout that is not dense, or a DCP
storage extension (e.g. compression) is refused naming the tensor. Each rank then reads only the byte
ranges of its regions (:mod:`arraycheckpoint.sources.ranges`).

Names: DCP's flattened keys map to entries through the key paths DCP records (``planner_data``), as
:func:`arraycheckpoint.dcp.entry_name` does: ``model.layers.0.w`` saved from ``{"model": {...}}`` is
``model/layers.0.w``; optimizer state ``optimizer.state.<fqn>.exp_avg`` is ``optimizer/<fqn>/exp_avg``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..checks.files import open_regular
from ..errors import CorruptCheckpointError, MetadataError, PickleNotAllowedError
from ..format.metadata import CheckpointMetadata, ShardMeta, TensorMeta
from ..planning.items import LoadShard, LoadTensor
from ..planning.regions import Box, intersect
from ..runtime.monitoring import PhaseRecorder
from . import LoadSource
from .dcpkeys import DCP_OBJECT, MAX_BYTE_IO, entry_names, json_value, native_objects
from .dcpzip import ChunkItem as _Chunk
from .dcpzip import Layout, data_layout
from .dcpzip import read_range as _read
from .ranges import RangeReader, StoredTensor

DCP_METADATA = ".metadata"
MAX_METADATA_BYTES = 1 << 30


class DcpSource(LoadSource):
    """A DCP checkpoint directory (see the module docstring)."""

    kind = "dcp"

    def __init__(
        self, storage: Any, root: str, meta: CheckpointMetadata, chunks: dict[str, list[_Chunk]]
    ) -> None:
        super().__init__(storage, root)
        self._meta = meta
        self.chunks = chunks

    @classmethod
    def open(cls, storage: Any, root: str, *, allow_pickle: bool = False) -> DcpSource:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"{root} is a torch.distributed.checkpoint directory: its {DCP_METADATA} is a pickle, which "
                "can run code when loaded; if you trust this checkpoint, pass allow_pickle=True: "
                "acp.load(path, state, allow_pickle=True), acp.dcp.Reader(path, allow_pickle=True) or "
                "arraycheckpoint import --allow-pickle"
            )
        import pickle

        from ..codecs import zarr_dtype_name
        from ..storage.reads import read_bounded

        raw = read_bounded(storage, root, DCP_METADATA, MAX_METADATA_BYTES)
        if raw is None or len(raw) > MAX_METADATA_BYTES:
            raise MetadataError(f"{root}/{DCP_METADATA} is missing or larger than {MAX_METADATA_BYTES} bytes")
        if raw.lstrip()[:1] == b"{":
            raise MetadataError(
                f"{root}/{DCP_METADATA} is JSON, not DCP's pickle: it is the resume-discovery file of an "
                "arraycheckpoint checkpoint (arraycheckpoint.dcp.Writer), whose control files are missing; a "
                "complete one loads as an arraycheckpoint checkpoint"
            )
        md = pickle.loads(raw)  # noqa: S301 - the caller passed allow_pickle=True
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        from ..adapters.torch.tensors import numpy_dtype as torch_to_numpy

        paths = md.planner_data if isinstance(md.planner_data, dict) else {}
        where = {(idx.fqn, tuple(idx.offset or ())): info for idx, info in (md.storage_data or {}).items()}
        tensors: dict[str, TensorMeta] = {}
        chunks: dict[str, list[_Chunk]] = {}
        names = entry_names(md.state_dict_metadata, paths)
        for fqn, sm in md.state_dict_metadata.items():
            if not isinstance(sm, TensorStorageMetadata):
                continue
            name = names[fqn]
            shape = tuple(int(s) for s in sm.size)
            dtype = zarr_dtype_name(torch_to_numpy(sm.properties.dtype))
            mine = []
            for c in sm.chunks:
                box = Box(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes))
                info = where.get((fqn, box.offsets))
                if info is None or not box.within(shape):
                    raise MetadataError(
                        f"{root}: tensor {name!r} chunk {box} has no storage record or is out of bounds"
                    )
                if getattr(info, "transform_descriptors", None):
                    raise MetadataError(
                        f"{root}: tensor {name!r} is stored through DCP extensions {info.transform_descriptors} "
                        "(e.g. compression); load it with torch.distributed.checkpoint and save it with acp.save"
                    )
                rel = _file_name(root, f"tensor {name!r}", info)
                mine.append(_Chunk(box, rel, int(info.offset), int(info.length)))
            chunks[name] = mine
            tensors[name] = TensorMeta(
                name,
                shape,
                dtype,
                tuple(max(s, 1) for s in shape),
                tuple(max(s, 1) for s in shape),
                None,
                tuple(ShardMeta(c.box.offsets, c.box.lengths, 0) for c in mine),
            )
        values = _value_records(root, md, where)
        spans = [
            (c.key, c.offset + c.length, f"tensor {name!r}") for name, mine in chunks.items() for c in mine
        ]
        _check_files(
            storage, root, spans + [(v.key, v.offset + v.length, f"value {k!r}") for k, v in values.items()]
        )
        objects = _byte_objects(storage, root, md, names, paths, values)
        meta = CheckpointMetadata(framework="dcp", world_size=1, tensors=tensors, objects=objects)
        return cls(storage, root, meta, chunks)

    @property
    def metadata(self) -> CheckpointMetadata:
        return self._meta

    def read(self, targets: list[LoadTensor], max_inflight_bytes: int, recorder: PhaseRecorder) -> None:
        import tensorstore as ts

        from ..codecs import numpy_dtype
        from ..runtime.tscontext import context

        with recorder.phase("read") as rec:
            kv = ts.KvStore.open(self.storage.kvstore_spec(self.root), context=context()).result()
            reader = RangeReader(self.storage, self.root, max_inflight_bytes)
            located: dict[tuple[str, int], Layout] = {}
            outputs = []
            for t in targets:
                dtype = numpy_dtype(self._meta.tensors[t.name].dtype)
                for shard in t.shards:
                    out = np.empty(shard.box.lengths, dtype)
                    outputs.append((shard, out))
                    for c in self.chunks[t.name]:
                        part = intersect(shard.box, c.box)
                        if part is None or part.volume == 0:
                            continue
                        lay = located.get((c.key, c.offset))
                        if lay is None:
                            lay = located[(c.key, c.offset)] = data_layout(kv, self.root, t.name, c, dtype)
                        stored = StoredTensor(
                            t.name, c.key, lay.begin, lay.stored_shape(c.box.lengths), dtype
                        )
                        at = tuple(p - o for p, o in zip(part.offsets, c.box.offsets))
                        local = Box(lay.stored_shape(at), lay.stored_shape(part.lengths))
                        # a view in storage order, also for 0-d
                        dest = out[(*part.slices(shard.box), ...)].transpose(lay.order)
                        reader.submit(stored, LoadShard(local, lambda a, d=dest: np.copyto(d, a)))
            reader.finish()
            for shard, out in outputs:
                if shard.target is not None and shard.target.dtype == out.dtype:
                    np.copyto(shard.target, out)
                else:
                    shard.sink(out)
            rec["bytes"] = reader.fetched
            rec["wanted_bytes"] = reader.wanted


def _file_name(root: str, what: str, info: Any) -> str:
    """The ``.distcp`` file a DCP storage record names: a plain file name inside ``root`` (no ``/`` or
    ``\\``, no leading ``.``, no control character), or :class:`MetadataError` naming ``what``."""
    rel = str(info.relative_path)
    if not rel or "/" in rel or "\\" in rel or rel.startswith(".") or any(ord(c) < 32 for c in rel):
        raise MetadataError(f"{root}: {what} names an unsafe file {rel!r}")
    return rel


@dataclass(frozen=True)
class _Value:
    key: str  # relative path of the .distcp file
    offset: int
    length: int


def _value_records(root: str, md: Any, where: dict[Any, Any]) -> dict[str, _Value]:
    """Where each of DCP's non-tensor values is stored (DCP key -> file and byte range), checked like the
    tensors' records: a plain file name inside ``root``, a length of at most ``MAX_BYTE_IO``."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    out: dict[str, _Value] = {}
    for fqn, sm in md.state_dict_metadata.items():
        info = where.get((fqn, ())) if isinstance(sm, BytesStorageMetadata) else None
        if info is None:
            continue
        rel, offset, length = _file_name(root, f"value {fqn!r}", info), int(info.offset), int(info.length)
        if not 0 <= length <= MAX_BYTE_IO or offset < 0:
            raise MetadataError(f"{root}/{rel}: value {fqn!r} is stored as {length} bytes at {offset}")
        out[fqn] = _Value(rel, offset, length)
    return out


def _byte_objects(
    storage: Any, root: str, md: Any, names: dict[str, str], paths: dict[str, Any], values: dict[str, _Value]
) -> dict[str, Any]:
    """DCP's non-tensor values (``step``, ``param_groups``, ...: ``torch.save`` bytes each, read once here
    from the files :func:`_check_files` passed, the caller allowed pickles) as
    :class:`~arraycheckpoint.dcp.Reader` and :func:`arraycheckpoint.load` see them in a checkpoint of
    :class:`~arraycheckpoint.dcp.Writer`: the ``~dcp`` object (keys, paths, bytes) and the JSON objects of
    :func:`~arraycheckpoint.dcp.native_objects` (``param_groups``)."""
    import base64
    import io

    import tensorstore as ts
    import torch

    from ..format.metadata import ObjectMeta
    from ..runtime.tscontext import context

    kv = ts.KvStore.open(storage.kvstore_spec(root), context=context()).result() if values else None
    raw: dict[str, str] = {}
    docs: dict[str, Any] = {}
    for fqn, v in values.items():
        where = f"{root}/{v.key}: value {fqn!r}"
        data = _read(kv, v.key, v.offset, v.length, where)
        raw[fqn] = base64.b64encode(data).decode()
        try:
            loaded = torch.load(io.BytesIO(data), weights_only=False)  # noqa: S614 - allow_pickle
        except Exception as e:  # noqa: BLE001 - torch raises many kinds (UnpicklingError, RuntimeError, EOFError)
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise CorruptCheckpointError(
                f"{where}: not a torch.save'd value ({why}); the file is damaged"
            ) from None
        value = json_value(loaded)
        if value is not None:
            docs[fqn] = value
    keys = {k: names[k] for k in md.state_dict_metadata}
    doc_paths = {k: [p if isinstance(p, int) else str(p) for p in v] for k, v in paths.items()}
    doc = {"version": 1, "keys": keys, "paths": doc_paths, "bytes": raw}
    objects = native_objects(names, paths, docs)
    objects[DCP_OBJECT] = ObjectMeta(DCP_OBJECT, "global", value=doc)
    return objects


def _check_files(storage: Any, root: str, spans: list[tuple[str, int, str]]) -> None:
    """On a local file system, every ``.distcp`` file the metadata names (``spans``: file, the end of a
    tensor chunk or value stored in it, what is stored there) is a regular file (no link, never a FIFO:
    :func:`arraycheckpoint.checks.files.open_regular`) holding every item recorded in it: a file cut short is
    refused here, naming a tensor or value stored past its end and the file, before anything is read."""
    from . import local_dir

    local = local_dir(storage, root)
    if local is None:
        return
    ends: dict[str, tuple[int, str]] = {}
    for key, end, what in spans:
        if end > ends.get(key, (-1, ""))[0]:
            ends[key] = (end, what)
    for key, (end, what) in sorted(ends.items()):
        opened = open_regular(local, key, what=f"{what}: ")
        if opened is None:
            raise CorruptCheckpointError(f"{what}: {root}/{key} is missing; the checkpoint is damaged")
        os.close(opened[0])
        if opened[1] < end:
            raise CorruptCheckpointError(
                f"{what}: {root}/{key} is {opened[1]} bytes, but the {what.split()[0]} is stored up to byte "
                f"{end}; the file is truncated"
            )
