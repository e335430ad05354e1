"""``arraycheckpoint import``: bring safetensors, ``torch.save`` and torch DCP checkpoints into our format.

Sources, detected from the path:

* a ``.safetensors`` file, or a directory holding ``model.safetensors.index.json`` (Hugging Face sharded) or
  ``*.safetensors`` files: tensors are read lazily, one at a time, while the engine takes its snapshot;
* a torch.distributed.checkpoint (DCP) directory (it holds ``.metadata``), its keys named as ``acp.load`` reads
  them (a ``{"model": ..., "optimizer": ...}`` state keeps its namespaces): DCP's ``.metadata`` file is a
  pickle, and unpickling runs code from the file, so this needs ``allow_pickle=True`` (``--allow-pickle``); tensors
  are read lazily, one at a time, through the DCP load source (:mod:`arraycheckpoint.sources.dcp`) with the
  checks of :func:`arraycheckpoint.load` (no link, no FIFO, no truncated file; DCP storage extensions such as
  compression are refused, naming the tensor); non-tensor entries (pickled in DCP) are skipped and reported;
* any other file: a ``torch.save`` state dict, loaded with ``torch.load(weights_only=True)`` (no arbitrary
  unpickling); nested dicts are flattened with ``.``; non-tensor values are skipped and reported.

Every tensor is stored as ``<namespace>/<key>`` (namespace ``model`` by default; a key that already holds
a ``/``, such as ``optimizer/w/exp_avg`` from ``export --what all``, is kept as the entry name), so ``acp.load(path,
{"model": model})`` restores a module and the checkpoint can then be loaded under any parallel layout. The
write is one ordinary single-process save through the engine (atomic commit included).
"""

from __future__ import annotations

import glob
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..checks.bounds import MAX_METADATA_BYTES, load_json_bounded
from ..engine import SaveOptions, engine
from ..errors import ArrayCheckpointError, MetadataError, PickleNotAllowedError
from ..format.metadata import MAX_NDIM, check_name
from ..planning.items import SaveObject, SaveRequest, SaveShard, SaveTensor
from ..planning.regions import Box
from ..runtime.collectives import SingleProcessCommunicator
from ..sources.hubcache import locate
from ..stateful import check_json_depth


@dataclass
class ImportResult:
    """What :func:`import_checkpoint` stored and what it had to leave out."""

    kind: str
    tensors: int = 0
    bytes: int = 0
    skipped: list[str] = field(default_factory=list)


@dataclass
class _LazySource:
    """Produces a torch tensor on demand (safetensors) and copies it into the engine's host buffer."""

    load: Callable[[], Any]
    progress: Callable[[int], None] | None = None

    def copy_into(self, out: np.ndarray) -> None:
        from ..adapters.torch.tensors import host_view

        t = self.load()
        host_view(out).copy_(t.reshape(out.shape))
        if self.progress is not None:
            self.progress(out.nbytes)


def detect_kind(src: str) -> str:
    """``safetensors``, ``hf`` (a directory of safetensors), ``dcp`` or ``torch``."""
    if os.path.isdir(src):
        _refuse_own_format(src)
        if os.path.exists(os.path.join(src, ".metadata")):
            return "dcp"
        if os.path.exists(os.path.join(src, "model.safetensors.index.json")) or glob.glob(
            os.path.join(src, "*.safetensors")
        ):
            return "hf"
        raise ArrayCheckpointError(
            f"{src} is a directory with neither *.safetensors files, model.safetensors.index.json nor a DCP "
            ".metadata file; point import at a safetensors file, an HF model directory, a DCP directory or a "
            "torch.save file"
        )
    if not os.path.exists(src):
        raise ArrayCheckpointError(f"import source {src} does not exist")
    return "safetensors" if src.endswith(".safetensors") else "torch"


_INDEX = "model.safetensors.index.json"


def _refuse_own_format(src: str) -> None:
    """Raise if ``src`` is already an arraycheckpoint checkpoint (``acp.save``'s, or ``arraycheckpoint.dcp.Writer``'s,
    whose JSON ``.metadata`` only serves DCP-style resume discovery): there is nothing to import."""
    from ..format.metadata import CONTROL_LAYOUTS

    if any(os.path.exists(os.path.join(src, f.committed)) for f in CONTROL_LAYOUTS):
        raise ArrayCheckpointError(
            f"{src} is already an arraycheckpoint checkpoint (written by acp.save or arraycheckpoint.dcp.Writer): "
            "there is nothing to import. Load it as is: acp.load(path, state), or torch.distributed.checkpoint."
            "load(state, storage_reader=arraycheckpoint.dcp.Reader(path)); to have it at another path, copy "
            "the directory"
        )
    if any(os.path.exists(os.path.join(src, f.metadata)) for f in CONTROL_LAYOUTS):
        raise ArrayCheckpointError(
            f"{src} is an arraycheckpoint checkpoint that was never committed (a save that did not finish): "
            "there is nothing to import; save it again"
        )


def _safetensors_files(src: str, kind: str) -> tuple[list[str], dict[str, str] | None]:
    """The safetensors files of ``src`` (itself, the files its index names, or its ``*.safetensors``) and,
    with an index, its ``weight_map`` (tensor -> the file's path).

    The index is read like checkpoint metadata (a regular file, never through a link, at most 256 MiB, JSON
    nested at most 100 levels); the files it names must be plain ``*.safetensors`` names inside ``src`` (no
    ``/``, no ``..``, no control character), and every file read is a regular file (a FIFO would block), not
    a link inside the directory. Raises :class:`ArrayCheckpointError` naming the file.
    """
    if kind == "safetensors":
        return [_regular(src, follow=True)], None
    index = os.path.join(src, _INDEX)
    if not os.path.lexists(index):
        found = sorted(glob.glob(os.path.join(src, "*.safetensors")))
        return [_in_dir(src, os.path.basename(p)) for p in found], None
    from ..checks.files import read_below

    raw = read_below(
        *locate(src, _INDEX), MAX_METADATA_BYTES
    )  # no link (but a hub cache's), no FIFO, bounded
    doc = load_json_bounded(raw or b"", max_bytes=MAX_METADATA_BYTES, what=index)
    weight_map = doc.get("weight_map") if isinstance(doc, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise MetadataError(f"{index} has no 'weight_map' object of tensor name -> file name")
    for name in set(weight_map.values()):
        if (
            not name.endswith(".safetensors")
            or name.startswith(".")
            or any(c in name for c in "/\\")
            or not name.isprintable()
        ):
            raise MetadataError(f"{index} names an unsafe file {name!r}: a plain *.safetensors name in {src}")
    paths = {name: _in_dir(src, name) for name in sorted(set(weight_map.values()))}
    return list(paths.values()), {key: paths[name] for key, name in weight_map.items()}


def _in_dir(src: str, name: str) -> str:
    """The regular file ``name`` of the directory ``src``, never through a link, except a Hugging Face hub
    cache snapshot's link to its blob (:mod:`arraycheckpoint.sources.hubcache`): then the blob's path."""
    where, key = locate(src, name)
    return _regular(os.path.join(where, key), follow=False)


def _regular(path: str, follow: bool, what: str = "safetensors") -> str:
    """``path`` when it is a regular file (through a link only when ``follow``: the source the user named);
    a FIFO, device or socket is refused before it is opened (opening a FIFO blocks)."""
    try:
        st = os.stat(path) if follow else os.lstat(path)
    except OSError as e:
        raise ArrayCheckpointError(f"cannot read the {what} file {path}: {e}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file"
        raise ArrayCheckpointError(f"{what} file {path} is {kind}; import reads regular files only")
    return path


def _tensors_safetensors(
    files: list[str], listed: dict[str, str] | None = None
) -> dict[str, tuple[Any, Callable[[], Any]]]:
    """key -> (meta tensor: shape and dtype, loader). ``listed`` (the index's tensor -> file) must agree
    with the files: a tensor it places in a file that does not hold it is refused, as ``acp.load`` of the
    directory refuses it (the import used to drop the tensor silently)."""
    import torch
    from safetensors import safe_open

    out: dict[str, tuple[Any, Callable[[], Any]]] = {}
    for path in files:
        try:
            with safe_open(path, framework="pt") as f:
                entries = [(key, f.get_slice(key)) for key in f.keys()]  # noqa: SIM118 - not a mapping
                shapes = [(key, sl.get_shape(), sl.get_dtype()) for key, sl in entries]
        except Exception as e:  # noqa: BLE001 - safetensors raises its own SafetensorError, OSError, ...
            why = str(e).splitlines()[0] if str(e) else type(e).__name__
            raise ArrayCheckpointError(f"{path} is not a readable safetensors file: {why}") from None
        for key, shape, dtype in shapes:
            if len(shape) > MAX_NDIM:  # the safetensors library accepts any; numpy, zarr and the load take 64
                raise MetadataError(
                    f"tensor {key!r} of {path} has {len(shape)} dimensions; a checkpoint holds at most {MAX_NDIM}"
                )
            try:
                meta = torch.empty(shape, dtype=_st_dtype(dtype), device="meta")
            except ArrayCheckpointError as e:
                raise ArrayCheckpointError(f"tensor {key!r} of {path}: {e}") from None

            def load(path: str = path, key: str = key) -> Any:
                with safe_open(path, framework="pt") as g:
                    return g.get_tensor(key)

            if key in out:
                raise ArrayCheckpointError(f"tensor {key!r} appears in two safetensors files ({path})")
            out[key] = (meta, load)
        held = {key for key, _shape, _dtype in shapes}
        lost = sorted(k for k, p in (listed or {}).items() if p == path and k not in held)
        if lost:
            more = f" (+{len(lost) - 8} more)" if len(lost) > 8 else ""
            raise MetadataError(
                f"{_INDEX} lists tensor(s) {', '.join(map(repr, lost[:8]))}{more} in {path}, which does not "
                "hold them: the directory is incomplete or its index is damaged"
            )
    return out


def _st_dtype(name: str) -> Any:
    import torch

    table = {
        "F64": torch.float64,
        "F32": torch.float32,
        "F16": torch.float16,
        "BF16": torch.bfloat16,
        "I64": torch.int64,
        "I32": torch.int32,
        "I16": torch.int16,
        "I8": torch.int8,
        "U8": torch.uint8,
        "U16": torch.uint16,
        "U32": torch.uint32,
        "U64": torch.uint64,
        "BOOL": torch.bool,
        "F8_E4M3": torch.float8_e4m3fn,
        "F8_E5M2": torch.float8_e5m2,
        "C64": torch.complex64,
    }
    if name not in table:
        raise ArrayCheckpointError(f"safetensors dtype {name} is not supported by import")
    return table[name]


def _flatten(obj: Any, prefix: str, out: dict[str, Any], skipped: list[str]) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        if prefix in out:  # {"b": {"a": t}} and {"b.a": t} both flatten to "b.a": one would be lost
            raise ArrayCheckpointError(
                f"two tensors of the torch.save file flatten to the key {prefix!r} (a nested dict and a dotted "
                "key); rename one of them before importing"
            )
        out[prefix] = obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _flatten(v, f"{prefix}.{k}" if prefix else str(k), out, skipped)
    else:
        skipped.append(f"{prefix or '<root>'} ({type(obj).__name__})")


def _tensors_torch(src: str, skipped: list[str]) -> dict[str, Any]:
    import torch

    try:
        obj = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - torch raises many kinds (UnpicklingError, RuntimeError)
        lines = [re.sub(r"\x1b\[[0-9;]*m", "", ln).strip() for ln in str(e).splitlines()]
        lines = [ln for ln in lines if ln] or [type(e).__name__]
        why = next(
            (ln for ln in lines if "GLOBAL" in ln), lines[0]
        )  # what the file holds, not torch's advice
        raise ArrayCheckpointError(
            f"cannot read {src} as a torch.save file with weights_only=True: {why}; only tensors and plain "
            "containers are imported (a whole pickled model is not: save its state_dict())"
        ) from None
    flat: dict[str, Any] = {}
    _flatten(obj, "", flat, skipped)
    return flat


def _tensors_dcp(
    src: str, skipped: list[str], progress: Callable[[int], None] | None
) -> dict[str, tuple[Any, _DcpTensor]]:
    """Entry name -> (meta tensor: shape and dtype, lazy reader) of the DCP directory ``src``: the name
    ``acp.load`` reads the DCP key as (``model.0.weight`` of a ``{"model": ...}`` state is ``model/0.weight``,
    ``optimizer.state.0.weight.exp_avg`` is ``optimizer/0.weight/exp_avg``; a flat state dict's keys stay
    as they are and go under the namespace), read through the
    DCP load source (:class:`~arraycheckpoint.sources.dcp.DcpSource`) as :func:`arraycheckpoint.load` reads
    it: its ``.metadata`` and every ``.distcp`` file pass the checks of :mod:`arraycheckpoint.checks.files`
    (no link, never a FIFO, no file shorter than what is stored in it) before anything is read, and damage
    is a :class:`~arraycheckpoint.errors.CorruptCheckpointError` naming the tensor and the file. Non-tensor
    values are skipped and reported."""
    import torch

    from ..adapters.torch.tensors import torch_dtype
    from ..codecs import numpy_dtype
    from ..sources.dcp import DcpSource
    from ..sources.dcpkeys import DCP_OBJECT
    from ..storage import storage_for

    storage, root = storage_for(src)
    source = DcpSource.open(storage, root, allow_pickle=True)
    meta = source.metadata
    out: dict[str, tuple[Any, _DcpTensor]] = {}
    for key, name in meta.objects[DCP_OBJECT].value["keys"].items():  # DCP key -> entry name
        tm = meta.tensors.get(name)
        if tm is None:
            skipped.append(f"{key} (non-tensor DCP entry: pickled, not imported)")
            continue
        shape = tuple(int(s) for s in tm.shape)
        t = torch.empty(shape, dtype=torch_dtype(numpy_dtype(tm.dtype)), device="meta")
        out[name] = (t, _DcpTensor(source, name, progress))
    return out


@dataclass
class _DcpTensor:
    """Reads one whole tensor of a DCP source into the engine's host buffer."""

    source: Any
    name: str
    progress: Callable[[int], None] | None = None

    def copy_into(self, out: np.ndarray) -> None:
        from ..engine.common import DEFAULT_INFLIGHT_BYTES
        from ..planning.items import LoadShard, LoadTensor
        from ..runtime.monitoring import PhaseRecorder

        shard = LoadShard(Box.full(out.shape), lambda a: np.copyto(out, a), target=out)
        self.source.read([LoadTensor(self.name, [shard])], DEFAULT_INFLIGHT_BYTES, PhaseRecorder())
        if self.progress is not None:
            self.progress(out.nbytes)


def import_checkpoint(
    src: str | os.PathLike[str],
    path: str | os.PathLike[str],
    namespace: str = "model",
    strip_prefix: str | None = None,
    step: int | None = None,
    overwrite: bool = False,
    progress: Callable[[int], None] | None = None,
    allow_pickle: bool = False,
    on_total: Callable[[int], None] | None = None,
) -> ImportResult:
    """Import ``src`` (see the module docstring) into a new checkpoint at ``path``.

    Args:
        namespace: top-level namespace of the imported tensors (``model``: ``acp.load(path, {"model": m})``).
        strip_prefix: remove this prefix from source keys that have it (``module.``, ``model.``, ...).
        step: training step recorded in the metadata.
        overwrite: replace a committed checkpoint at ``path``.
        progress: called with the byte count of each tensor as it is copied.
        allow_pickle: permit reading a DCP directory, whose ``.metadata`` is a pickle (trusted sources only).
        on_total: called once with the total byte count before any tensor is copied.

    Raises:
        PickleNotAllowedError: a DCP source without ``allow_pickle``.
        ArrayCheckpointError: unreadable source, unsupported dtype, or a key that is not a valid entry name.
    """
    import torch

    from ..adapters.torch.tensors import TorchSource, numpy_dtype

    src = os.fspath(src)
    kind = detect_kind(src)
    if kind == "dcp" and not allow_pickle:
        raise PickleNotAllowedError(
            f"{src} is a torch DCP checkpoint: its .metadata file is a pickle, and unpickling runs code stored "
            "in the file. Pass --allow-pickle (allow_pickle=True) only for a checkpoint you trust"
        )
    result = ImportResult(kind)
    tensors: dict[str, tuple[Any, Any]] = {}
    if kind in ("safetensors", "hf"):
        files, listed = _safetensors_files(src, kind)
        for key, (meta, load) in _tensors_safetensors(files, listed).items():
            tensors[key] = (meta, _LazySource(load, progress))
    elif kind == "dcp":
        tensors.update(_tensors_dcp(src, result.skipped, progress))
    else:
        for key, t in _tensors_torch(_regular(src, follow=True, what="torch.save"), result.skipped).items():
            tensors[key] = (t, _Counted(TorchSource(t.detach().contiguous()), progress))
    if not tensors:
        raise ArrayCheckpointError(f"{src} holds no tensors to import")
    items = []
    seen: dict[str, str] = {}  # entry name -> the source key it comes from
    for key, (t, source) in sorted(tensors.items()):
        name = key[len(strip_prefix) :] if strip_prefix and key.startswith(strip_prefix) else key
        # a key with "/" is a full entry name (as ``export --what all`` writes optimizer state): kept as is
        full = check_name(name if "/" in name else f"{namespace}/{name}")
        if full in seen:
            raise ArrayCheckpointError(
                f"source keys {seen[full]!r} and {key!r} of {src} would both be stored as {full!r} (after "
                "--strip-prefix); import without it, or rename one of them first"
            )
        seen[full] = key
        shape = tuple(int(s) for s in t.shape)
        if not isinstance(t.dtype, torch.dtype):
            raise ArrayCheckpointError(f"tensor {key!r} has no torch dtype")
        dtype = numpy_dtype(t.dtype)
        items.append(SaveTensor(full, shape, dtype, [SaveShard(Box.full(shape), source)]))
        result.bytes += int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    result.tensors = len(items)
    if on_total is not None:
        on_total(result.bytes)
    request = SaveRequest(
        tensors=items,
        objects=_hf_objects(src, namespace, {t.name for t in items}) if kind == "hf" else [],
        framework="torch",
        step=step,
        topology={"world_size": 1, "framework": "torch", "imported_from": kind},
    )
    check_json_depth(request.objects)  # a config.json nested ~95 deep: no checkpoint a load refuses
    engine().save_async(
        os.fspath(path), request, SingleProcessCommunicator(), SaveOptions(overwrite=overwrite)
    ).result()
    return result


def hf_config_docs(src: str) -> dict[str, Any]:
    """``{"config": ..., "generation_config": ...}`` of the Hugging Face directory ``src`` (the files that
    exist): each read like the index (never through a link but a hub cache's, never a FIFO, bounded)."""
    from ..checks.files import read_below
    from ..sources.safetensors import CONFIG_FILE, MAX_CONFIG_BYTES

    docs: dict[str, Any] = {}
    for key, fname in (("config", CONFIG_FILE), ("generation_config", "generation_config.json")):
        if not os.path.lexists(os.path.join(src, fname)):
            continue
        raw = read_below(*locate(src, fname), MAX_CONFIG_BYTES)
        doc = load_json_bounded(raw or b"", max_bytes=MAX_CONFIG_BYTES, what=os.path.join(src, fname))
        if isinstance(doc, dict):
            docs[key] = doc
    return docs


def _hf_objects(src: str, namespace: str, names: set[str]) -> list[SaveObject]:
    """What a Hugging Face directory holds besides tensors, as ``acp.save`` of a transformers model stores
    it and ``acp.load`` of the directory reads it: ``config.json`` and ``generation_config.json`` as
    ``<namespace>/~hf_config`` (``export`` writes them back, so ``from_pretrained`` loads the export), and
    the output embedding tied to the one input embedding stored (``<namespace>/~aliases``: the source's rule,
    :func:`arraycheckpoint.sources.safetensors._tied_aliases`). Each file is read like the index: never
    through a link but a hub cache's, never a FIFO, bounded."""
    from ..sources.safetensors import INPUT_EMBEDDINGS, OUTPUT_EMBEDDING

    docs = hf_config_docs(src)
    objects = [SaveObject(f"{namespace}/~hf_config", docs)] if docs else []
    config = docs.get("config")
    prefix = f"{namespace}/"
    if (
        config is not None
        and config.get("tie_word_embeddings", True) is True
        and prefix + OUTPUT_EMBEDDING not in names
    ):
        found = sorted(
            n[len(prefix) :] for n in names if n.startswith(prefix) and n.endswith(INPUT_EMBEDDINGS)
        )
        if len(found) == 1:
            objects.append(SaveObject(f"{namespace}/~aliases", {OUTPUT_EMBEDDING: found[0]}))
    return objects


@dataclass
class _Counted:
    inner: Any
    progress: Callable[[int], None] | None

    def copy_into(self, out: np.ndarray) -> None:
        self.inner.copy_into(out)
        if self.progress is not None:
            self.progress(out.nbytes)
