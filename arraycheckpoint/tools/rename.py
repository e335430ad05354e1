"""``arraycheckpoint rename``: rename keys of a committed checkpoint in place, without rewriting data.

A tensor is a Zarr array either in the directory named after it or (format 5) as members of a pack file
(:mod:`arraycheckpoint.planning.packing`), so renaming a tensor is a directory rename, or a rewrite of its pack under
a fresh key (:mod:`.repack`: a ZIP member cannot be renamed in place), plus a metadata rewrite; JSON objects
live in the metadata only. Each renamed array's ``dimension_names`` follow its new name. A mapping key
without ``/`` is a parameter FQN and renames it in every namespace (``model/<fqn>``, ``optimizer/<fqn>/...``),
in the optimizer's param groups and in the tied-weight aliases; a key with ``/`` is an entry name (or entry
prefix) renamed as is.

Crash safety on a local file system: a journal (``.acp-rename.json``) holding the moves, the packs to
rewrite and the new metadata is written first, then the commit marker is removed, so readers see no
checkpoint rather than a half-renamed one. Directories move in two steps through a private temporary
directory (so swaps and chains work); new packs are written there and renamed into place; the new metadata
replaces the old one by an atomic ``os.replace``; only then are the old packs removed, and the commit marker
comes back last. If the process dies on the way, running ``rename`` again on the path finishes the journal.
On object stores a rename would be a copy of every object plus a delete; that is refused here (export/import
or a re-save instead).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ..audit import scan
from ..checks import bounds, limits
from ..errors import ArrayCheckpointError, CheckpointNotFoundError, MetadataError
from ..format.metadata import CheckpointMetadata, ObjectMeta, check_name
from ..planning.packing import PACK_KEY
from ..storage import LocalStorage, storage_for
from ..storage.local import fsync_path
from . import repack

JOURNAL = ".acp-rename.json"
TMP_DIR = ".acp-rename-tmp"
#: how the rename creates a file: afresh, never through a link
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


@dataclass
class RenameResult:
    """Entries renamed by :func:`rename_checkpoint` (old -> new)."""

    tensors: dict[str, str]
    objects: dict[str, str]
    resumed: bool = False
    #: packs rewritten: old pack key -> new pack key (format 5)
    packs: dict[str, str] = dataclasses.field(default_factory=dict)


def _expand(
    meta: CheckpointMetadata, mapping: Mapping[str, str]
) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Full-name prefix rules (longest first) and the bare-FQN map."""
    names = list(meta.tensors) + list(meta.objects)
    namespaces = sorted({n.split("/", 1)[0] for n in names})
    rules: list[tuple[str, str]] = []
    fqn_map: dict[str, str] = {}
    for old, new in mapping.items():
        if not isinstance(old, str) or not isinstance(new, str) or not old or not new:
            raise ArrayCheckpointError(f"rename map entries must be non-empty strings, got {old!r}: {new!r}")
        if "/" in old:
            rules.append((old, new))
        else:
            fqn_map[old] = new
            rules.extend((f"{ns}/{old}", f"{ns}/{new}") for ns in namespaces)
    rules.sort(key=lambda r: -len(r[0]))
    return rules, fqn_map


def _apply(rules: list[tuple[str, str]], name: str) -> str:
    for old, new in rules:
        if name == old:
            return new
        if name.startswith(old + "/"):
            return new + name[len(old) :]
    return name


def _rewrite_value(name: str, value: Any, fqn_map: Mapping[str, str]) -> Any:
    if not fqn_map:
        return value
    if name.endswith("~param_groups") and isinstance(value, list):
        return [
            {**g, "params": [fqn_map.get(p, p) for p in g["params"]]}
            if isinstance(g, dict) and "params" in g
            else g
            for g in value
        ]
    if name.endswith("~aliases") and isinstance(value, dict):
        return {fqn_map.get(k, k): fqn_map.get(v, v) if isinstance(v, str) else v for k, v in value.items()}
    return value


_REF_TAGS = ("__array__", "__module__")


def _rewrite_refs(value: Any, rules: list[tuple[str, str]]) -> Any:
    """``value`` (an object's stored document) with its references to renamed tensors renamed too.

    Documents name the arrays they hold (:func:`arraycheckpoint.format.extras.encode`): ``{"__array__": name}`` and
    ``{"__module__": name}`` anywhere (a user dict with such a key is stored tagged, so these are always
    references), and the ``"arrays"`` map (name -> kind) at the top of a state or per-rank document. The
    document's own keys keep their names: the entry loads from the moved array. Without this a renamed
    tensor that a document refers to made the checkpoint unloadable.
    """
    if not rules:
        return value

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            if len(v) == 1:
                ((k, body),) = v.items()
                if k in _REF_TAGS and isinstance(body, str):
                    return {k: _apply(rules, body)}
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, list):
            return [walk(x) for x in v]
        return v

    out = walk(value)
    if isinstance(out, dict) and isinstance(out.get("arrays"), dict) and ("doc" in out or "values" in out):
        out["arrays"] = {_apply(rules, n): kind for n, kind in out["arrays"].items()}
    return out


def plan_rename(
    meta: CheckpointMetadata, mapping: Mapping[str, str], taken_packs: Collection[str] = (), root: str = ""
) -> tuple[CheckpointMetadata, RenameResult]:
    """The renamed metadata and what moves; raises on unknown keys, unsafe or clashing new names.

    Every pack holding a renamed array gets a fresh key (above the rank's packs in ``meta`` and in
    ``taken_packs``, the files already in the pack directory), named by every array it holds. Format 6:
    every pack (of the checkpoint at ``root``) holding a member of a renamed array is rewritten in place.
    """
    rules, fqn_map = _expand(meta, mapping)
    tensors = {}
    moved_t: dict[str, str] = {}
    sources: dict[str, str] = {}  # new name -> the old name it came from (for clash messages)

    def claim(old: str, new: str) -> None:
        if new in sources:
            raise ArrayCheckpointError(
                f"the rename map makes two entries share one name: {sources[new]!r} and {old!r} would both "
                f"become {new!r}; fix the map"
            )
        sources[new] = old

    for name, tm in meta.tensors.items():
        new = check_name(_apply(rules, name))
        claim(name, new)
        if new != name:
            moved_t[name] = new
        tensors[new] = dataclasses.replace(tm, name=new)
    objects = {}
    moved_o: dict[str, str] = {}
    for name, om in meta.objects.items():
        new = check_name(_apply(rules, name))
        claim(name, new)
        if new != name:
            moved_o[name] = new
        objects[new] = ObjectMeta(
            new,
            om.scope,
            _rewrite_refs(_rewrite_value(name, om.value, fqn_map), rules),
            {r: _rewrite_refs(_rewrite_value(name, v, fqn_map), rules) for r, v in om.per_rank.items()},
            # a per-rank template (arraycheckpoint.format.rankdoc): its rows are tensors, renamed with them
            _rewrite_refs(_rewrite_value(name, om.template, fqn_map), rules),
            None if om.rows is None else {k: _apply(rules, n) for k, n in om.rows.items()},
        )
    all_new = set(tensors)
    for new in all_new:  # a tensor directory may not end up inside another tensor's directory
        parts = new.split("/")
        for i in range(1, len(parts)):
            if "/".join(parts[:i]) in all_new:
                raise ArrayCheckpointError(
                    f"renamed tensor {new!r} would live inside tensor {'/'.join(parts[:i])!r}"
                )
    used = {old for old, _n in mapping.items()}
    matched = {
        o
        for o in used
        if any(
            _apply(_expand(meta, {o: mapping[o]})[0], n) != n for n in list(meta.tensors) + list(meta.objects)
        )
    }
    if used - matched:
        raise ArrayCheckpointError(
            f"rename map keys match no entry of the checkpoint: {sorted(used - matched)[:10]}"
        )
    rewritten = {p for p in (meta.tensors[o].pack for o in moved_t) if p is not None and p.endswith(".zip")}
    packs = repack.fresh_pack_keys(meta, rewritten, taken_packs)
    # format 6: the packs (of every rank) holding a member of a renamed array are rewritten in place
    packs.update((k, k) for k in repack.rank_packs_holding(root, meta, set(moved_t)))
    tensors = {
        n: dataclasses.replace(t, pack=packs[t.pack]) if t.pack in packs else t for n, t in tensors.items()
    }
    return dataclasses.replace(meta, tensors=tensors, objects=objects), RenameResult(
        moved_t, moved_o, packs=packs
    )


def journal_doc(new_meta: CheckpointMetadata, result: RenameResult) -> dict[str, Any]:
    """The journal of a planned rename (:func:`plan_rename`): what :func:`_execute` carries out."""
    return {
        "tensors": result.tensors,
        "objects": result.objects,
        "packs": result.packs,
        "metadata": new_meta.to_json(),
    }


def rename_checkpoint(path: str | os.PathLike[str], mapping: Mapping[str, str] | None) -> RenameResult:
    """Rename entries of the checkpoint at ``path`` in place (see the module docstring).

    With ``mapping=None`` only an interrupted rename is finished. Raises :class:`ArrayCheckpointError` for an
    object-store URL, an uncommitted checkpoint, or a map that matches nothing or makes names clash.
    """
    storage, root = storage_for(os.fspath(path))
    if not isinstance(storage, LocalStorage):
        raise ArrayCheckpointError(
            f"rename works on local file systems only ({root}): on an object store every object would have to "
            "be copied and deleted; export and re-import, or load and re-save under the new names instead"
        )
    journal = os.path.join(root, JOURNAL)
    if os.path.lexists(journal):
        doc = read_journal(root)
        _execute(root, doc)
        return RenameResult(
            dict(doc["tensors"]), dict(doc["objects"]), resumed=True, packs=dict(doc.get("packs", {}))
        )
    if mapping is None:
        raise ArrayCheckpointError("rename needs --map FILE (no interrupted rename to finish here)")
    if not storage.is_committed(root):
        raise CheckpointNotFoundError(f"no committed checkpoint at {root}")
    files = storage.control_files(root)  # an older checkpoint keeps its own layout (and format)
    raw = storage.read(root, files.metadata)
    if raw is None:
        raise CheckpointNotFoundError(f"checkpoint {root} has no {files.metadata}")
    meta = _read_metadata(raw, os.path.join(root, files.metadata))
    new_meta, result = plan_rename(meta, mapping, repack.existing_pack_keys(root), root)
    if not result.tensors and not result.objects:
        return result
    repack.check_old_packs(root, meta, result.packs)
    doc = journal_doc(new_meta, result)
    check_journal(root, doc)  # before the journal exists: a refused rename leaves nothing behind
    _write_durable(journal, json.dumps(doc).encode())
    _execute(root, doc)
    return result


def _read_metadata(raw: bytes, what: str) -> CheckpointMetadata:
    """The checkpoint's metadata read from the file ``what``, refused (naming the file) where no checkpoint
    could hold it: bounded JSON, and every tensor's layout as a load checks it
    (:func:`arraycheckpoint.checks.limits.check_layouts`), so a rename never commits metadata no load accepts."""
    try:
        meta = CheckpointMetadata.from_json(raw, what=what)
        limits.check_layouts(meta)
    except MetadataError as e:
        raise MetadataError(str(e) if what in str(e) else f"{what}: {e}") from None
    return meta


def _write_durable(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    if os.path.lexists(tmp):  # a stale one of an interrupted run (or a planted link: never written through)
        os.unlink(tmp)
    with os.fdopen(os.open(tmp, _CREATE, 0o644), "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_path(os.path.dirname(path))


def read_journal(root: str) -> dict[str, Any]:
    """The journal of the interrupted rename at ``root``, checked as untrusted input (anyone who could write
    the checkpoint could have planted it) before any of it is carried out.

    The journal is read like the metadata (a regular file, never through a link, never a FIFO, at most
    256 MiB, JSON nested at most 100 levels) and must be one object of ``tensors`` and ``objects`` (old name
    -> new name, each name passing the metadata's :func:`check_name`), ``packs`` (pack key -> pack key) and
    ``metadata`` (a checkpoint metadata document naming every new tensor); see :func:`check_journal` for the
    paths it touches.

    Raises:
        MetadataError: naming the journal and what is wrong with it.
    """
    path = os.path.join(root, JOURNAL)
    try:
        raw = LocalStorage().read(root, JOURNAL)
        if raw is None:
            raise MetadataError("it vanished while being read")
        doc = bounds.load_json_bounded(raw, max_bytes=bounds.MAX_METADATA_BYTES, what=path)
        check_journal(root, doc)
    except ArrayCheckpointError as e:
        raise MetadataError(
            f"rename journal {path} is not a journal this tool wrote ({e}); nothing was changed. If no rename "
            "of this checkpoint was interrupted, remove the file"
        ) from None
    return doc


def check_journal(root: str, doc: Any) -> None:
    """Refuse a journal ``doc`` that could touch anything outside the checkpoint at ``root``.

    Every name is an entry name (no ``..``, no absolute name, no control character), every pack key is a
    pack key of format 5, every new tensor is in the journal's metadata, and no path the rename moves, creates
    or removes (the arrays' old and new directories, their groups, the pack directory, the control files,
    the private temporary directory and what it holds) runs through a symlink or a non-directory below
    ``root``.

    Raises:
        ArrayCheckpointError: naming what is wrong.
    """
    if not isinstance(doc, dict):
        raise MetadataError(f"its top level is a JSON {type(doc).__name__}, not an object")
    maps: dict[str, dict[str, str]] = {}
    for field_name in ("tensors", "objects", "packs"):
        value = doc.get(field_name, {} if field_name == "packs" else None)
        if not isinstance(value, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in value.items()
        ):
            raise MetadataError(f"{field_name!r} must be an object of strings")
        maps[field_name] = value
    if not isinstance(doc.get("metadata"), str):
        raise MetadataError("'metadata' must be a string holding the renamed checkpoint's metadata")
    for old, new in (*maps["tensors"].items(), *maps["objects"].items()):
        check_name(old)
        check_name(new)
    for key in (*maps["packs"], *maps["packs"].values()):
        if not PACK_KEY.match(key):
            raise MetadataError(f"{key!r} is not a pack key")
    new_meta = CheckpointMetadata.from_json(doc["metadata"])
    limits.check_layouts(new_meta)
    missing = sorted(set(maps["tensors"].values()) - set(new_meta.tensors))
    if missing:
        raise MetadataError(f"its metadata has no tensor {missing[0]!r}, a target of its moves")
    files = LocalStorage().control_files(root)
    names = [*maps["tensors"], *new_meta.tensors, *new_meta.objects]
    dirs = {"/".join(n.split("/")[:i]) for n in names for i in range(1, n.count("/") + 2)}
    dirs.update(k.rsplit("/", 1)[0] for k in (files.metadata, files.committed, *maps["packs"]) if "/" in k)
    dirs.add(TMP_DIR)
    for d in sorted(dirs):
        _check_no_link(root, d)
    if os.path.isdir(os.path.join(root, TMP_DIR)):
        scan.scan_local(os.path.join(root, TMP_DIR))  # what an interrupted run staged: no link, no FIFO


def _check_no_link(root: str, rel: str) -> None:
    """``root/rel`` and every directory on the way below ``root`` are directories or absent (never a link)."""
    scan._check_path_below(
        root, rel, "a rename moves nothing through a link and nothing outside the checkpoint"
    )


def _execute(root: str, doc: dict[str, Any]) -> None:
    """Carry out a journal; idempotent, so an interrupted run can simply be repeated."""
    check_journal(root, doc)  # also a fresh journal: the checkpoint's own directories may be planted links
    # the checkpoint's own layout (format 3's .acp/ or an older root): its metadata is there throughout
    files = LocalStorage().control_files(root)
    marker = os.path.join(root, files.committed)
    if os.path.exists(marker):
        os.unlink(marker)
        fsync_path(os.path.dirname(marker))
    tmp = os.path.join(root, TMP_DIR)
    os.makedirs(tmp, exist_ok=True)
    new_meta = CheckpointMetadata.from_json(doc["metadata"])
    packs: dict[str, str] = dict(doc.get("packs", {}))
    # directories: the arrays with one (a packed array has none; its pack is rewritten below)
    moves = sorted(doc["tensors"].items())
    for i, (old, _new) in enumerate(moves):  # step 1: out of the way (makes swaps and chains safe)
        src = os.path.join(root, old)
        if os.path.isdir(src) and not os.path.exists(os.path.join(tmp, str(i))):
            os.rename(src, os.path.join(tmp, str(i)))
    for i, (old, new) in enumerate(moves):  # step 2: into place, creating parent groups
        staged = os.path.join(tmp, str(i))
        if os.path.isdir(staged):
            dst = os.path.join(root, new)
            parent = os.path.dirname(dst)
            os.makedirs(parent, exist_ok=True)
            os.rename(staged, dst)
        if new_meta.tensors[new].pack is None and os.path.isdir(os.path.join(root, new)):
            repack.rename_array_doc(root, old, new)  # its dimension names follow the new name
    old_names = {new: old for old, new in moves}
    for old_key, new_key in sorted(packs.items()):
        if old_key == new_key:  # format 6: in place
            repack.rebuild_rank_pack(root, old_key, old_names, tmp)
        else:
            repack.build_pack(root, old_key, new_key, new_meta, old_names, tmp)
    _write_groups(root, new_meta)
    _prune_groups(root, new_meta)
    _write_durable(os.path.join(root, files.metadata), doc["metadata"].encode())
    # only now: until the metadata names the new packs, the old ones count (format 6: rewritten in place)
    repack.remove_packs(root, [k for k, v in packs.items() if k != v])
    _write_durable(marker, b"committed\n")
    os.unlink(os.path.join(root, JOURNAL))
    fsync_path(root)
    # only once the journal is gone: a resumed run must still see which packs were rewritten in place
    shutil.rmtree(tmp, ignore_errors=True)


def _write_groups(root: str, meta: CheckpointMetadata) -> None:
    """A group ``zarr.json`` in every directory above an entry where none is (what a save writes: also above
    a packed array, whose own keys are in its pack)."""
    group_doc = json.dumps({"zarr_format": 3, "node_type": "group", "attributes": {}}).encode()
    groups = {
        "/".join(parts[:j])
        for name in list(meta.tensors) + list(meta.objects)
        for parts in [name.split("/")]
        for j in range(1, len(parts))
    }
    for group in sorted(groups):
        path = os.path.join(root, *group.split("/"))
        zj = os.path.join(path, "zarr.json")
        os.makedirs(path, exist_ok=True)
        if not os.path.lexists(zj):
            with os.fdopen(os.open(zj, _CREATE, 0o644), "wb") as f:
                f.write(group_doc)


def _prune_groups(root: str, meta: CheckpointMetadata) -> None:
    """Remove group directories that only held ``zarr.json`` and no longer contain any entry."""
    keep = {""}
    for name in list(meta.tensors) + list(meta.objects):
        parts = name.split("/")
        keep.update("/".join(parts[:i]) for i in range(1, len(parts) + 1))
    for dirpath in sorted((w[0] for w in os.walk(root)), key=len, reverse=True):
        rel = os.path.relpath(dirpath, root).replace(os.sep, "/")
        if rel == "." or rel.split("/")[0].startswith(".") or rel in keep:
            continue
        if set(os.listdir(dirpath)) <= {"zarr.json"}:
            shutil.rmtree(dirpath, ignore_errors=True)
