"""``arraycheckpoint diff``: compare two checkpoints tensor by tensor, whatever layouts saved them.

Both sides are read through the engine as global tensors, in blocks of whole rows (small tensors in batches of
whole tensors, one read per batch: the members of a pack are read together), so memory stays bounded by the
block size. Equality is bitwise (NaNs with equal bits are equal, ``-0.0 != 0.0``); the maximum absolute
difference is reported for numeric tensors. JSON objects are compared for equality too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import ArrayCheckpointError
from ..format import rankdoc
from ..planning.regions import Box
from .common import BLOCK_BYTES, Checkpoint, read_boxes, row_blocks


@dataclass
class TensorDiff:
    """One tensor's comparison. ``status``: equal, different, only_a, only_b, shape, dtype."""

    name: str
    status: str
    max_abs_diff: float | None = None
    differing: int = 0
    detail: str = ""


@dataclass
class DiffReport:
    """All differences of :func:`diff_checkpoints`; ``same`` when there are none."""

    tensors: list[TensorDiff] = field(default_factory=list)
    objects: list[str] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return not self.objects and all(t.status == "equal" for t in self.tensors)


def _numeric(arr: np.ndarray) -> np.ndarray | None:
    if arr.dtype.kind in "biufc":
        return arr.astype(np.complex128 if arr.dtype.kind == "c" else np.float64)
    try:
        return arr.astype(np.float64)  # bfloat16 / float8 (ml_dtypes)
    except (TypeError, ValueError):
        return None


@dataclass
class _Tally:
    """What the blocks of one tensor compared so far differ in."""

    bitwise: bool = True
    differing: int = 0
    max_diff: float = 0.0

    def add(self, x: np.ndarray, y: np.ndarray) -> None:
        """Compare one block (the same region of both sides)."""
        x, y = np.asarray(x), np.asarray(y)
        if x.size == 0:
            return
        xb = np.ascontiguousarray(x).reshape(-1).view(np.uint8).reshape(x.size, -1)
        yb = np.ascontiguousarray(y).reshape(-1).view(np.uint8).reshape(y.size, -1)
        neq = np.any(xb != yb, axis=1)
        n = int(neq.sum())
        if n:
            self.bitwise = False
            self.differing += n
            xn, yn = _numeric(x), _numeric(y)
            if xn is not None and yn is not None:
                with np.errstate(invalid="ignore", over="ignore"):  # inf - inf: NaN, counted as inf below
                    d = np.abs(xn - yn).reshape(-1)[neq]
                # NaN against a number (or NaNs with different bits) counts as an infinite difference
                self.max_diff = max(self.max_diff, float(np.max(np.where(np.isnan(d), np.inf, d))))

    def result(self, name: str, atol: float) -> TensorDiff:
        if self.bitwise:
            return TensorDiff(name, "equal", 0.0)
        status = "equal" if atol > 0 and self.max_diff <= atol else "different"
        return TensorDiff(name, status, self.max_diff, self.differing, f"{self.differing} element(s) differ")


def _mismatch(a: Checkpoint, b: Checkpoint, name: str) -> TensorDiff | None:
    """The difference of ``name``'s shape or dtype between the sides (None when they agree)."""
    ta, tb = a.meta.tensors[name], b.meta.tensors[name]
    if ta.shape != tb.shape:
        return TensorDiff(name, "shape", detail=f"shape {list(ta.shape)} vs {list(tb.shape)}")
    if ta.dtype != tb.dtype:
        return TensorDiff(name, "dtype", detail=f"dtype {ta.dtype} vs {tb.dtype}")
    return None


def compare_tensor(
    a: Checkpoint, b: Checkpoint, name: str, atol: float = 0.0, block_bytes: int = BLOCK_BYTES
) -> TensorDiff:
    """Compare tensor ``name`` present in both checkpoints."""
    mismatch = _mismatch(a, b, name)
    if mismatch is not None:
        return mismatch
    tally = _Tally()
    for box in row_blocks(a.meta.tensors[name], block_bytes):
        tally.add(read_boxes(a, [(name, box)])[(name, box)], read_boxes(b, [(name, box)])[(name, box)])
    return tally.result(name, atol)


def compare_small_tensors(
    a: Checkpoint, b: Checkpoint, names: Sequence[str], atol: float = 0.0
) -> dict[str, TensorDiff]:
    """Compare whole tensors ``names`` (of the same shape and dtype on both sides) with one read per side.

    Small arrays are often members of one pack (format 5): reading them together opens and checks each
    pack once per batch rather than once per tensor.
    """
    requests = [(n, Box.full(a.meta.tensors[n].shape)) for n in names]
    xs, ys = read_boxes(a, requests), read_boxes(b, requests)
    out = {}
    for name, box in requests:
        tally = _Tally()
        tally.add(xs[(name, box)], ys[(name, box)])
        out[name] = tally.result(name, atol)
    return out


def diff_checkpoints(
    a: Checkpoint,
    b: Checkpoint,
    atol: float = 0.0,
    progress: Callable[[int], None] | None = None,
    namespaces: Sequence[str] | None = None,
    objects: bool = True,
    block_bytes: int = BLOCK_BYTES,
) -> DiffReport:
    """Compare every tensor and object of ``a`` and ``b``.

    Args:
        atol: accept numeric differences up to ``atol`` (default 0: bit-exact).
        progress: called with the byte count of each batch of compared tensors.
        namespaces: compare only entries in these top-level namespaces (``model``, ``optimizer``, ...).
        objects: compare JSON objects too (``False``: tensors only).
        block_bytes: bytes read at once per side: a larger tensor is compared in blocks of rows, smaller
            ones in batches of whole tensors up to this size.
    """
    report = DiffReport()
    if namespaces is not None:
        held_ns = {n.split("/", 1)[0] for m in (a.meta, b.meta) for n in (*m.tensors, *m.objects)}
        unknown = sorted(set(namespaces) - held_ns)
        if unknown:  # a typo (``--namespace modle``) compared nothing and said "identical"
            raise ArrayCheckpointError(
                f"namespace(s) {', '.join(map(repr, unknown))} in neither checkpoint; they hold "
                f"{', '.join(sorted(held_ns)) or 'nothing'}"
            )

    def wanted(name: str) -> bool:
        return namespaces is None or name.split("/", 1)[0] in namespaces

    results: dict[str, TensorDiff] = {}
    batch: list[str] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if batch:
            results.update(compare_small_tensors(a, b, batch, atol))
            if progress is not None:
                progress(held)
        batch.clear()
        held = 0

    for name in sorted(n for n in set(a.meta.tensors) | set(b.meta.tensors) if wanted(n)):
        if name not in b.meta.tensors:
            results[name] = TensorDiff(name, "only_a")
        elif name not in a.meta.tensors:
            results[name] = TensorDiff(name, "only_b")
        elif (mismatch := _mismatch(a, b, name)) is not None:
            results[name] = mismatch
            if progress is not None:
                progress(a.meta.tensors[name].nbytes)
        elif a.meta.tensors[name].nbytes > block_bytes:
            results[name] = compare_tensor(a, b, name, atol, block_bytes)
            if progress is not None:
                progress(a.meta.tensors[name].nbytes)
        else:
            if held + a.meta.tensors[name].nbytes > block_bytes:
                flush()
            batch.append(name)
            held += a.meta.tensors[name].nbytes
    flush()
    report.tensors.extend(results[n] for n in sorted(results))
    for name in sorted(n for n in set(a.meta.objects) | set(b.meta.objects) if objects and wanted(n)):
        oa, ob = a.meta.objects.get(name), b.meta.objects.get(name)
        if oa is None or ob is None:
            report.objects.append(f"{name}: only in {'B' if oa is None else 'A'}")
        elif _object_key(oa) != _object_key(ob):
            if oa.scope == ob.scope == "rank" and _ranks(a.meta, oa) != _ranks(b.meta, ob):
                continue  # per-rank values of saves at different world sizes are not comparable
            report.objects.append(f"{name}: values differ")
    return report


def _object_key(o: Any) -> tuple[Any, ...]:
    """What makes two objects equal (a template's numeric leaves are its rows: compared as tensors)."""
    return (o.scope, o.value, dict(o.per_rank), o.template, None if o.rows is None else dict(o.rows))


def _ranks(meta: Any, o: Any) -> int:
    return len(rankdoc.saved_ranks(o, meta.world_size))
