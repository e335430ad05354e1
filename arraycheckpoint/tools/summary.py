"""``arraycheckpoint inspect``: what a checkpoint holds and how it was sharded when saved."""

from __future__ import annotations

import math
from typing import Any

from .common import Checkpoint, human_bytes, jsonable


def summarize(ckpt: Checkpoint) -> dict[str, Any]:
    """A JSON-able summary: per-tensor rows, totals per namespace, topology, roles, step, versions.

    Each tensor row has ``name, dtype, shape, bytes, regions`` (saved regions), ``ranks`` (distinct ranks that
    held a region), ``chunks`` (stored chunks), ``chunk_shape`` and ``pack``: the pack file holding the array
    (format 5, a key relative to the checkpoint root), or None for an array in its own directory. ``source``
    is the kind of a foreign checkpoint (``"safetensors"``, ``"dcp"``; its ``committed`` is None: such a
    checkpoint has no commit marker), None for an arraycheckpoint checkpoint.
    """
    meta = ckpt.meta
    # a foreign checkpoint (Hugging Face safetensors, DCP) opens as its load source: it has no commit marker
    source = getattr(ckpt.storage, "kind", None) if not hasattr(ckpt.storage, "is_committed") else None
    rows = []
    per_ns: dict[str, dict[str, int]] = {}
    for name, tm in sorted(meta.tensors.items()):
        chunks = math.prod(math.ceil(s / c) for s, c in zip(tm.shape, tm.chunk_shape)) if all(tm.shape) else 0
        rows.append(
            {
                "name": name,
                "dtype": tm.dtype,
                "shape": list(tm.shape),
                "bytes": tm.nbytes,
                "regions": len(tm.shards),
                "ranks": len({s.rank for s in tm.shards}),
                "chunks": chunks,
                "chunk_shape": list(tm.chunk_shape),
                "compression": tm.compression,
                "pack": tm.pack,
            }
        )
        ns = name.split("/", 1)[0]
        acc = per_ns.setdefault(ns, {"tensors": 0, "bytes": 0})
        acc["tensors"] += 1
        acc["bytes"] += tm.nbytes
    return jsonable(
        {
            "path": ckpt.root,
            "committed": None if source is not None else ckpt.storage.is_committed(ckpt.root),
            "source": source,
            "format_version": meta.format_version,
            "library_version": meta.library_version,
            "framework": meta.framework,
            "world_size": meta.world_size,
            "step": meta.step,
            "topology": dict(meta.topology),
            "roles": list(meta.roles),
            "tensors": rows,
            "objects": sorted(meta.objects),
            "totals": {
                "tensors": len(rows),
                "bytes": sum(r["bytes"] for r in rows),
                "objects": len(meta.objects),
                "packed": sum(1 for r in rows if r["pack"] is not None),
                # format 5: pack files; format 6: the ranks whose packs hold packed chunks or documents
                "packs": len({r["pack"] for r in rows} - {None})
                if meta.format_version < 6
                else len(_pack_ranks(meta)),
                "namespaces": per_ns,
            },
        }
    )


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable table of :func:`summarize`'s result."""
    lines = [
        f"checkpoint  {s['path']}",
        f"format      version {s['format_version']} (written by arraycheckpoint {s['library_version'] or '?'})"
        if not s.get("source")
        else f"format      {s['source']} (a foreign checkpoint, read as acp.load reads it)",
        f"framework   {s['framework']}   step {s['step']}   saved by {s['world_size']} rank(s)",
        f"topology    {_kv(s['topology'])}",
        f"roles       {', '.join(s['roles']) or '-'}",
        "",
    ]
    header = ("name", "dtype", "shape", "bytes", "regions", "ranks", "chunks", "stored in")
    table = [header] + [
        (
            r["name"],
            r["dtype"],
            "x".join(map(str, r["shape"])) or "scalar",
            human_bytes(r["bytes"]),
            str(r["regions"]),
            str(r["ranks"]),
            str(r["chunks"]),
            s.get("source") or _stored_in(r.get("pack")),
        )
        for r in s["tensors"]
    ]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    for i, row in enumerate(table):
        cells = (
            [row[0].ljust(widths[0]), row[1].ljust(widths[1])]
            + [c.rjust(w) for c, w in zip(row[2:-1], widths[2:-1])]
            + [row[-1]]
        )
        lines.append("  ".join(cells).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    t = s["totals"]
    rows = [(f"  {ns}", acc["tensors"], acc["bytes"]) for ns, acc in sorted(t["namespaces"].items())]
    rows.append(("total", t["tensors"], t["bytes"]))
    label_w = max(len(r[0]) for r in rows)
    count_w = max(len(str(r[1])) for r in rows)
    size_w = max(len(human_bytes(r[2])) for r in rows)
    lines.append("")
    for label, count, nbytes in rows:
        line = f"{label:<{label_w}}  {count:>{count_w}} tensors  {human_bytes(nbytes):>{size_w}}"
        if label == "total":
            line += f"  ({nbytes} bytes), {t['objects']} JSON objects"
            if t.get("packs"):
                where = "pack file(s)" if s["format_version"] < 6 else "ranks' packs"
                line += f"; {t['packed']} tensors packed (chunk files below the target size) in {t['packs']} {where}"
        lines.append(line)
    return "\n".join(lines)


def _stored_in(pack: str | None) -> str:
    """Where a tensor's array is, for the table: its directory, or its pack (format 5), or the packs of its
    writers (format 6: ``.acp/packs/<creator>``)."""
    return "dir" if pack is None else pack


def _kv(d: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v}" for k, v in d.items()) or "-"


def _pack_ranks(meta: Any) -> set[int]:
    """Format 6: the ranks whose packs hold packed chunks or documents (writers counted at once, not one by one:
    an array may have 2^26 derived writers)."""
    import numpy as np

    ranks: set[int] = set()
    for t in meta.tensors.values():
        if t.pack_rank is None:
            continue
        ranks.add(int(t.pack_rank))
        writers = np.asarray(getattr(t.writers, "array", t.writers), dtype=np.int64)
        if len(writers):
            ranks.update(np.flatnonzero(np.bincount(writers)).tolist())
    return ranks
