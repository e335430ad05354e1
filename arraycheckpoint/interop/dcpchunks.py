"""How :class:`~arraycheckpoint.interop.dcpwriter.Writer`'s ranks write their DCP items: each item's chunk
files, encoded from the tensor's memory by the engine's shard-file writer, or through tensorstore."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from ..codecs import array_metadata, numpy_dtype
from ..planning.regions import Box, chunks_overlapping
from ..runtime.tscontext import context


class ChunkWriter:
    """Writes a rank's DCP items as the chunk files of their arrays.

    DCP waits in ``write_data`` until the writes are done, so a CPU tensor's own memory is written from
    without a copy. Whole chunks of the default preset are encoded by :mod:`.engine.shardfile` (hardware
    CRC32C, ``writev`` from the tensor, device write-back started per file); edge chunks cut by the array's
    end and anything else go through a tensorstore array opened with the metadata assumed.
    """

    def __init__(
        self, storage: Any, staging: str, arrays: dict[str, Any], writer: Any, writes: list[tuple[str, Any]]
    ) -> None:
        self._storage = storage
        self._staging = staging
        self._arrays = arrays
        self._writer = writer
        self._writes = writes
        self._stores: dict[str, Any] = {}

    def _store(self, fqn: str) -> Any:
        import tensorstore as ts

        if fqn not in self._stores:
            entry, shape, dtype, chunk, inner = self._arrays[fqn]
            self._stores[fqn] = ts.open(
                {
                    "driver": "zarr3",
                    "kvstore": self._storage.kvstore_spec(f"{self._staging.rstrip('/')}/{entry}"),
                    "metadata": array_metadata(shape, numpy_dtype(dtype), chunk, inner, name=entry),
                    "store_data_equal_to_fill_value": True,
                },
                assume_metadata=True,  # the coordinator writes zarr.json once, in finish()
                context=context(),
            ).result()
        return self._stores[fqn]

    def write(self, fqn: str, box: Box, data: Any) -> int:
        """Start writing item ``box`` of ``fqn`` from the tensor ``data``; returns its bytes."""
        from ..adapters.torch.tensors import TorchSource
        from ..engine import shardfile

        entry, shape, dtype, chunk, inner = self._arrays[fqn]
        np_dtype = numpy_dtype(dtype)
        source = TorchSource(data.detach())
        host = source.borrowed_view()
        if host is None or tuple(host.shape) != box.lengths or host.dtype != np_dtype:
            host = np.empty(box.lengths, np_dtype)
            fence = source.copy_into(host)
            if fence is not None:
                fence.wait()
        layout = ChunkLayout(tuple(chunk), None)
        for c in chunks_overlapping(box, shape, chunk) if box.volume else ():
            part = host[c.slices(box)]
            if shardfile.can_encode(layout, c, np_dtype):
                key = f"{entry}/{shardfile.chunk_key(layout, c)}"
                parts = shardfile.encode(part, tuple(inner), self._writer.summing)
                self._writes.append((fqn, self._writer.write(key, parts)))
            else:
                self._writes.append((fqn, self._store(fqn)[c.slices()].write(part)))
        return int(host.nbytes)


@dataclasses.dataclass(frozen=True)
class ChunkLayout:
    """What :mod:`.engine.shardfile` reads of an array's layout."""

    chunk_shape: tuple[int, ...]
    compression: str | None
