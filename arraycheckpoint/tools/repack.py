"""The stored files a ``rename`` rewrites besides moving directories: packs and arrays' ``zarr.json``.

A packed array (format 5, :mod:`arraycheckpoint.planning.packing`) has no directory to move: it is a set of members
``<name>/zarr.json``, ``<name>/c.0.0`` of a ZIP file ``.acp/packs/<rank>.<k>.zip``, which must stay a zarr v3
store that zarr-python (``zarr.storage.ZipStore``) and tensorstore (the ``zip`` driver) read under the
entries' *new* names. A ZIP file cannot rename a member in place, so every pack holding a renamed array is
rewritten whole, under a fresh key of the same rank (:func:`fresh_pack_keys`): the new metadata names the
new pack, the old one stays untouched until the new metadata is durable. That makes each step of the
rename journal idempotent: a new pack is built (in the rename's temporary directory, then renamed into
place) only while it does not exist, and the old pack is removed only after the metadata is replaced.

Every array's ``dimension_names`` are derived from its entry's last component
(:func:`~arraycheckpoint.codecs.presets.dimension_names_for`: xarray needs names unique per group), so a
rename rewrites them too, in a pack member as in a moved directory's ``zarr.json``; names a save did not
derive (an older or foreign array) are kept.
"""

from __future__ import annotations

import dataclasses
import json
import os
import zipfile
from collections.abc import Callable, Collection, Mapping
from typing import BinaryIO

from ..audit import packs as audit_packs
from ..audit import rankpacks
from ..checks import bounds, zipdir
from ..codecs.presets import dimension_names_for
from ..engine.packfile import Member, members_with_groups, write_zip
from ..errors import ArrayCheckpointError, CorruptCheckpointError
from ..format.metadata import CheckpointMetadata
from ..planning.packing import PACK_DIR, PACK_KEY, group_keys, pack_key
from ..storage import LocalStorage
from ..storage.local import fsync_path

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def existing_pack_keys(root: str) -> set[str]:
    """The keys of the files in the checkpoint's pack directory (whether the metadata names them or not)."""
    try:
        return {f"{PACK_DIR}/{leaf}" for leaf in os.listdir(os.path.join(root, *PACK_DIR.split("/")))}
    except FileNotFoundError:
        return set()


def fresh_pack_keys(
    meta: CheckpointMetadata, packs: Collection[str], taken: Collection[str] = ()
) -> dict[str, str]:
    """A new key for each pack of ``packs``: the same rank, an index above every pack of that rank that
    ``meta`` names or that ``taken`` holds (so a rewritten pack never overwrites any file)."""
    highest: dict[str, int] = {}
    for key in {t.pack for t in meta.tensors.values() if t.pack is not None} | set(taken):
        m = PACK_KEY.match(key)
        if m:
            highest[m.group(1)] = max(highest.get(m.group(1), -1), int(m.group(2)))
    out: dict[str, str] = {}
    for key in sorted(packs):
        m = PACK_KEY.match(key)
        if m is None:
            raise ArrayCheckpointError(
                f"{key!r} is not a pack key of this checkpoint; cannot rename its arrays"
            )
        rank = m.group(1)
        highest[rank] = highest[rank] + 1
        out[key] = pack_key(int(rank), highest[rank])
    return out


def renamed_array_doc(raw: bytes, old: str, new: str, what: str) -> bytes:
    """The ``zarr.json`` bytes ``raw`` of the array ``old`` as stored under ``new``: its ``dimension_names``
    derived from the new name when they were derived from the old one (else ``raw`` unchanged). A document a
    save wrote (``json.dumps``) comes out byte for byte as a save of ``new`` writes it. A document that does
    not parse is kept as it is: loads and ``verify`` report it; a rename half done would only add damage."""
    try:
        doc = bounds.load_json_bounded(raw, max_bytes=bounds.MAX_ARRAY_JSON_BYTES, what=what)
    except ArrayCheckpointError:
        return raw
    names = doc.get("dimension_names") if isinstance(doc, dict) else None
    if not isinstance(names, list) or names != dimension_names_for(old, len(names)):
        return raw
    fresh = dimension_names_for(new, len(names))
    if fresh == names:
        return raw
    return json.dumps({**doc, "dimension_names": fresh}).encode()


def rename_array_doc(root: str, old: str, new: str) -> None:
    """Rewrite ``<root>/<new>/zarr.json`` (a moved array directory) for its new name; idempotent."""
    path = os.path.join(root, *new.split("/"), "zarr.json")
    raw = _read_file(path, bounds.MAX_ARRAY_JSON_BYTES)
    if raw is None:
        return  # the array's directory has no document: verify and load report that, a rename cannot fix it
    out = renamed_array_doc(raw, old, new, path)
    if out != raw:
        tmp = path + ".acp-rename.tmp"
        _write_new(tmp, lambda f: f.write(out))
        os.replace(tmp, path)


def check_old_packs(root: str, meta: CheckpointMetadata, packs: Collection[str]) -> None:
    """The packs ``packs`` of ``meta`` (before the rename) pass :func:`~arraycheckpoint.audit.packs.check_packs` for every array they
    hold (format 6: :func:`~arraycheckpoint.audit.rankpacks.check_rank_packs` for every packed array): checked before the journal is
    written, so a damaged pack refuses the rename with nothing touched."""
    for key in sorted(k for k in packs if k.endswith(".zip") and PACK_KEY.match(k) and _holds(meta, k)):
        audit_packs.check_packs(
            LocalStorage(), root, meta, [n for n, t in meta.tensors.items() if t.pack == key]
        )
    if any(t.pack_rank is not None for t in meta.tensors.values()) and packs:
        rankpacks.check_rank_packs(
            LocalStorage(), root, meta, [n for n, t in meta.tensors.items() if t.pack_rank is not None]
        )
    # the checks above read directories and headers; the rename copies every member: read each one now as
    # it will be read then (its CRC-32 checked), so a pack it could not rewrite refuses it with nothing changed
    for key in sorted(packs):
        source = os.path.join(root, *key.split("/"))
        if os.path.lexists(source):
            _zip_members(source)


def _holds(meta: CheckpointMetadata, key: str) -> bool:
    return any(t.pack == key for t in meta.tensors.values())


def rank_packs_holding(root: str, meta: CheckpointMetadata, arrays: Collection[str]) -> list[str]:
    """Format 6: the keys of the packs holding a member of any of the packed ``arrays`` (the packs of their
    creators and writers, read with the load's checks)."""
    names = [n for n in arrays if meta.tensors[n].pack_rank is not None]
    if not names or not root:
        return []
    directories: dict[str, list[zipdir.PackMember]] = {}
    rankpacks.check_rank_packs(LocalStorage(), root, meta, names, None, directories)
    wanted = set(names)
    return sorted(
        k
        for k, entries in directories.items()
        if any(e.filename.rpartition("/")[0] in wanted for e in entries)
    )


def rebuild_rank_pack(root: str, key: str, old_names: Mapping[str, str], tmp_dir: str) -> None:
    """Rewrite the format-6 pack ``key`` in place with the members of renamed arrays under their new names
    (``old_names``: new name -> old name); idempotent across an interrupted run: the new pack is built in
    ``tmp_dir`` (``<leaf>.new``), a ``<leaf>.done`` mark is written, then it replaces the pack, so a resumed
    run finishes the replacement or skips a pack already renamed (never renaming twice: swaps stay safe)."""
    leaf = key.rsplit("/", 1)[-1]
    final = os.path.join(root, *key.split("/"))
    built = os.path.join(tmp_dir, f"{leaf}.new")
    done = os.path.join(tmp_dir, f"{leaf}.done")
    if not os.path.exists(done):
        old_to_new = {o: n for n, o in old_names.items()}
        members = _renamed_members(final, old_to_new, groups=False)
        tmp = os.path.join(tmp_dir, f"{leaf}.part")
        _write_new(tmp, lambda f: write_zip(f, members))
        os.rename(tmp, built)
        _write_new(done, lambda f: f.write(b"built\n"))
        fsync_path(tmp_dir)
    if os.path.exists(built):
        os.replace(built, final)
        fsync_path(os.path.dirname(final))


def build_pack(
    root: str,
    old_key: str,
    new_key: str,
    meta: CheckpointMetadata,
    old_names: Mapping[str, str],
    tmp_dir: str,
) -> None:
    """Create the pack ``new_key`` from ``old_key`` unless it exists already (a resumed rename).

    Args:
        root: the checkpoint directory.
        old_key, new_key: the pack's key before and after the rename.
        meta: the renamed metadata (its arrays with ``pack == new_key`` are the pack's members).
        old_names: new entry name -> old entry name of every renamed array.
        tmp_dir: a private directory in which the new pack is written before it is renamed into place.

    Raises:
        ArrayCheckpointError: neither pack exists; or the old pack fails :func:`~arraycheckpoint.audit.packs.check_packs`.
    """
    final = os.path.join(root, *new_key.split("/"))
    if os.path.lexists(final):
        return  # built by an interrupted run: created under a temporary name, so complete
    new_to_old = {n: old_names.get(n, n) for n, t in meta.tensors.items() if t.pack == new_key}
    old_to_new = {o: n for n, o in new_to_old.items()}
    # the old pack as the old metadata described it: sound before a byte of it is copied
    view = dataclasses.replace(
        meta,
        tensors={
            o: dataclasses.replace(meta.tensors[n], name=o, pack=old_key) for n, o in new_to_old.items()
        },
    )
    source = os.path.join(root, *old_key.split("/"))
    if not os.path.lexists(source):
        raise ArrayCheckpointError(
            f"cannot finish the rename of {root}: the pack {source} is missing and its renamed copy {final} "
            "was never built; the arrays it held are lost"
        )
    audit_packs.check_packs(LocalStorage(), root, view, list(old_to_new))
    members = _renamed_members(source, old_to_new)
    tmp = os.path.join(tmp_dir, f"{new_key.rsplit('/', 1)[-1]}.part")
    _write_new(tmp, lambda f: write_zip(f, members_with_groups(sorted(old_to_new.values()), members)))
    os.rename(tmp, final)
    fsync_path(os.path.dirname(final))


def remove_packs(root: str, keys: Collection[str]) -> None:
    """Remove the (old) packs ``keys`` that still exist; idempotent."""
    removed = False
    for key in keys:
        path = os.path.join(root, *key.split("/"))
        if os.path.lexists(path):
            os.unlink(path)
            removed = True
    if removed:
        fsync_path(os.path.join(root, *PACK_DIR.split("/")))


def _renamed_members(source: str, old_to_new: Mapping[str, str], groups: bool = True) -> list[Member]:
    """The members of the pack file ``source`` under their new names, without its group documents (the new
    pack's are derived from the new names; format 6 has none). A member of no array of the pack is kept as it
    is."""
    skip = set(group_keys(old_to_new)) if groups else set()
    out: list[Member] = []
    for info, data in _zip_members(source):
        if info.filename in skip:
            continue
        # an array's members are its zarr.json and its chunks, whose keys have no "/" (format 5: "c.0.0")
        old = info.filename.rpartition("/")[0]
        if old not in old_to_new:
            out.append((info.filename, [data]))
            continue
        new = old_to_new[old]
        key = new + info.filename[len(old) :]
        if info.filename == f"{old}/zarr.json":
            data = renamed_array_doc(data, old, new, f"{source}:{info.filename}")
        out.append((key, [data]))
    seen: set[str] = set()
    for key, _parts in out:
        if key in seen:
            raise CorruptCheckpointError(
                f"renaming the arrays of the pack {source} would store the member {key!r} twice (the pack holds a "
                "member of no array under that name); the pack is damaged"
            )
        seen.add(key)
    return out


def _zip_members(source: str) -> list[tuple[zipfile.ZipInfo, bytes]]:
    """Every member of the pack file ``source`` (already checked: bounded, stored, no link) and its bytes, each
    CRC-32 checked; :class:`CorruptCheckpointError` naming the pack (and the member) when Python's zipfile
    cannot read it (a damaged member, a directory field it refuses)."""
    member = ""
    try:
        fd = os.open(source, os.O_RDONLY | _NOFOLLOW)
        with os.fdopen(fd, "rb") as f, zipfile.ZipFile(f) as zf:
            out = []
            for info in zf.infolist():
                member = f" (member {info.filename!r})"
                out.append((info, zf.read(info)))
            return out
    except (zipfile.BadZipFile, NotImplementedError, ValueError, EOFError, OSError) as e:
        raise CorruptCheckpointError(
            f"the pack {source}{member} cannot be read to rewrite it ({e}); the pack is damaged: the rename "
            "is refused (verify names the damaged tensors)"
        ) from None


def _read_file(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file ``path`` (never through a link), None when it does not exist."""
    try:
        fd = os.open(path, os.O_RDONLY | _NOFOLLOW)
    except FileNotFoundError:
        return None
    except OSError as e:  # ELOOP: a link
        raise CorruptCheckpointError(f"{path} cannot be opened without following a link ({e})") from None
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise CorruptCheckpointError(f"{path} is larger than an array's zarr.json can be ({limit} bytes)")
    return data


def _write_new(path: str, write: Callable[[BinaryIO], object]) -> None:
    """Create ``path`` afresh (a stale one from an interrupted run is replaced), write it and fsync it."""
    if os.path.lexists(path):
        os.unlink(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _NOFOLLOW, 0o644)
    with os.fdopen(fd, "wb", buffering=1 << 20) as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())
