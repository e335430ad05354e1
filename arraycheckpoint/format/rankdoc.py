"""Per-rank JSON documents as one rank-independent template plus numeric rows (format 4).

A per-rank object used to travel in every rank's commit status and sit in the metadata once per rank
(``per_rank: {rank: doc}``): ``<ns>/~per_rank`` (every rank's ``PerRank`` documents, see
:mod:`arraycheckpoint.stateful`; about 0.5 KB per rank for an RNG state, 5 MB at 10,000 ranks) and a
dataloader's shard index ``<ns>/~shards`` (:mod:`arraycheckpoint.data.checkpoint`; about 0.45 KB per rank).
The ranks' documents almost always share one structure and differ only in numbers, so each rank splits its
document (:func:`split`; a kind whose per-rank document names its rank first writes it rank-independently
and passes the per-rank one as the ``fallback`` of :func:`templated`) into

* a **template**: the document with every numeric leaf replaced by a placeholder ``{"__leaf__": "<k><i>"}``
  (``k``: ``i`` int, ``b`` bool, ``f`` float; ``i``: the leaf's index in its row) and every per-rank array
  reference naming the rank-independent stacked array (``<ns>/~rows/...``, :mod:`arraycheckpoint.format.perrank`)
  instead of ``<ns>/~r<rank>/...``. A reader takes row ``s`` of that array for saved rank ``s``; when it is
  not stored (the ranks' rows disagreed, or the array could not be stacked: a DTensor shard, an empty array)
  it reads rank ``s`` 's own array ``<ns>/~r<s>/...`` instead (:func:`arraycheckpoint.format.perrank.resolve`).
  Strings, ``None``, ints beyond int64 and everything else stay in the template;
* two **rows**: the ints and bools as int64, the floats as float64 (their exact bits: NaN, -0.0, inf and
  subnormals come back bit for bit). They are saved as rows of the stacked arrays ``<object>/~int`` ``[N,
  k_int]`` and ``<object>/~float`` ``[N, k_float]`` through the ordinary stacked-row path (the data plane
  writes them like any other rows; a kind without leaves has no array).

**Agreement.** The digest of every template (:func:`template_digest`) joins the save's fixed-size agreement
(:meth:`arraycheckpoint.engine.coordinate.Coordinator.agree`). When all ranks agree, the commit statuses carry
no per-rank document and the coordinator stores its own template once: ``{"scope": "rank", "template": T,
"rows": {"int": name, "float": name}}``. When any rank differs (a different key, a big int that differs, an
array reference that names no per-rank array of this namespace), every rank saves the per-rank form instead
(:func:`fall_back`): the object's ``fallback`` and no rows. Nothing hangs: every rank takes the
same decision from the same all-reduce.

**Load.** Saved rank ``s`` 's document is the template with row ``s`` of each row array put back
(:func:`join`); the per-rank rule (own row, else ``source_rank`` and ``derive``) is unchanged, the saved ranks
being ``0 .. world_size - 1``. :func:`read_rows` plans reading one rank's row (a ``PerRank`` value) or every
rank's (a dataloader, which sees every saved shard); :func:`documents` gives every saved rank's document in
either form.

Pure: no I/O, no communication.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..planning.items import ArraySource, LoadShard, LoadTensor, SaveObject, SaveShard, SaveTensor
from ..planning.regions import Box
from ..planning.rules import digest
from .perrank import fill, row, stack

LEAF = "__leaf__"
#: row kind -> (numpy dtype, the placeholder letters stored in it)
KINDS = {"int": (np.dtype("<i8"), "ib"), "float": (np.dtype("<f8"), "f")}
_INT64 = (-(2**63), 2**63 - 1)


def row_names(name: str) -> dict[str, str]:
    """The stacked arrays holding object ``name``'s numeric leaves, by kind."""
    return {kind: f"{name}/~{kind}" for kind in KINDS}


def split(doc: Any) -> tuple[Any, list[int], list[float]]:
    """``(template, ints, floats)`` of a JSON document (as :func:`arraycheckpoint.format.extras.encode` makes it).

    Bools and ints within int64 go to ``ints``, floats (also the ``{"__float__": "nan"}`` tags of non-finite
    ones) to ``floats``; the template holds a placeholder for each. :func:`join` is the exact inverse.
    """
    ints: list[int] = []
    floats: list[float] = []

    def leaf(letter: str, row: list[Any], value: Any) -> dict[str, str]:
        row.append(value)
        return {LEAF: f"{letter}{len(row) - 1}"}

    def walk(v: Any) -> Any:
        if isinstance(v, bool):
            return leaf("b", ints, v)
        if isinstance(v, int):
            return leaf("i", ints, v) if _INT64[0] <= v <= _INT64[1] else v
        if isinstance(v, float):
            return leaf("f", floats, v)
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            if len(v) == 1 and isinstance(v.get("__float__"), str):
                return leaf("f", floats, float(v["__float__"]))
            return {k: walk(x) for k, x in v.items()}
        return v

    return walk(doc), ints, floats


def join(template: Any, ints: Sequence[Any], floats: Sequence[Any]) -> Any:
    """The document :func:`split` made ``template`` from, with its leaves taken from ``ints`` and ``floats``
    (sequences or 1-d arrays). Raises ValueError for a placeholder outside its row."""
    rows = {"i": ints, "b": ints, "f": floats}
    cast = {"i": int, "b": bool, "f": float}

    def walk(v: Any) -> Any:
        if isinstance(v, list):
            return [walk(x) for x in v]
        if isinstance(v, dict):
            if len(v) == 1 and LEAF in v:
                letter, index = _placeholder(v[LEAF])
                if index >= len(rows[letter]):
                    raise ValueError(f"leaf {v[LEAF]!r} lies outside its row of {len(rows[letter])}")
                return cast[letter](rows[letter][index])
            return {k: walk(x) for k, x in v.items()}
        return v

    return walk(template)


def _placeholder(body: Any) -> tuple[str, int]:
    if not isinstance(body, str) or len(body) < 2 or body[0] not in "ibf" or not body[1:].isdigit():
        raise ValueError(f"malformed leaf placeholder {body!r}")
    return body[0], int(body[1:])


def leaf_counts(template: Any) -> dict[str, int]:
    """The row length each kind needs: one past the highest placeholder index (ValueError if malformed)."""
    counts = {"int": 0, "float": 0}
    todo: list[Any] = [template]
    while todo:
        v = todo.pop()
        if isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, dict):
            if len(v) == 1 and LEAF in v:
                letter, index = _placeholder(v[LEAF])
                kind = "float" if letter == "f" else "int"
                counts[kind] = max(counts[kind], index + 1)
            else:
                todo.extend(v.values())
    return counts


def templated(
    per_rank: SaveObject,
    stacked: Mapping[str, str],
    rank: int,
    world: int,
    fallback: SaveObject | None = None,
) -> list[Any]:
    """``[template object, *row tensors]`` for this rank's per-rank object ``per_rank``.

    ``stacked`` maps this rank's per-rank array names to their stacked names (other references keep their
    names). The object keeps ``fallback`` (default ``per_rank``: a kind whose per-rank form is another
    document, like the dataloader's shard index, passes that one) as what every rank saves when the templates
    disagree; each row tensor is row ``rank`` of a ``[world, k]`` array.
    """
    value = _rename(per_rank.value, stacked)
    template, ints, floats = split(value)
    names = row_names(per_rank.name)
    rows: dict[str, str] = {}
    tensors: list[SaveTensor] = []
    for kind, leaves in (("int", ints), ("float", floats)):
        if not leaves:
            continue
        a = np.asarray(leaves, dtype=KINDS[kind][0])
        t = SaveTensor(names[kind], a.shape, a.dtype, [SaveShard(Box.full(a.shape), ArraySource(a))])
        tensors.append(dataclasses.replace(stack(t, names[kind], rank, world), fallback=None))
        rows[kind] = names[kind]
    obj = SaveObject(per_rank.name, template, scope="rank", rows=rows, fallback=fallback or per_rank)
    return [obj, *tensors]


def ambiguous(doc: Any) -> bool:
    """Whether raw JSON ``doc`` (not encoded by :mod:`arraycheckpoint.format.extras`, which escapes them) holds a
    one-key dict that :func:`split` would read as a leaf (``__leaf__``, ``__float__``): such a document must
    stay in per-rank form to come back unchanged."""
    todo: list[Any] = [doc]
    while todo:
        v = todo.pop()
        if isinstance(v, (list, tuple)):
            todo.extend(v)
        elif isinstance(v, dict):
            if len(v) == 1 and (LEAF in v or "__float__" in v):
                return True
            todo.extend(v.values())
    return False


def _rename(doc: Any, names: Mapping[str, str]) -> Any:
    """``doc`` with array references (and the ``arrays`` kinds' keys) renamed by ``names``."""
    if isinstance(doc, list):
        return [_rename(x, names) for x in doc]
    if isinstance(doc, dict):
        if len(doc) == 1 and isinstance(doc.get("__array__"), str):
            return {"__array__": names.get(doc["__array__"], doc["__array__"])}
        return {names.get(k, k): _rename(x, names) for k, x in doc.items()}
    return doc


def template_digest(objects: Sequence[SaveObject]) -> bytes:
    """16 bytes equal on ranks whose template objects agree (names, templates and rows, in order)."""
    return digest([[o.name, o.value, o.rows] for o in objects if o.rows is not None])


def fall_back(
    tensors: list[SaveTensor], objects: list[SaveObject]
) -> tuple[list[SaveTensor], list[SaveObject]]:
    """The request's tensors and objects with every template replaced by its per-rank object and its rows
    dropped (the ranks' templates disagree)."""
    rows = {n for o in objects if o.rows is not None for n in o.rows.values()}
    plain = [o.fallback if o.rows is not None and o.fallback is not None else o for o in objects]
    return [t for t in tensors if t.name not in rows], plain


def check(template: Any, rows: Any, tensors: Mapping[str, Any], world: int) -> str | None:
    """Why a stored template object is malformed (None when valid): ``rows`` must map kinds to stacked
    arrays ``[world, k]`` of the kind's dtype, ``k`` exactly the template's placeholders of that kind (a
    reader sizes its row buffers from that shape: a hostile width is refused before anything is allocated)."""
    if not isinstance(rows, dict) or not set(rows) <= set(KINDS):
        return f"rows must map some of {sorted(KINDS)} to array names"
    try:
        counts = leaf_counts(template)
    except ValueError as e:
        return str(e)
    for kind, need in counts.items():
        name = rows.get(kind)
        if name is None:
            if need:
                return f"the template has {kind} leaves but no {kind} row"
            continue
        tm = tensors.get(name) if isinstance(name, str) else None
        dtype = KINDS[kind][0]
        if tm is None or not tm.rank_rows or len(tm.shape) != 2 or tm.dtype != dtype.name:
            return f"rows[{kind!r}] must name a stored [{world}, k] {dtype.name} array of rank rows"
        if tm.shape[1] != need:  # exactly: a reader sizes its row buffers from this shape
            return f"rows[{kind!r}] holds {tm.shape[1]} leaves per rank, the template has {need}"
    return None


def saved_ranks(obj: Any, world: int) -> Sequence[int]:
    """The saved ranks of a per-rank object, sorted (every rank of the world for a template object: a range,
    not a list of the world)."""
    return range(world) if obj.rows is not None else sorted(obj.per_rank)


def read_rows(
    obj: Any, meta: Any, source: int | None = None
) -> tuple[list[LoadTensor], dict[str, np.ndarray], dict[str, Any]]:
    """What reading template object ``obj``'s rows takes: ``(targets, buffers by kind, TensorMeta by stored
    name)``. A buffer holds saved rank ``source``'s leaves (``[k]``) or, with ``source`` None, every saved
    rank's (``[world, k]``: a reader that needs every rank's document, like a dataloader planning its
    resharding). Raises ValueError when a row is not stored. Plans only; the caller reads."""
    targets: list[LoadTensor] = []
    bufs: dict[str, np.ndarray] = {}
    stored: dict[str, Any] = {}
    for kind, name in (obj.rows or {}).items():
        found = row(meta, name, 0 if source is None else source)
        if found is None:
            at = "" if source is None else f" of rank {source}"
            raise ValueError(f"{obj.name}: the {kind} row{at} ({name!r}) is not stored")
        tm, box = found
        if source is None:  # every rank's row
            box = Box.full(tm.shape)
        bufs[kind] = buf = np.empty(box.lengths if source is None else tm.shape[1:], dtype=KINDS[kind][0])
        stored[name] = tm
        if buf.size:
            targets.append(LoadTensor(name, [LoadShard(box, fill(buf))]))
    return targets, bufs, stored


def documents(obj: Any, rows: Mapping[str, np.ndarray], world: int) -> dict[int, Any]:
    """Every saved rank's document of per-rank object ``obj``: its ``per_rank`` values, or for a template
    object the template joined with each rank's row of ``rows`` (kind -> ``[world, k]``, as :func:`read_rows`
    with no source fills them)."""
    if obj.rows is None:
        return dict(obj.per_rank)
    empty = np.empty((world, 0))
    ints, floats = rows.get("int", empty), rows.get("float", empty)
    return {s: join(obj.template, ints[s], floats[s]) for s in range(world)}
