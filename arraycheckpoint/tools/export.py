"""``arraycheckpoint export``: merge a checkpoint of any save layout into Hugging Face-style safetensors.

Output (``--format safetensors``): ``model-0000N-of-0000M.safetensors`` files of at most ``max_shard_size``
bytes each (a single tensor larger than the cap gets a file of its own) and ``model.safetensors.index.json``
with ``metadata.total_size`` and ``weight_map``. Tensors are read one output file at a time, so peak memory is
about one output file (twice that when casting), never the model size.

Key names: model tensors lose their ``model/`` namespace (``model/layers.0.w`` -> ``layers.0.w``), as
``model.state_dict()`` names them; with ``what="all"`` other tensors keep their full names
(``optimizer/layers.0.w/exp_avg``). Tied weights recorded in ``model/~aliases`` are written under every name,
except when the Hugging Face config says ``tie_word_embeddings``: then once, as ``save_pretrained`` does.
``rename`` maps exact keys, ``{i}`` patterns (``decoder.layers.{i}.mlp.linear_fc2.weight`` ->
``model.layers.{i}.mlp.down_proj.weight``; any ``{name}`` matches one dot-free component) and ``re:`` regular expressions
(``re:decoder\\.layers\\.(\\d+)\\.(.*)`` -> ``model.layers.\\1.\\2``, a full match); exact keys first, then the patterns in the
map's order (the first match wins); a rule that matches no key is an error.

Hugging Face files beside the weights (``config.json``, ``generation_config.json``): from ``config`` (a
``config.json`` file or a directory holding one), else from the ``model/~hf_config`` object that
:func:`arraycheckpoint.save` stores for a transformers model; the index names the checkpoint by its base name
only (no absolute path).
``--format torch`` writes one ``torch.save`` file of the same dict (for small models: it is built in memory).

Megatron checkpoints (``--unstack``): stacked ``[L, ...]`` layer arrays become per-layer keys
(``decoder.layers.mlp.linear_fc2.weight`` -> ``decoder.layers.{i}.mlp.linear_fc2.weight``), each read as its
own sub-box. Fused tensors stay fused unless the head and query-group counts are given
(:class:`FusedSplit`): then ``linear_qkv`` splits into ``q_proj``/``k_proj``/``v_proj`` (megatron interleaves
them per query group: ``[q of the group's heads, k, v]`` per group) and a gated ``linear_fc1`` (twice the rows
``linear_fc2`` takes) into ``gate_proj``/``up_proj``; ``--rename`` then maps the keys to the loader's names.
Files honour the umask like any other file the user creates.
"""

from __future__ import annotations

import contextlib
import glob
import json
import math
import os
import re
import stat
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..codecs import ML_DTYPE_NAMES, SUPPORTED_DTYPES, numpy_dtype
from ..errors import ArrayCheckpointError, UnsupportedDTypeError
from ..format.metadata import SAFETENSORS_FRAMEWORK
from ..planning.regions import Box
from .common import Checkpoint, read_boxes, read_tensors, refuse_inside

INDEX_FILE = "model.safetensors.index.json"
FLOAT_DTYPES = frozenset(n for n in SUPPORTED_DTYPES if n in ML_DTYPE_NAMES or n.startswith("float"))


@dataclass(frozen=True)
class ExportEntry:
    """One output key: the stored tensor it comes from and its size in the output dtype.

    ``index`` selects one layer of a stacked tensor (its leading axes); ``rows`` then keeps these row ranges
    of axis 0, concatenated (a part of a fused tensor); empty means everything.
    """

    stored: str
    key: str
    dtype: str
    nbytes: int
    index: tuple[int, ...] = ()
    rows: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class FusedSplit:
    """What splitting megatron's fused tensors needs: attention heads and query groups (GQA; = heads for MHA)."""

    num_heads: int
    num_query_groups: int | None = None

    def qkv_rows(self, key: str, rows: int) -> dict[str, tuple[tuple[int, int], ...]]:
        """Row ranges of q, k and v in a fused ``linear_qkv`` of ``rows`` rows (interleaved per group)."""
        groups = self.num_query_groups or self.num_heads
        if self.num_heads % groups:
            raise ArrayCheckpointError(f"{self.num_heads} heads do not divide into {groups} query groups")
        per = self.num_heads // groups
        if rows % (groups * (per + 2)):
            raise ArrayCheckpointError(
                f"{key}: {rows} rows do not split into {groups} groups of {per} query + 1 key + 1 value heads; "
                "check --num-heads / --num-query-groups"
            )
        hd = rows // (groups * (per + 2))
        span = (per + 2) * hd
        q = tuple((g * span, g * span + per * hd) for g in range(groups))
        k = tuple((g * span + per * hd, g * span + (per + 1) * hd) for g in range(groups))
        v = tuple((g * span + (per + 1) * hd, (g + 1) * span) for g in range(groups))
        return {"q_proj": q, "k_proj": k, "v_proj": v}


@dataclass
class ExportResult:
    """What :func:`export_safetensors` / :func:`export_torch` wrote."""

    files: list[str] = field(default_factory=list)
    index: str | None = None
    total_size: int = 0
    tensors: int = 0


HF_CONFIG = "model/~hf_config"  # {"config": {...}, "generation_config": {...}} of a transformers model
CONFIG_FILES = ("config.json", "generation_config.json")


def hf_files(ckpt: Checkpoint, config: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """``{file name: JSON document}`` of the Hugging Face files an export writes beside the weights: from
    ``config`` (a ``config.json`` file, or a directory with ``config.json`` and maybe
    ``generation_config.json``), else from what the checkpoint stored (``model/~hf_config``), else, for a
    Hugging Face directory being exported (re-sharded, cast, renamed), from its own files, else none."""
    if config is not None:
        path = os.fspath(config)
        paths = (
            {n: os.path.join(path, n) for n in CONFIG_FILES} if os.path.isdir(path) else {"config.json": path}
        )
        out = {}
        for name, p in paths.items():
            if not os.path.isfile(p):
                if name == "config.json":
                    raise ArrayCheckpointError(f"--config {path}: no config.json there")
                continue
            try:
                with open(p) as f:
                    out[name] = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ArrayCheckpointError(f"--config: cannot read {p}: {e}") from None
            if not isinstance(out[name], dict):
                raise ArrayCheckpointError(f"--config: {p} is not a JSON object")
        return out
    stored = ckpt.meta.objects.get(HF_CONFIG)
    doc = stored.value if stored is not None and isinstance(stored.value, dict) else {}
    if stored is None and ckpt.meta.framework == SAFETENSORS_FRAMEWORK and "://" not in ckpt.root:
        from .importer import hf_config_docs  # a Hugging Face directory re-exported: its own config files

        doc = hf_config_docs(ckpt.root)
    keys = {"config": "config.json", "generation_config": "generation_config.json"}
    return {keys[k]: v for k, v in doc.items() if k in keys and isinstance(v, dict)}


#: The dtypes (zarr names) a safetensors file stores (what ``safetensors.numpy.save_file`` accepts).
SAFETENSORS_DTYPES = frozenset(
    (
        "bool",
        *(f"{k}{b}" for k in ("int", "uint") for b in (8, 16, 32, 64)),
        *("float16", "float32", "float64", "bfloat16", "complex64"),
        *("float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"),
    )
)
#: The safetensors header entry that holds string metadata, never a tensor.
SAFETENSORS_RESERVED = "__metadata__"


class Renamer:
    """Output key renaming: exact keys, ``{name}`` patterns and ``re:`` regular expressions (module doc)."""

    def __init__(self, rename: Mapping[str, str] | None) -> None:
        self.exact: dict[str, str] = {}
        self.patterns: list[tuple[str, re.Pattern[str], str, bool]] = []  # (rule, regex, template, is_re)
        for old, new in (rename or {}).items():
            if old.startswith("re:"):
                try:
                    self.patterns.append((old, re.compile(old[3:]), new, True))
                except re.error as e:
                    raise ArrayCheckpointError(
                        f"rename rule {old!r} is not a regular expression: {e}"
                    ) from None
            elif re.search(r"\{\w+\}", old):
                parts = re.split(r"\{(\w+)\}", old)
                regex = "".join(
                    re.escape(p) if i % 2 == 0 else f"(?P<{p}>[^.]+)" for i, p in enumerate(parts)
                )
                self.patterns.append((old, re.compile(regex), new, False))
            else:
                self.exact[old] = new
        self.used: set[str] = set()

    def __call__(self, key: str) -> str:
        if key in self.exact:
            self.used.add(key)
            return self.exact[key]
        for rule, regex, template, is_re in self.patterns:
            m = regex.fullmatch(key)
            if m is None:
                continue
            self.used.add(rule)
            try:
                return m.expand(template) if is_re else template.format(**m.groupdict())
            except (re.error, KeyError, IndexError) as e:
                raise ArrayCheckpointError(
                    f"rename rule {rule!r} -> {template!r} does not apply: {e}"
                ) from None
        return key

    def unused(self) -> list[str]:
        return sorted((set(self.exact) | {p[0] for p in self.patterns}) - self.used)


def select(
    ckpt: Checkpoint,
    what: str = "model",
    dtype: str | None = None,
    rename: Mapping[str, str] | None = None,
    unstack: bool = False,
    split: FusedSplit | None = None,
    tie_word_embeddings: bool = False,
) -> list[ExportEntry]:
    """The output keys of an export, in name order; raises on clashes after renaming.

    Args:
        what: ``"model"`` (the ``model/`` namespace) or ``"all"`` (every tensor, optimizer included).
        dtype: cast floating-point tensors to this dtype name (``bfloat16``, ``float16``, ``float32``, ...).
        rename: output key -> new output key (keys not in it keep their names).
        unstack: write megatron's stacked layers as per-layer keys (see the module docstring).
        split: with ``unstack``, split fused ``linear_qkv`` / gated ``linear_fc1`` tensors.
        tie_word_embeddings: write a tied weight once (the Hugging Face config ties the embeddings), not
            under each of its names.
    """
    if what not in ("model", "all"):
        raise ArrayCheckpointError(f"--what must be 'model' or 'all', not {what!r}")
    if dtype is not None:
        numpy_dtype(dtype)  # raises naming the dtype when unsupported
        if (
            dtype not in FLOAT_DTYPES
        ):  # float weights cast to int8 or bool: truncated values, not quantization
            raise ArrayCheckpointError(
                f"--dtype {dtype} is not a floating-point type: it casts floating-point tensors (to "
                f"{', '.join(sorted(d for d in FLOAT_DTYPES if not d.startswith('float8')))}, or a float8 type)"
            )
    meta = ckpt.meta
    pairs: list[tuple[str, str] | tuple[str, str, tuple[int, ...], tuple[tuple[int, int], ...]]] = []
    for name in sorted(meta.tensors):
        if name.startswith("model/"):
            if not unstack:
                pairs.append((name, name[len("model/") :]))
        elif what == "all":
            pairs.append((name, name))
    if unstack:
        pairs.extend(_unstacked(meta, split))
    elif split is not None:
        raise ArrayCheckpointError("splitting fused tensors needs --unstack (megatron checkpoints)")
    aliases = meta.objects.get("model/~aliases")
    if aliases is not None and isinstance(aliases.value, dict) and not tie_word_embeddings:
        for alias, target in sorted(aliases.value.items()):
            if f"model/{target}" in meta.tensors:
                pairs.append((f"model/{target}", str(alias)))
    if not pairs:
        raise ArrayCheckpointError(
            f"checkpoint {ckpt.root} has no tensors to export with --what {what} (namespaces: "
            f"{sorted({n.split('/', 1)[0] for n in meta.tensors}) or 'none'}); try --what all"
        )
    renamer = Renamer(rename)
    entries = []
    seen: dict[str, str] = {}
    for pair in pairs:
        stored, key = pair[0], pair[1]
        index, rows = pair[2:] if len(pair) == 4 else ((), ())
        key = renamer(key)
        if key in ("", SAFETENSORS_RESERVED):  # "": no name; "__metadata__": the header's own entry
            raise ArrayCheckpointError(
                f"export key {key!r} (from {stored!r}) cannot name a tensor: safetensors reserves "
                f"{SAFETENSORS_RESERVED!r} for the header's metadata and a key must not be empty (the file "
                "written would not load); fix the rename map"
            )
        if key in seen:
            raise ArrayCheckpointError(
                f"export key {key!r} would come from both {seen[key]!r} and {stored!r}; fix the rename map"
            )
        seen[key] = stored
        tm = meta.tensors[stored]
        out = dtype if dtype is not None and tm.dtype in FLOAT_DTYPES else tm.dtype
        shape = list(tm.shape[len(index) :])
        if rows:
            shape[0] = sum(b - a for a, b in rows)
        nbytes = math.prod(shape) * numpy_dtype(out).itemsize
        entries.append(ExportEntry(stored, key, out, nbytes, tuple(index), tuple(rows)))
    unknown = renamer.unused()
    if unknown:
        raise ArrayCheckpointError(f"rename map names keys that are not exported: {unknown[:10]}")
    return entries


def _unstacked(meta: Any, split: FusedSplit | None) -> list[tuple[str, str, tuple[int, ...], Any]]:
    """(stored, key, layer index, rows) of every model tensor, stacked layers split, fused tensors split."""
    from ..adapters.torch.megatron_convert import unstack_map

    out = []
    for key, sl in sorted(unstack_map(meta).items()):
        tm = meta.tensors[sl.name]
        rows = tm.shape[len(sl.index)] if len(tm.shape) > len(sl.index) else 0
        parts: dict[str, tuple[tuple[int, int], ...]] = {}
        norm = key.endswith(("layer_norm_weight", "layer_norm_bias"))  # fused norms stay as they are
        if split is None or norm:
            pass
        elif ".linear_qkv." in f".{key}":
            parts = split.qkv_rows(key, rows)
            old = "linear_qkv"
        elif ".linear_fc1." in f".{key}":
            fc2 = meta.tensors.get(sl.name.replace("linear_fc1.", "linear_fc2.").replace(".bias", ".weight"))
            if fc2 is not None and rows == 2 * fc2.shape[-1]:  # gated (SwiGLU): [gate; up]
                parts = {"gate_proj": ((0, rows // 2),), "up_proj": ((rows // 2, rows),)}
            old = "linear_fc1"
        if not parts:
            out.append((sl.name, key, sl.index, ()))
            continue
        for new, ranges in parts.items():
            out.append((sl.name, key.replace(old, new), sl.index, ranges))
    return out


def plan_files(entries: list[ExportEntry], max_shard_size: int) -> list[list[ExportEntry]]:
    """Group entries, in order, into files of at most ``max_shard_size`` bytes (an oversized tensor alone)."""
    files: list[list[ExportEntry]] = []
    current: list[ExportEntry] = []
    size = 0
    for e in entries:
        if current and size + e.nbytes > max_shard_size:
            files.append(current)
            current, size = [], 0
        current.append(e)
        size += e.nbytes
    if current:
        files.append(current)
    return files


def _box(ckpt: Checkpoint, e: ExportEntry) -> Box:
    shape = ckpt.meta.tensors[e.stored].shape
    k = len(e.index)
    return Box(tuple(e.index) + (0,) * (len(shape) - k), (1,) * k + tuple(shape[k:]))


def _materialize(ckpt: Checkpoint, group: list[ExportEntry]) -> dict[str, np.ndarray]:
    if all(not e.index and not e.rows for e in group):
        arrays = read_tensors(ckpt, sorted({e.stored for e in group}))
    else:  # one layer of a stacked tensor: read only its sub-box
        got = read_boxes(
            ckpt, sorted({(e.stored, _box(ckpt, e)) for e in group}, key=lambda x: (x[0], x[1].offsets))
        )
        arrays = {}
    out = {}
    for e in group:
        if e.stored in arrays:
            arr = arrays[e.stored]
        else:
            arr = got[(e.stored, _box(ckpt, e))].reshape(ckpt.meta.tensors[e.stored].shape[len(e.index) :])
            if e.rows:
                arr = np.concatenate([arr[a:b] for a, b in e.rows], axis=0)
        target = numpy_dtype(e.dtype)
        if arr.dtype != target:
            arr = arr.astype(target)
        # not np.ascontiguousarray: it turns a 0-d array into shape (1,)
        out[e.key] = arr if arr.flags.c_contiguous else arr.copy(order="C")
    return out


def export_safetensors(
    ckpt: Checkpoint,
    out_dir: str | os.PathLike[str],
    entries: list[ExportEntry],
    max_shard_size: int,
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
    extra_files: Mapping[str, Any] | None = None,
) -> ExportResult:
    """Write ``entries`` as sharded safetensors plus the index into ``out_dir`` (created if needed), and
    ``extra_files`` (``{name: JSON document}``: ``config.json``, ``generation_config.json``) beside them.

    Every file is written under a fresh temporary name (created with ``O_EXCL``: never through a link planted
    in ``out_dir``) and renamed into place only once all of them are written, the index last; a failed export
    removes what it wrote and leaves an older export it was to replace as it was.

    Raises :class:`ArrayCheckpointError` when ``out_dir`` already holds safetensors files (or the index, or
    one of ``extra_files``; a link of that name too), unless ``overwrite`` (then they are replaced, and old
    shards the new index does not list are removed), or when ``out_dir`` lies inside the checkpoint read.
    """
    from safetensors.numpy import save_file

    out_dir = os.fspath(out_dir)
    refuse_inside(ckpt, out_dir)
    lacking = [e for e in entries if e.dtype not in SAFETENSORS_DTYPES]
    if lacking:  # found after every tensor was read, as "cannot write <temporary>: Unknown dtype"
        e = lacking[0]
        raise ArrayCheckpointError(
            f"tensor {e.stored!r} would be exported as {e.dtype}, which safetensors cannot store"
            + (f" (and {len(lacking) - 1} more)" if len(lacking) > 1 else "")
            + "; pass --dtype with a type it stores (bfloat16, float16, float32, ...), or --format torch"
        )
    if os.path.lexists(out_dir) and not os.path.isdir(out_dir):  # a file, a FIFO, a broken link
        raise ArrayCheckpointError(
            f"{out_dir} exists and is not a directory; safetensors are exported into a directory (or pass "
            "--format torch for one file)"
        )
    os.makedirs(out_dir, exist_ok=True)
    stale = sorted(glob.glob(os.path.join(glob.escape(out_dir), "*.safetensors")))
    for name in (INDEX_FILE, *(extra_files or {})):
        if os.path.lexists(os.path.join(out_dir, name)):  # a dangling link too: it would be written through
            stale.append(os.path.join(out_dir, name))
    if stale and not overwrite:
        raise ArrayCheckpointError(
            f"{out_dir} already holds safetensors files ({os.path.basename(stale[0])}, ...); export into an empty "
            "directory or pass --overwrite to replace them"
        )
    for f in stale:  # refused before anything is written: the commit below could not replace it
        mode = os.lstat(f).st_mode
        if not (stat.S_ISREG(mode) or stat.S_ISLNK(mode)):
            raise ArrayCheckpointError(
                f"{f} is in the way of the export and is not a file (a directory, a FIFO, ...); remove it or "
                "export elsewhere"
            )
    groups = plan_files(entries, max_shard_size)
    result = ExportResult()
    weight_map: dict[str, str] = {}
    written: dict[str, tuple[int, str]] = {}  # final name -> its temporary file (descriptor, path)
    try:
        for i, group in enumerate(groups, start=1):
            fname = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
            arrays = _materialize(ckpt, group)
            fd, tmp = _fresh_file(out_dir, fname)
            os.close(fd)  # safetensors writes its own temporary file and renames it onto ``tmp``
            written[fname] = (-1, tmp)
            with _writing(tmp):
                save_file(arrays, tmp, metadata={"format": "pt"})
                written[fname] = (_open_written(tmp), tmp)
            for e in group:
                weight_map[e.key] = fname
            size = sum(a.nbytes for a in arrays.values())
            result.total_size += size
            result.tensors += len(arrays)
            result.files.append(fname)
            del arrays
            if progress is not None:
                progress(size)
        index = {
            "metadata": {
                "total_size": result.total_size,
                "format": "arraycheckpoint",
                "source": os.path.basename(ckpt.root.rstrip("/")),
                "step": ckpt.meta.step,
            },
            "weight_map": dict(sorted(weight_map.items())),
        }
        for name, doc in ((INDEX_FILE, index), *(extra_files or {}).items()):
            fd, tmp = written[name] = _fresh_file(out_dir, name)
            with _writing(tmp):
                _write_all(fd, (json.dumps(doc, indent=2) + "\n").encode())
        # commit: no index names a mix of old and new shards (the old index goes first, the new one last,
        # then the old shards the new index does not list)
        index_path = os.path.join(out_dir, INDEX_FILE)
        _unlink(index_path)
        for name, (fd, tmp) in sorted(written.items(), key=lambda kv: kv[0] == INDEX_FILE):
            _install(fd, tmp, os.path.join(out_dir, name))
            written[name] = (-1, "")
        for f in stale:
            if os.path.basename(f) not in written:
                _unlink(f)
    except BaseException:
        for fd, tmp in written.values():
            if fd >= 0:
                os.close(fd)
            if tmp:
                _unlink(tmp)
        raise
    result.index = os.path.join(out_dir, INDEX_FILE)
    return result


@contextmanager
def _writing(path: str) -> Iterator[None]:
    """Turn a failed write of ``path`` (disk full, file too large, read-only file system: safetensors raises
    ``SafetensorError``, ``torch.save`` a ``RuntimeError``) into an error naming it (exit 2, not a traceback)."""
    try:
        yield
    except ArrayCheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - only the writing of our own in-memory arrays runs in here
        raise ArrayCheckpointError(f"cannot write {path}: {str(e).splitlines()[0] if str(e) else e!r}") from e


def _fresh_file(directory: str, name: str) -> tuple[int, str]:
    """A new empty file for ``name`` in ``directory``, created with ``O_EXCL`` (a link planted there is never
    written through): its descriptor and path. Written through the descriptor, never reopened by its path
    (which another user of ``directory`` could have swapped for a link), and renamed onto ``name`` when
    complete (:func:`_install`)."""
    return tempfile.mkstemp(prefix=f".{name}.", suffix=".tmp", dir=directory)


def _open_written(path: str) -> int:
    """A descriptor of the regular file a writer just put at ``path`` (never through a link)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        raise ArrayCheckpointError(f"{path} was replaced while exporting (a link?): {e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ArrayCheckpointError(f"{path} was replaced while exporting by something that is not a file")
    return fd


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _install(fd: int, tmp: str, final: str) -> None:
    """Give the file ``fd`` (written at ``tmp``) the mode a plain ``open()`` would (``mkstemp`` and
    safetensors make 0600), check that ``tmp`` still names it, rename it onto ``final`` and close it."""
    mask = os.umask(0)
    os.umask(mask)
    os.fchmod(fd, 0o666 & ~mask)  # through the descriptor: a link put at ``tmp`` changes nothing elsewhere
    ours, now = os.fstat(fd), os.lstat(tmp)
    if (ours.st_dev, ours.st_ino) != (now.st_dev, now.st_ino):
        raise ArrayCheckpointError(f"{tmp} was replaced while exporting; nothing was installed from it")
    os.replace(tmp, final)
    os.close(fd)


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def export_torch(
    ckpt: Checkpoint,
    out: str | os.PathLike[str],
    entries: list[ExportEntry],
    progress: Callable[[int], None] | None = None,
    overwrite: bool = False,
) -> ExportResult:
    """Write ``entries`` as one ``torch.save`` dict ``{key: tensor}`` at ``out`` (built in memory), through a
    fresh temporary file renamed into place (a link planted at ``out`` is replaced, never written through)."""
    import torch

    from ..adapters.torch.tensors import as_torch, torch_dtype

    out = os.fspath(out)
    if os.path.isdir(out):
        out = os.path.join(out, "model.pt")
    refuse_inside(ckpt, out)
    for e in entries:  # before anything is read: torch lacks some of the format's dtypes
        try:
            torch_dtype(numpy_dtype(e.dtype))
        except UnsupportedDTypeError as err:
            raise ArrayCheckpointError(
                f"tensor {e.stored!r} would be exported as {e.dtype}: {err}; pass --dtype with a type torch has "
                "(bfloat16, float16, float32, ...)"
            ) from None
    if os.path.lexists(out) and not overwrite:
        raise ArrayCheckpointError(f"{out} exists; pass --overwrite to replace it")
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    state: dict[str, Any] = {}
    result = ExportResult()
    for e in entries:
        arr = _materialize(ckpt, [e])[e.key]
        state[e.key] = as_torch(arr).clone()
        result.total_size += arr.nbytes
        if progress is not None:
            progress(arr.nbytes)
    fd, tmp = _fresh_file(parent, os.path.basename(out))
    try:
        with _writing(tmp), open(os.dup(fd), "wb") as f:  # through the descriptor, not the path
            torch.save(state, f)
        _install(fd, tmp, out)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)
        _unlink(tmp)
        raise
    result.files.append(out)
    result.tensors = len(state)
    return result
