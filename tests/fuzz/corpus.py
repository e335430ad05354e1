"""The shared corpus of hostile inputs: arraycheckpoint checkpoints (both layouts), Hugging Face directories,
DCP directories and CheckpointManager roots, each damaged or forged one way, built once per session.

Every item lives in ``<sandbox>/corpus/<name>``; what an item points at (a link's target, a planted
journal's victim) lives in ``<sandbox>/outside``, which no entry point may read, change or delete
(:func:`snapshot` of it is compared after every case). A link's target outside is a *valid* copy of the file it
replaces, so a reader that followed the link would succeed instead of refusing: following is detected.

An item is rebuilt (not copied: FIFOs cannot be copied) into a private directory for an entry point that
writes (``rename``, the manager). Only plain zipfile/json/byte edits forge items: none of arraycheckpoint's
own code.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

W, B = "model/w", "model/b"
#: the tensors every item holds (or claims to): 8 x 4 and 4 float32
SHAPES = {"w": (8, 4), "b": (4,)}


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(*s, generator=g) for k, s in SHAPES.items()}


@dataclass(frozen=True)
class Item:
    """One hostile input: ``kind`` (native, hf, dcp, manager), how to build it into a directory, and which
    entry points may succeed on it (the damage is somewhere they never read); every other entry point must
    refuse it with a clear error."""

    name: str
    kind: str
    build: Callable[[Path, Path], None]  # (destination, outside directory)
    may_pass: frozenset[str] = field(default_factory=frozenset)
    fifo: bool = False  # holds a FIFO: a reader that blocks on it is a hang (short timeout)
    names: tuple[str, ...] = ()  # what else a clear error may name (a hostile tensor name)


# Bases --------------------------------------------------------------------------------------------------
def save_native(dest: Path, layout: str) -> None:
    import arraycheckpoint as acp

    options = {} if layout == "packed" else {"plan_options": acp.PlanOptions(pack_array_bytes=0)}
    acp.save(dest, {"model": tensors()}, **options)


def save_hf(dest: Path, sharded: bool) -> None:
    from safetensors.torch import save_file

    dest.mkdir(parents=True)
    t = tensors()
    if not sharded:
        save_file(t, str(dest / "model.safetensors"))
        return
    save_file({"w": t["w"]}, str(dest / "model-00001-of-00002.safetensors"))
    save_file({"b": t["b"]}, str(dest / "model-00002-of-00002.safetensors"))
    index = {"weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))


def save_dcp(dest: Path) -> None:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save({"model": tensors()}, checkpoint_id=str(dest))


def save_dcp_values(dest: Path) -> None:
    """A DCP directory whose non-tensor values fill a file of their own: DCP's writer deals values to its
    files round-robin, then tensors to the emptiest file, so with three files and three values the third
    file holds only ``note``."""
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        state = {"model": tensors(), "step": 5, "epoch": 1, "note": "x"}
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dest), thread_count=3))


BASES: dict[str, Callable[[Path], None]] = {
    "packed": lambda d: save_native(d, "packed"),
    "directory": lambda d: save_native(d, "directory"),
    "hf1": lambda d: save_hf(d, sharded=False),
    "hf2": lambda d: save_hf(d, sharded=True),
    "dcp": save_dcp,
    "dcpv": save_dcp_values,
}
_BASE_CACHE: dict[str, Path] = {}


def base_copy(base: str, dest: Path) -> None:
    """A fresh copy of the valid input ``base`` at ``dest`` (regular files only)."""
    shutil.copytree(_BASE_CACHE[base], dest, symlinks=True)


def build_bases(where: Path) -> None:
    for name, fn in BASES.items():
        path = where / name
        if not path.exists():
            fn(path)
        _BASE_CACHE[name] = path


# Edits --------------------------------------------------------------------------------------------------
DEEP = b"[" * 100_000 + b"]" * 100_000  # 200 KB of nested brackets
META = ".acp/metadata.json"
PACK = ".acp/packs/0.0.zip"


def _meta(dest: Path) -> dict:
    return json.loads((dest / META).read_text())


def _set_meta(dest: Path, doc: dict) -> None:
    (dest / META).write_text(json.dumps(doc))


def _link_outside(path: Path, outside: Path, tag: str) -> None:
    """Replace ``path`` by a link to a valid copy of it outside (a directory is copied whole)."""
    target = outside / f"target-{tag}-{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if path.is_dir():
        shutil.copytree(path, target)
        shutil.rmtree(path)
    else:
        shutil.copyfile(path, target)
        path.unlink()
    os.symlink(target, path)


def _fifo(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()
    os.mkfifo(path)


def _cut(path: Path, at: float | int) -> None:
    raw = path.read_bytes()
    n = int(len(raw) * at) if isinstance(at, float) else (at if at >= 0 else len(raw) + at)
    path.write_bytes(raw[:n])


def _chunk_file(dest: Path, name: str) -> Path:
    files = [p for p in (dest / name).iterdir() if p.name != "zarr.json"]
    assert len(files) == 1, files
    return files[0]


def _add_unicode_path(pack: Path, victim: bytes, other: bytes) -> None:
    """Give the central entry ``victim`` an Info-ZIP Unicode Path extra field naming ``other``."""
    raw = pack.read_bytes()
    at = raw.rfind(b"PK\x05\x06")
    _n, cd_size, cd_off = struct.unpack_from("<HII", raw, at + 10)
    cd, out, pos = raw[cd_off : cd_off + cd_size], b"", 0
    while pos < len(cd):
        nlen, xlen, clen = struct.unpack_from("<HHH", cd, pos + 28)
        rec = bytearray(cd[pos : pos + 46 + nlen + xlen + clen])
        if cd[pos + 46 : pos + 46 + nlen] == victim:
            body = b"\x01" + struct.pack("<I", zlib.crc32(victim)) + other
            extra = struct.pack("<HH", 0x7075, len(body)) + body
            struct.pack_into("<H", rec, 30, xlen + len(extra))
            rec = rec[: 46 + nlen + xlen] + extra + rec[46 + nlen + xlen :]
        out += bytes(rec)
        pos += 46 + nlen + xlen + clen
    eocd = bytearray(raw[at:])
    struct.pack_into("<I", eocd, 12, len(out))
    pack.write_bytes(raw[:cd_off] + out + bytes(eocd))


def _add_member(pack: Path, name: str) -> None:
    import zipfile

    with zipfile.ZipFile(pack, "a" if pack.exists() else "w") as zf:
        zf.writestr(zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0)), b"x" * 16)


def _set_eocd(pack: Path, **fields: int) -> None:
    raw = bytearray(pack.read_bytes())
    at = raw.rfind(b"PK\x05\x06")
    index = {
        "entries": (8, "<H"),
        "entries_total": (10, "<H"),
        "cd_size": (12, "<I"),
        "cd_offset": (16, "<I"),
    }
    for k, v in fields.items():
        off, fmt = index[k]
        struct.pack_into(fmt, raw, at + off, v)
    pack.write_bytes(bytes(raw))


def _huge_member_size(pack: Path) -> None:
    """Every central entry claims 0xFFFFFFFF bytes with a zip64 field of 2**63."""
    raw = bytearray(pack.read_bytes())
    at = raw.rfind(b"PK\x05\x06")
    _n, cd_size, cd_off = struct.unpack_from("<HII", raw, at + 10)
    cd, out, pos = bytes(raw[cd_off : cd_off + cd_size]), b"", 0
    while pos < len(cd):
        nlen, xlen, clen = struct.unpack_from("<HHH", cd, pos + 28)
        rec = bytearray(cd[pos : pos + 46 + nlen + xlen + clen])
        struct.pack_into("<II", rec, 20, 0xFFFFFFFF, 0xFFFFFFFF)
        extra = struct.pack("<HHQQ", 1, 16, 1 << 63, 1 << 63)
        struct.pack_into("<H", rec, 30, xlen + len(extra))
        rec = rec[: 46 + nlen + xlen] + extra + rec[46 + nlen + xlen :]
        out += bytes(rec)
        pos += 46 + nlen + xlen + clen
    eocd = bytearray(raw[at:])
    struct.pack_into("<I", eocd, 12, len(out))
    pack.write_bytes(bytes(raw[:cd_off]) + out + bytes(eocd))


def _declare(dest: Path, name: str, shape: list[int], chunk: list[int]) -> None:
    doc = _meta(dest)
    t = doc["tensors"][name]
    t["shape"], t["chunk_shape"], t["inner_chunk_shape"] = shape, chunk, chunk
    t["writers"] = []
    _set_meta(dest, doc)


def _rename_tensor(dest: Path, new: str) -> None:
    doc = _meta(dest)
    doc["tensors"][new] = doc["tensors"].pop(W)
    _set_meta(dest, doc)


def _empty_objects(dest: Path, megabytes: int) -> None:
    """Valid metadata whose ``metrics`` holds ``megabytes`` MiB of empty objects."""
    text = (dest / META).read_text()
    doc = json.loads(text)
    doc["metrics"] = {}
    body = json.dumps(doc)
    filler = "[" + ",".join(["{}"] * (megabytes * (1 << 20) // 3)) + "]"
    (dest / META).write_text(body[:-1] + ',"x":' + filler + "}")


def _journal(dest: Path, outside: Path) -> None:
    """A planted rename journal moving a directory outside the checkpoint into it."""
    victim = outside / "victim" / "tree"
    doc = {
        "tensors": {os.path.relpath(victim, dest): "model/stolen"},
        "objects": {},
        "packs": {},
        "metadata": (dest / META).read_text(),
    }
    (dest / ".acp-rename.json").write_text(json.dumps(doc))


def _hf_header(path: Path, header: bytes, data: bytes = b"") -> None:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)


def _hf_index(dest: Path, weight_map: dict) -> None:
    (dest / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def _distcp(dest: Path) -> Path:
    (f,) = [p for p in dest.iterdir() if p.suffix == ".distcp"]
    return f


def _value_distcp(dest: Path) -> Path:
    """The ``.distcp`` file of a ``dcpv`` directory that holds values only (no tensor is stored in it)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    md = dcp.FileSystemReader(str(dest)).read_metadata()
    kinds: dict[str, set[bool]] = {}
    for idx, info in md.storage_data.items():
        is_value = isinstance(md.state_dict_metadata[idx.fqn], BytesStorageMetadata)
        kinds.setdefault(info.relative_path, set()).add(is_value)
    (name,) = [f for f, k in kinds.items() if k == {True}]
    return dest / name


def _manager_fifo(dest: Path) -> None:
    dest.mkdir()
    save_native(dest / "step_00000001", "packed")
    os.mkfifo(dest / "step_00000004")


def _manager_digits(dest: Path) -> None:
    dest.mkdir()
    save_native(dest / "step_00000001", "packed")
    shutil.copytree(dest / "step_00000001", dest / "step_\u0669\u0669")  # Arabic-Indic 99


def _regions(dest: Path, regions: list, writers: object = "held", **layout: object) -> None:
    """``model/w``'s saved regions (and writers, and any layout field) replaced in the metadata (format 7:
    ``"writers": "held"``: a reader derives every writer from the regions)."""
    doc = _meta(dest)
    doc["tensors"][W].update(regions=regions, writers=writers, **layout)
    _set_meta(dest, doc)


def _column_split(dest: Path, world: int) -> None:
    """``model/w`` declared ``[1, 2 * world]``, split by columns over ``world`` ranks (a 40-byte mesh rule):
    every region starts at row 0 (a pairwise overlap check sorted by rows compares 2 x 10^8 pairs). The ranks
    after the saving rank 0 (each rank is in one layout group: groups sharing a rank are refused first)."""
    doc = _meta(dest)
    doc["world_size"] = world + 1
    doc["layout_groups"].append({"meshes": [[[world], ["arange", 1]]], "ranks": [[1, world + 1, 1]]})
    shape = [1, 2 * world]
    doc["tensors"][W].update(
        shape=shape,
        chunk_shape=[1, 2],
        inner_chunk_shape=[1, 2],
        writers="held",
        regions=[[len(doc["layout_groups"]) - 1, ["mesh", 0, [-1, 1][1:]]]],
    )
    _set_meta(dest, doc)


# The corpus ---------------------------------------------------------------------------------------------
#: entry points that read only the metadata of a native checkpoint (never its arrays)
META_ONLY = frozenset({"inspect", "metrics"})
#: entry points that move arrays without reading their chunks (directory layout)
MOVES = frozenset({"rename"})


def _on(base: str, *edits: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    def build(dest: Path, outside: Path) -> None:
        base_copy(base, dest)
        for e in edits:
            e(dest, outside)

    return build


def _items() -> list[Item]:
    data = META_ONLY  # damage in the arrays: what reads only metadata may pass
    items = [
        # metadata and control files (both layouts read them alike: the packed base)
        Item("meta_deep", "native", _on("packed", lambda d, o: (d / META).write_bytes(DEEP))),
        Item(
            "meta_non_utf8", "native", _on("packed", lambda d, o: (d / META).write_bytes(b"\xff\xfe{\x80}"))
        ),
        Item("meta_empty_objects_8mib", "native", _on("packed", lambda d, o: _empty_objects(d, 8))),
        Item("meta_fifo", "native", _on("packed", lambda d, o: _fifo(d / META)), fifo=True),
        Item("meta_link", "native", _on("packed", lambda d, o: _link_outside(d / META, o, "meta"))),
        Item("control_dir_link", "native", _on("packed", lambda d, o: _link_outside(d / ".acp", o, "acp"))),
        Item(
            "name_dotdot",
            "native",
            _on("packed", lambda d, o: _rename_tensor(d, "model/../../x")),
            names=("model/../../x",),
        ),
        Item(
            "name_newline",
            "native",
            _on("packed", lambda d, o: _rename_tensor(d, "model/nl\nx")),
            names=("model/nl",),
        ),
        Item(
            "journal_outside",
            "native",
            _on("packed", _journal),
            may_pass=frozenset(
                {"load", "store", "verify", "inspect", "diff", "export", "metrics", "manager"}
            ),
        ),
        # format 7: writers derived from the saved regions
        Item(
            "held_regions_overlap",
            "native",
            _on("packed", lambda d, o: _regions(d, [[0, ["boxes", [[[0, 0], [6, 4]], [[4, 0], [4, 4]]]]]])),
            may_pass=META_ONLY,
        ),
        Item(
            "rule_boxes_malformed",
            "native",
            _on("packed", lambda d, o: _regions(d, [[0, ["boxes", [5]]]])),
        ),
        Item(
            "held_packed_huge_grid",  # 2^24 derived chunks declared in rank 0's packs of a few KB
            "native",
            _on(
                "packed",
                lambda d, o: _regions(
                    d, [[0, ["replica"]]], shape=[1 << 24, 4], chunk_shape=[1, 4], inner_chunk_shape=[1, 4]
                ),
            ),
            # the load (strict=False) skips model/w, whose shape is not the target's, and reads model/b, whose
            # members are intact: model/w's member (larger than its declared chunk) concerns model/w alone
            may_pass=META_ONLY | {"load", "manager"},
        ),
        Item(
            "held_column_split",
            "native",
            _on("packed", lambda d, o: _column_split(d, 20_000)),
            may_pass=META_ONLY,
        ),
        # packs (format 5)
        Item(
            "packed_huge_shape",
            "native",
            _on("packed", lambda d, o: _declare(d, W, [1 << 25, 1 << 25], [1, 1])),
            may_pass=frozenset({"inspect"}),
        ),
        Item(
            "pack_link",
            "native",
            _on("packed", lambda d, o: _link_outside(d / PACK, o, "pack")),
            may_pass=data,
        ),
        Item("pack_fifo", "native", _on("packed", lambda d, o: _fifo(d / PACK)), may_pass=data, fifo=True),
        Item(
            "pack_unicode_path",
            "native",
            _on(
                "packed", lambda d, o: _add_unicode_path(d / PACK, b"model/b/zarr.json", b"model/w/zarr.json")
            ),
            may_pass=data,
        ),
        Item(
            "pack_member_dotdot",
            "native",
            _on("packed", lambda d, o: _add_member(d / PACK, "../../outside/evil")),
            may_pass=data,
        ),
        Item(
            # a second model/w chunk in a pack after rank 0's last: the metadata says rank 0 wrote one pack, so
            # no reader opens another (they read on to the first absent pack and refused it: one probe per rank)
            "pack_after_last_duplicate",
            "native",
            _on("packed", lambda d, o: _add_member(d / ".acp/packs/0.1.zip", f"{W}/c.0.0")),
            may_pass=frozenset(
                {"load", "store", "verify", "inspect", "diff", "export", "metrics", "rename", "manager"}
            ),
        ),
        Item(
            "pack_huge_sizes",
            "native",
            _on("packed", lambda d, o: _huge_member_size(d / PACK)),
            may_pass=data,
        ),
        Item(
            "pack_lying_eocd",
            "native",
            _on(
                "packed",
                lambda d, o: _set_eocd(d / PACK, entries=0xFFFF, entries_total=0xFFFF, cd_offset=1 << 30),
            ),
            may_pass=data,
        ),
        *[
            Item(
                f"pack_cut_{tag}",
                "native",
                _on("packed", lambda d, o, at=at: _cut(d / PACK, at)),
                may_pass=data,
            )
            for tag, at in (("4", 4), ("quarter", 0.25), ("half", 0.5), ("minus1", -1), ("minus22", -22))
        ],
        # arrays in their own directories (format 4's layout, still written for large arrays)
        Item(
            "chunk_link",
            "native",
            _on("directory", lambda d, o: _link_outside(_chunk_file(d, W), o, "chunk")),
            may_pass=data | MOVES,
        ),
        Item(
            "chunk_fifo",
            "native",
            _on("directory", lambda d, o: _fifo(_chunk_file(d, W))),
            may_pass=data | MOVES,
            fifo=True,
        ),
        Item(
            "chunk_cut_half",
            "native",
            _on("directory", lambda d, o: _cut(_chunk_file(d, W), 0.5)),
            may_pass=data | MOVES,
        ),
        Item(
            "array_json_deep",
            "native",
            _on("directory", lambda d, o: (d / W / "zarr.json").write_bytes(DEEP[:60_000] + DEEP[-60_000:])),
            may_pass=data | MOVES,
        ),
        Item(
            "directory_huge_shape",
            "native",
            _on("directory", lambda d, o: _declare(d, W, [10**13, 4], [10**13, 4])),
            may_pass=frozenset({"inspect"}),
        ),
        # Hugging Face directories
        Item(
            "hf_index_deep",
            "hf",
            _on("hf2", lambda d, o: (d / "model.safetensors.index.json").write_bytes(DEEP)),
        ),
        Item(
            "hf_index_non_utf8",
            "hf",
            _on(
                "hf2",
                lambda d, o: (d / "model.safetensors.index.json").write_bytes(b'{"weight_map": "\xff\xfe"}'),
            ),
        ),
        Item(
            "hf_index_nul_name",
            "hf",
            _on(
                "hf2",
                lambda d, o: _hf_index(
                    d, {"w": "model-0\x00.safetensors", "b": "model-00002-of-00002.safetensors"}
                ),
            ),
        ),
        Item(
            "hf_index_fifo",
            "hf",
            _on("hf2", lambda d, o: _fifo(d / "model.safetensors.index.json")),
            fifo=True,
        ),
        Item(
            "hf_shard_link",
            "hf",
            _on("hf2", lambda d, o: _link_outside(d / "model-00001-of-00002.safetensors", o, "shard")),
        ),
        Item(
            "hf_shard_fifo",
            "hf",
            _on("hf2", lambda d, o: _fifo(d / "model-00001-of-00002.safetensors")),
            fifo=True,
        ),
        Item(
            "hf_single_link",
            "hf",
            _on("hf1", lambda d, o: _link_outside(d / "model.safetensors", o, "single")),
        ),
        Item("hf_header_deep", "hf", _on("hf1", lambda d, o: _hf_header(d / "model.safetensors", DEEP))),
        Item(
            "hf_two_bytes", "hf", _on("hf1", lambda d, o: (d / "model.safetensors").write_bytes(b"\x01\x02"))
        ),
        Item(
            "hf_header_past_eof",
            "hf",
            _on(
                "hf1", lambda d, o: (d / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 20) + b"{}")
            ),
        ),
        *[
            Item(f"hf_cut_{tag}", "hf", _on("hf1", lambda d, o, at=at: _cut(d / "model.safetensors", at)))
            for tag, at in (("7", 7), ("40", 40), ("half", 0.5), ("minus1", -1))
        ],
        # DCP directories (read with allow_pickle=True)
        *[
            Item(f"dcp_cut_{tag}", "dcp", _on("dcp", lambda d, o, at=at: _cut(_distcp(d), at)))
            for tag, at in (("0", 0), ("half", 0.5), ("minus1", -1), ("100", 100))
        ],
        Item("dcp_distcp_link", "dcp", _on("dcp", lambda d, o: _link_outside(_distcp(d), o, "distcp"))),
        Item("dcp_distcp_fifo", "dcp", _on("dcp", lambda d, o: _fifo(_distcp(d))), fifo=True),
        Item("dcp_metadata_fifo", "dcp", _on("dcp", lambda d, o: _fifo(d / ".metadata")), fifo=True),
        # a file holding only non-tensor values (read when the directory is opened, before any tensor)
        Item("dcp_value_link", "dcp", _on("dcpv", lambda d, o: _link_outside(_value_distcp(d), o, "value"))),
        Item("dcp_value_fifo", "dcp", _on("dcpv", lambda d, o: _fifo(_value_distcp(d))), fifo=True),
        Item("dcp_value_cut", "dcp", _on("dcpv", lambda d, o: _cut(_value_distcp(d), 0.5))),
        # CheckpointManager roots
        Item("manager_fifo_step", "manager", lambda d, o: _manager_fifo(d), fifo=True),
        Item("manager_digits", "manager", lambda d, o: _manager_digits(d)),
    ]
    return items


ITEMS: dict[str, Item] = {i.name: i for i in _items()}


# The sandbox --------------------------------------------------------------------------------------------
def make_outside(outside: Path) -> None:
    """What no case may touch: a canary, a victim directory tree, a FIFO."""
    outside.mkdir(parents=True, exist_ok=True)
    (outside / "canary.txt").write_text("canary\n")
    (outside / "victim" / "tree").mkdir(parents=True, exist_ok=True)
    (outside / "victim" / "tree" / "file.txt").write_text("victim\n")
    if not (outside / "fifo").exists():
        os.mkfifo(outside / "fifo")


def snapshot(root: Path, skip: tuple[str, ...] = ()) -> dict[str, tuple]:
    """Every entry below ``root`` (relative name -> kind, size, mtime, and a digest of a regular file): taken
    with ``lstat`` and never opening a FIFO. ``skip``: names directly below ``root`` not walked at all (the
    cases' own work directories, which cases running at the same time change under the walk)."""
    import stat

    out: dict[str, tuple] = {}
    top = os.fspath(root)
    for dirpath, dirnames, filenames in os.walk(top):
        if dirpath == top:
            dirnames[:] = [d for d in dirnames if d not in skip]
            filenames = [f for f in filenames if f not in skip]
        for name in dirnames + filenames:
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            digest = ""
            if stat.S_ISREG(st.st_mode) and st.st_size <= 1 << 20:
                with open(p, "rb") as f:
                    digest = hashlib.sha1(f.read()).hexdigest()
            out[os.path.relpath(p, root)] = (stat.S_IFMT(st.st_mode), st.st_size, st.st_mtime_ns, digest)
    return out
