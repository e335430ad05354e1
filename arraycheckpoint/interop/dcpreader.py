"""The DCP ``StorageReader`` of :mod:`arraycheckpoint.dcp`: reads an arraycheckpoint checkpoint (or a load source)
through the engine, only the regions DCP's planner asks for."""

from __future__ import annotations

import base64
import io
import os
from typing import Any

from ..codecs import numpy_dtype
from ..errors import ArrayCheckpointError, CorruptCheckpointError, PickleNotAllowedError
from ..format.metadata import CheckpointMetadata
from ..planning.regions import Box
from ..sources.dcpkeys import DCP_OBJECT, dcp_key
from .dcpvalues import aliases, native_values

try:  # the plug-in needs torch; importing arraycheckpoint does not
    from torch.distributed.checkpoint import StorageReader, StorageWriter
except ImportError:  # pragma: no cover - torch absent
    StorageReader = StorageWriter = object  # type: ignore[assignment,misc]


class Reader(StorageReader):
    """DCP ``StorageReader`` over an arraycheckpoint checkpoint (or a load source) at ``path``.

    ``read_metadata`` describes every stored tensor as one DCP chunk of its global shape, so DCP's planner
    asks for exactly the regions each rank needs; ``read_data`` reads them through the engine (only those
    regions) and copies them into DCP's destination tensors. Non-tensor values (DCP's own bytes in a checkpoint
    of :class:`Writer`, else the checkpoint's JSON objects: ``param_groups``, ``extra_state``) and tied weights'
    other names are served under the keys DCP asks for (:mod:`.dcpvalues`).

    Args:
        path: checkpoint path or URL; a Hugging Face safetensors directory works too.
        allow_pickle: passed to the load source (a DCP directory needs it).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *, allow_pickle: bool = False) -> None:
        super().__init__()
        self.path = os.fspath(path) if path is not None else None
        self.allow_pickle = allow_pickle
        self._opened: Any = None
        self._keys: dict[str, str] = {}
        self._bytes: dict[str, str] = {}
        self._native: dict[str, Any] = {}

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.fspath(checkpoint_id)
        self._opened = None

    def _open(self) -> tuple[Any, str, CheckpointMetadata]:
        if self._opened is None:
            from ..engine import engine

            if self.path is None:
                raise ArrayCheckpointError("acp.dcp.Reader needs a path (Reader(path) or checkpoint_id=...)")
            self._opened = engine().read_metadata(self.path, allow_pickle=self.allow_pickle)
        return self._opened

    def read_metadata(self, *args: Any) -> Any:
        """DCP's ``Metadata`` of the checkpoint. It takes no keyword arguments on purpose: DCP then reads it once
        (every rank the same), with no per-rank retry repeating a failure in its error message."""
        import torch
        from torch.distributed.checkpoint.metadata import (
            BytesStorageMetadata,
            ChunkStorageMetadata,
            Metadata,
            TensorProperties,
            TensorStorageMetadata,
        )

        from ..adapters.torch.tensors import torch_dtype

        _storage, _root, meta = self._open()
        dcp_doc = meta.objects.get(DCP_OBJECT)
        doc = dcp_doc.value if dcp_doc is not None and isinstance(dcp_doc.value, dict) else {}
        by_entry = {v: k for k, v in (doc.get("keys") or {}).items()}
        self._keys = {}
        md: dict[str, Any] = {}
        for entry, tm in meta.tensors.items():
            key = by_entry.get(entry) or dcp_key(entry)
            self._keys[key] = entry
            try:
                dtype = torch_dtype(numpy_dtype(tm.dtype))
            except ArrayCheckpointError as e:  # a JAX checkpoint's float8_e3m4: name the tensor
                raise ArrayCheckpointError(
                    f"{self.path}: tensor {entry!r}: {e}; DCP cannot describe it"
                ) from None
            md[key] = TensorStorageMetadata(
                TensorProperties(dtype=dtype),
                torch.Size(tm.shape),
                [ChunkStorageMetadata(offsets=torch.Size([0] * len(tm.shape)), sizes=torch.Size(tm.shape))],
            )
        for key, entry in aliases(meta).items():  # tied weights: the alias reads the stored tensor
            if key not in md:
                md[key] = md[by_entry.get(entry) or dcp_key(entry)]
                self._keys[key] = entry
        self._bytes = {k: v for k, v in (doc.get("bytes") or {}).items() if isinstance(v, str)}
        for key in self._bytes:
            md[key] = BytesStorageMetadata()
        paths = {k: tuple(v) for k, v in (doc.get("paths") or {}).items()}
        natives, native_paths = native_values(meta, self.allow_pickle)
        self._native = {k: v for k, v in natives.items() if k not in md}
        for key in self._native:
            md[key] = BytesStorageMetadata()
            paths.setdefault(key, native_paths[key])
        return Metadata(state_dict_metadata=md, planner_data=paths or None)

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not self._keys and not self._bytes and not self._native:
            self.read_metadata()

    def prepare_local_plan(self, plan: Any) -> Any:
        return plan

    def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
        return plans

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType
        from torch.futures import Future

        from ..adapters.torch.tensors import load_shard
        from ..engine import engine
        from ..planning.items import LoadTensor

        storage, root, meta = self._open()
        targets: dict[str, LoadTensor] = {}
        done = []
        for item in plan.items:
            key = item.storage_index.fqn
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, self._value(key))
                continue
            entry = self._keys[key]
            box = Box(tuple(item.storage_offsets), tuple(item.lengths))
            dest = planner.resolve_tensor(item).detach()
            if dest.device.type != "cpu" or dest.dtype != _torch_of(meta, entry):
                host = dest.new_empty(dest.shape, device="cpu", dtype=_torch_of(meta, entry))
                done.append((item, dest, host))
                view = host
            else:
                done.append((item, dest, None))
                view = dest
            targets.setdefault(entry, LoadTensor(entry, [])).shards.append(load_shard(box, view))
        engine().load(storage, root, meta, list(targets.values()))
        for item, dest, host in done:
            if host is not None:
                dest.copy_(host)
            planner.commit_tensor(item, dest)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _value(self, key: str) -> io.BytesIO:
        """The stored non-tensor value ``key`` as the bytes DCP's planner unpickles.

        DCP's ``load_bytes`` runs ``torch.load(weights_only=False)``: handing it the stored bytes would run
        any code a hostile checkpoint put there. Unless ``allow_pickle=True``, the value is first read with
        ``torch.load(weights_only=True)`` (plain values, containers and tensors only: what ``step``,
        ``param_groups`` and a scheduler's state are) and the planner gets that value pickled afresh.
        """
        import binascii

        import torch

        if key in self._native:  # a JSON object of the checkpoint, decoded (pickles only with allow_pickle)
            out = io.BytesIO()
            torch.save(self._native[key], out)
            out.seek(0)
            return out
        where = f"non-tensor value {key!r} of {self.path}"
        try:
            raw = base64.b64decode(self._bytes[key], validate=True)
        except (binascii.Error, ValueError):
            raise CorruptCheckpointError(f"{where} is not base64; the checkpoint is damaged") from None
        if self.allow_pickle:
            return io.BytesIO(raw)
        try:
            value = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
        except Exception as e:  # noqa: BLE001 - torch raises UnpicklingError, RuntimeError, EOFError, ...
            lines = [ln for ln in str(e).splitlines() if ln.strip()] or [type(e).__name__]
            why = next((ln for ln in lines if "GLOBAL" in ln), lines[0])
            raise PickleNotAllowedError(
                f"{where} is not a plain value (torch.load(weights_only=True) refused it: {why}); unpickling it "
                "could run code stored in the checkpoint. Pass Reader(path, allow_pickle=True) only for a "
                "checkpoint you trust"
            ) from None
        out = io.BytesIO()
        torch.save(value, out)
        out.seek(0)
        return out

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return isinstance(checkpoint_id, str | os.PathLike)


def _torch_of(meta: CheckpointMetadata, entry: str) -> Any:
    from ..adapters.torch.tensors import torch_dtype

    return torch_dtype(numpy_dtype(meta.tensors[entry].dtype))
