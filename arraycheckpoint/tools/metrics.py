"""``arraycheckpoint metrics``: per-rank, per-phase timings the engine recorded during the save.

The engine stores each rank's :class:`~arraycheckpoint.runtime.monitoring.PhaseRecorder` record in the metadata under
``metrics["save"][str(rank)] = {"wall_start": ..., "phases": [{"phase", "start", "seconds", "bytes"}]}``.
This module turns it into a rank-by-phase table and draws a heat-map (seconds per rank and phase, annotated)
plus a per-rank timeline on one wall clock (matplotlib, Agg backend; install the ``plot`` extra).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any

from ..checks.bounds import MAX_METADATA_BYTES, load_json_bounded
from ..errors import ArrayCheckpointError, CorruptCheckpointError, MetadataError
from ..format.metadata import CheckpointMetadata
from ..storage import Storage
from .common import human_bytes

#: The order phases are shown in (others follow alphabetically).
PHASE_ORDER = ("snapshot", "plan", "exchange", "write", "flush", "commit", "read")


@dataclass
class PhaseTable:
    """Seconds and bytes per (rank, phase), and each rank's timeline on a shared clock."""

    kind: str
    ranks: list[int]
    phases: list[str]
    seconds: list[list[float]]  # [rank][phase]
    bytes: list[list[int]]
    #: rank -> [(phase, start seconds on the shared clock, duration seconds)]
    timeline: dict[int, list[tuple[str, float, float]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "ranks": self.ranks,
            "phases": self.phases,
            "seconds": self.seconds,
            "bytes": self.bytes,
            "timeline": {str(r): [list(x) for x in v] for r, v in self.timeline.items()},
        }


def recorded_metrics(storage: Storage, root: str, meta: CheckpointMetadata) -> dict[str, Any]:
    """Every record of a checkpoint: the metadata's, the complete save record of the ``.acp/metrics.json``
    sidecar (it adds the coordinator's commit phase) and the last opt-in load record
    (``.acp/metrics-load.json``; both in the root for a checkpoint of format 1 or 2).

    The sidecars are checkpoint input like the rest (DESIGN invariant 10): read as regular files only (no
    link, no FIFO), at most :data:`~arraycheckpoint.checks.bounds.MAX_METADATA_BYTES`, nested at most
    :data:`~arraycheckpoint.checks.bounds.MAX_JSON_DEPTH` deep.

    Raises:
        MetadataError: a sidecar that is a link or not a regular file, too large, too deep, not JSON or not
            a JSON object (the message names its path).
    """
    out: dict[str, Any] = dict(meta.metrics)
    files = storage.control_files(root)
    for key in (files.metrics, files.load_metrics):
        where = f"metrics file {root.rstrip('/')}/{key}"
        try:
            raw = storage.read(root, key)
        except MetadataError:
            raise
        except CorruptCheckpointError as e:  # a link or a non-regular file
            raise MetadataError(f"{where} was refused: {e}") from None
        if not raw:
            continue
        doc = load_json_bounded(raw, max_bytes=MAX_METADATA_BYTES, what=where)
        if not isinstance(doc, dict):
            raise MetadataError(f"{where} is not a JSON object; the checkpoint is damaged")
        out.update({k: v for k, v in doc.items() if isinstance(v, dict)})
    return out


KINDS = ("save", "load")


def phase_table(meta: CheckpointMetadata | dict[str, Any], kind: str = "save") -> PhaseTable:
    """Build the table from the records of ``kind`` (``meta.metrics`` or :func:`recorded_metrics`'s result);
    raises ``KeyError`` when nothing was recorded."""
    metrics = meta.metrics if isinstance(meta, CheckpointMetadata) else meta
    records = metrics.get(kind)
    if kind not in KINDS:
        raise KeyError(f"unknown metrics kind {kind!r}: use one of {', '.join(KINDS)}")
    if not isinstance(records, dict) or not records:
        raise KeyError(f"the checkpoint holds no {kind!r} metrics (recorded: {sorted(metrics) or 'none'})")
    checked = _checked_records(records, kind)
    ranks = sorted(checked)
    seen: set[str] = set()
    for r in ranks:
        seen.update(p[0] for p in checked[r][1])
    if len(seen) > MAX_PHASES:
        raise MetadataError(
            f"the {kind!r} metrics name {len(seen)} distinct phases (at most {MAX_PHASES}); the record is damaged"
        )
    phases = [p for p in PHASE_ORDER if p in seen] + sorted(seen - set(PHASE_ORDER))
    walls = [checked[r][0] for r in ranks]
    t0 = min(walls) if walls else 0.0
    seconds, nbytes, timeline = [], [], {}
    for r, wall in zip(ranks, walls):
        row_s = dict.fromkeys(phases, 0.0)
        row_b = dict.fromkeys(phases, 0)
        spans = []
        for phase, start, secs, moved in checked[r][1]:
            row_s[phase] += secs
            row_b[phase] += moved
            spans.append((phase, wall - t0 + start, secs))
        seconds.append([row_s[p] for p in phases])
        nbytes.append([row_b[p] for p in phases])
        timeline[r] = spans
    return PhaseTable(kind, ranks, phases, seconds, nbytes, timeline)


#: distinct phase names a table may have (the engine records fewer than ten)
MAX_PHASES = 256

_Record = tuple[float, list[tuple[str, float, float, int]]]


def _checked_records(records: dict[Any, Any], kind: str) -> dict[int, _Record]:
    """``records`` (rank -> record, as the engine writes them) with every field checked: a rank key is a
    canonical decimal number, a record an object whose ``wall_start`` is a finite number and whose
    ``phases`` a list of objects with a string ``phase``, finite ``start``/``seconds`` and an integer
    ``bytes`` >= 0 (each optional but ``phase``). Raises :class:`MetadataError` naming the record."""
    out: dict[int, _Record] = {}
    for key, record in records.items():
        where = f"{kind!r} metrics record {key!r}"
        if not (isinstance(key, str) and key.isdecimal() and key.isascii() and str(int(key)) == key):
            raise MetadataError(f"{where}: the key is not a rank number; the record is damaged")
        if not isinstance(record, dict):
            raise MetadataError(f"{where} is not a JSON object; the record is damaged")
        phases = record.get("phases", [])
        if not isinstance(phases, list):
            raise MetadataError(f"{where}: 'phases' is not a list; the record is damaged")
        spans = []
        for i, p in enumerate(phases):
            if not isinstance(p, dict) or not isinstance(p.get("phase"), str):
                raise MetadataError(f"{where}: phase {i} is not an object with a string 'phase'")
            spans.append(
                (
                    p["phase"],
                    _number(p.get("start", 0.0), f"{where}, phase {i}: 'start'"),
                    _number(p.get("seconds", 0.0), f"{where}, phase {i}: 'seconds'"),
                    _count(p.get("bytes", 0), f"{where}, phase {i}: 'bytes'"),
                )
            )
        out[int(key)] = (_number(record.get("wall_start", 0.0), f"{where}: 'wall_start'"), spans)
    return out


def _number(value: Any, where: str) -> float:
    """``value`` as a finite float, else :class:`MetadataError` naming ``where``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and abs(value) < 1e300:
        return float(value)
    raise MetadataError(f"{where} is {value!r}, not a finite number; the record is damaged")


def _count(value: Any, where: str) -> int:
    """``value`` as a byte count (a number in [0, 2^63), truncated), else :class:`MetadataError` naming ``where``."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value < 1 << 63:
        return int(value)
    raise MetadataError(f"{where} is {value!r}, not a byte count; the record is damaged")


def format_table(t: PhaseTable) -> str:
    """Rank-by-phase seconds (and the bytes each rank moved per phase), plus per-phase max/mean."""
    head = ["rank", *t.phases, "total"]
    rows = [head]
    for r, secs in zip(t.ranks, t.seconds):
        rows.append([str(r), *(f"{s:.4f}" for s in secs), f"{sum(secs):.4f}"])
    n = len(t.ranks)
    cols = list(zip(*t.seconds)) if t.seconds else []
    rows.append(["max", *(f"{max(c):.4f}" for c in cols), ""])
    rows.append(["mean", *(f"{sum(c) / n:.4f}" for c in cols), ""])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = [f"{t.kind} phases, seconds per rank"]
    for i, r in enumerate(rows):
        lines.append("  ".join(c.rjust(w) for c, w in zip(r, widths)))
        if i == 0 or i == n:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("")
    lines.append("bytes moved per rank and phase")
    for r, byts in zip(t.ranks, t.bytes):
        moved = ", ".join(f"{p} {human_bytes(b)}" for p, b in zip(t.phases, byts) if b)
        lines.append(f"  rank {r}: {moved or '-'}")
    return "\n".join(lines)


# the engine's phases, each with its own tab10 colour; any other phase takes a colour from its name's hash
_PHASE_COLOURS = ("snapshot", "plan", "exchange", "write", "flush", "commit", "read", "read-shared")


def phase_color(phase: str) -> tuple[float, float, float, float]:
    """A phase's colour, fixed by its name (stable across pictures, whichever phases a picture shows)."""
    import zlib

    from matplotlib import colormaps

    if phase in _PHASE_COLOURS:
        return colormaps["tab10"](_PHASE_COLOURS.index(phase))
    return colormaps["tab20b"](zlib.crc32(phase.encode()) % 20)


def plot(t: PhaseTable, out: str | os.PathLike[str], title: str = "") -> str:
    """Draw the heat-map and the timeline into the image ``out`` (PNG, or the format its extension names:
    ``.svg``, ``.pdf``, ...); returns its path. The image is written under a temporary name beside ``out``
    and renamed onto it when complete (an interrupted plot leaves no partial file, a link at ``out`` is
    replaced, never written through). Raises :class:`ArrayCheckpointError` for a format matplotlib cannot
    write or a file that cannot be written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    out = os.fspath(out)
    ext = os.path.splitext(out)[1][1:].lower() or "png"
    formats = plt.figure().canvas.get_supported_filetypes()
    plt.close("all")
    if ext not in formats:
        raise ArrayCheckpointError(
            f"cannot plot into {out}: matplotlib writes no '{ext}' images; name a file ending in "
            f"{', '.join('.' + f for f in sorted(formats))}"
        )

    data = np.array(t.seconds, dtype=float) * 1000.0  # milliseconds read better at checkpoint scale
    n_ranks, n_phases = data.shape
    height = max(4.0, 1.2 + 0.45 * n_ranks) * 2
    fig, (ax_h, ax_t) = plt.subplots(
        2, 1, figsize=(max(9.0, 1.3 * n_phases + 3), height), gridspec_kw={"height_ratios": [1, 1]}
    )
    im = ax_h.imshow(data, aspect="auto", cmap="viridis")
    ax_h.set_xticks(range(n_phases), t.phases)
    ax_h.set_yticks(range(n_ranks), [f"rank {r}" for r in t.ranks])
    ax_h.set_title("time per rank and phase (ms; brighter = slower)")
    vmax = data.max() if data.size else 0.0
    for i in range(n_ranks):
        for j in range(n_phases):
            v = data[i, j]
            ax_h.text(
                j,
                i,
                f"{v:.1f}",
                ha="center",
                va="center",
                fontsize=9,
                color="black" if vmax and v > 0.6 * vmax else "white",
            )
    fig.colorbar(im, ax=ax_h, label="ms")

    color = {p: phase_color(p) for p in t.phases}
    for i, r in enumerate(t.ranks):
        for phase, start, dur in t.timeline.get(r, []):
            ax_t.broken_barh(
                [(start * 1000.0, max(dur * 1000.0, 1e-3))], (i - 0.4, 0.8), facecolors=color[phase]
            )
    ax_t.set_yticks(range(n_ranks), [f"rank {r}" for r in t.ranks])
    ax_t.invert_yaxis()
    ax_t.set_xlabel("ms since the first rank started")
    ax_t.set_title("timeline per rank")
    ax_t.grid(axis="x", alpha=0.3)
    handles = [plt.Rectangle((0, 0), 1, 1, color=color[p]) for p in t.phases]
    ax_t.legend(
        handles,
        t.phases,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18),
        ncol=min(len(t.phases), 7),
        frameon=False,
    )
    fig.suptitle(title or f"arraycheckpoint {t.kind}: {n_ranks} rank(s)")
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(out))
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(out)}.", suffix=".tmp", dir=directory)
    except OSError as e:
        plt.close(fig)
        raise ArrayCheckpointError(f"cannot write {out}: {e.strerror or e}") from None
    try:
        with open(fd, "wb") as f:
            fig.savefig(f, dpi=110, format=ext)
            mask = os.umask(0)
            os.umask(mask)
            os.fchmod(f.fileno(), 0o666 & ~mask)  # mkstemp makes 0600; through the descriptor
        os.replace(tmp, out)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        if isinstance(e, OSError):
            raise ArrayCheckpointError(f"cannot write {out}: {e.strerror or e}") from None
        raise
    finally:
        plt.close(fig)
    return out
