"""Extra state of the torch adapter: any namespace that is not a module, an optimizer or a state dict.

Nested values are stored as JSON plus arrays (see :mod:`arraycheckpoint.format.extras`). Tensors and DTensors in
them are saved in their own layout and loaded in place, so an EMA dict of DTensors reshards like the
parameters. Modules nested at any depth (``{"ema": {"m": module}}``) are namespaces of their own: the
document holds ``{"__module__": name}`` and the adapter stores the module's tensors under ``name`` exactly
as it stores ``model``'s. Format-internal objects beside the document:

* ``<ns>/~arrays``: ``{array name: "numpy"}`` for arrays that were numpy arrays (they come back as numpy
  unless a torch tensor at their place in the target is filled in place);

A numpy array in the target (of the stored shape and dtype, writable) is filled in place and comes back as
numpy, whichever kind of array was saved; a tensor target is filled in place and stays a tensor.
* ``<ns>/~modules``: the names of the nested modules (a ``__module__`` document not listed there is a
  user dict of an older checkpoint).

This module plans only; it does no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, MutableMapping
from typing import Any

import numpy as np
import torch

from ...errors import MetaDeviceError
from ...format import extras
from ...format.metadata import CheckpointMetadata
from ...planning.items import LoadShard, LoadTensor, SaveObject
from ...planning.regions import Box
from ..base import AdapterOptions, Expected
from .common import array_dtype, dtype_name, fill, np_dtype, tensor_item
from .tensors import as_torch, is_dtensor, layout, load_shard

ARRAY_TYPES = "~arrays"  # <ns>/~arrays: {array name: "numpy"} for arrays that were not torch tensors
MODULES = "~modules"  # <ns>/~modules: [name of each module nested in the namespace]
DCP_MAP = "~dcp"  # acp.dcp.Writer's key map (arraycheckpoint.dcp.DCP_OBJECT; not imported: dcp sits above)


def is_array(v: Any) -> bool:
    """A leaf stored as an array: a torch tensor (DTensors included) or a numpy array."""
    return isinstance(v, (torch.Tensor, np.ndarray))


def is_module(v: Any) -> bool:
    """A value stored as a namespace of its own."""
    return isinstance(v, torch.nn.Module)


def save_extra(
    ns: str,
    value: Any,
    tensors: list,
    objects: list,
    options: AdapterOptions,
    modules: dict[str, torch.nn.Module] | None = None,
) -> None:
    """Describe ``value`` stored as entry ``ns``; nested modules go to ``modules`` (name -> module) when given.

    Without ``modules`` a nested module is refused like any object JSON cannot hold (module extra state).
    """
    found: dict[str, Any] = {}
    doc, arrays = extras.encode(
        value, ns, is_array, options.allow_pickle, is_module if modules is not None else None, found
    )
    objects.append(SaveObject(ns, doc))
    tensors.extend(tensor_item(name, a) for name, a in arrays.items())
    numpy = {name: "numpy" for name, a in arrays.items() if isinstance(a, np.ndarray)}
    if numpy:
        objects.append(SaveObject(f"{ns}/{ARRAY_TYPES}", numpy))
    if found and modules is not None:
        objects.append(SaveObject(f"{ns}/{MODULES}", sorted(found)))
        modules.update(found)


def nested_modules(meta: CheckpointMetadata, ns: str, value: Any) -> dict[str, torch.nn.Module]:
    """``{stored name: target module}`` for the modules of ``value`` stored as nested namespaces of ``ns``."""
    obj = meta.objects.get(ns)
    listed = _listed(meta, ns)
    if obj is None or not listed:
        return {}
    return {
        name: v
        for name, v in _targets(obj.value, value, "__module__").items()
        if name in listed and is_module(v)
    }


def stored_document(meta: CheckpointMetadata, ns: str, used: list[str] | None = None) -> Any:
    """The stored document of namespace ``ns``, or None when nothing is stored under it; the objects a
    rebuilt document takes its non-tensor values from are appended to ``used``.

    :func:`arraycheckpoint.save` stores one (``{"__array__": name}`` for a bare tensor). ``dcp.save``
    through :class:`arraycheckpoint.dcp.Writer` stores none: the tensors DCP's flattened keys put under
    ``ns`` (``rows``; ``m.w`` with path ``["m", "w"]``) are the document, rebuilt from the Writer's key map
    (``~dcp``: key -> stored name and path; every namespace's in one pass per checkpoint, see
    :func:`_writer_documents`). A path through a list (integer steps) is not rebuilt: the namespace then
    counts as missing, which a strict load reports.
    """
    obj = meta.objects.get(ns)
    if obj is not None:
        return obj.value
    document, objects = _writer_documents(meta).get(ns, (None, ()))
    if document is None and ns in meta.tensors:
        return {"__array__": ns}  # a tensor stored under the namespace's own name
    if used is not None:
        used.extend(objects)
    return document


#: the last rebuilt documents, keyed by the identity of the key-map object they came from (one per parsed load)
_WRITER_DOCS: list[tuple[object, dict[str, tuple[Any, tuple[str, ...]]]]] = []


def _writer_documents(meta: CheckpointMetadata) -> dict[str, tuple[Any, tuple[str, ...]]]:
    """``namespace -> (document, objects it takes values from)`` rebuilt from the Writer's key map; one pass
    over the map per checkpoint (a load asks once per namespace, and torchtitan's top-level FQNs are each a
    namespace), kept for the last key map asked about (not the whole metadata)."""
    dcp = meta.objects.get(DCP_MAP)
    if dcp is None:
        return {}
    if _WRITER_DOCS and _WRITER_DOCS[0][0] is dcp:
        return _WRITER_DOCS[0][1]
    keys = dcp.value.get("keys") if isinstance(dcp.value, dict) else None
    paths = dcp.value.get("paths") if keys is not None else None
    trees: dict[str, Any] = {}
    objects: dict[str, list[str]] = {}
    broken: set[str] = set()
    if not isinstance(keys, dict) or not isinstance(paths, dict):
        keys, paths = {}, {}
    for key, path in paths.items():
        stored = keys.get(key)  # untrusted JSON: anything
        if (
            not isinstance(stored, str)
            or not isinstance(path, list)
            or not path
            or not isinstance(path[0], str)
        ):
            continue
        ns = path[0]
        if ns in meta.objects:
            continue  # stored by acp.save: its own document
        if stored in meta.tensors:
            leaf: Any = {"__array__": stored}
        elif stored in meta.objects:
            leaf = meta.objects[stored].value  # a non-tensor value (the Writer stores each as an object)
            objects.setdefault(ns, []).append(stored)
        else:
            continue
        if not all(isinstance(p, str) for p in path):
            broken.add(ns)  # a list on the path: not rebuilt
            continue
        if len(path) == 1:
            if ns in trees:
                broken.add(ns)  # a value and a dict at one place: not a tree
            trees[ns] = leaf
            continue
        node = trees.setdefault(ns, {})
        if not isinstance(node, dict) or "__array__" in node:
            broken.add(ns)
            continue
        for step in path[1:-1]:
            node = node.setdefault(step, {})
            if not isinstance(node, dict) or "__array__" in node:
                broken.add(ns)
                break
        else:
            node[path[-1]] = leaf
    docs = {ns: (doc, tuple(objects.get(ns, ()))) for ns, doc in trees.items() if ns not in broken and doc}
    _WRITER_DOCS[:] = [(dcp, docs)]
    return docs


def _listed(meta: CheckpointMetadata, ns: str) -> set[str]:
    obj = meta.objects.get(f"{ns}/{MODULES}")
    return (
        {n for n in obj.value if isinstance(n, str)}
        if obj is not None and isinstance(obj.value, list)
        else set()
    )


def _targets(doc: Any, value: Any, tag: str) -> dict[str, Any]:
    """``{referenced name: value at the same place in value}`` for the ``tag`` references of ``doc``."""
    out: dict[str, Any] = {}

    def walk(d: Any, v: Any) -> None:
        if isinstance(d, list) and isinstance(v, (list, tuple)):
            for x, y in zip(d, v):
                walk(x, y)
        elif isinstance(d, dict):
            if len(d) == 1 and tag in d:
                if isinstance(d[tag], str):
                    out[d[tag]] = v
            elif len(d) == 1 and "__tuple__" in d:
                walk(d["__tuple__"], v)
            elif isinstance(v, Mapping):
                for k, x in d.items():
                    if k in v:
                        walk(x, v[k])

    walk(doc, value)
    return out


def _same_kind(t: torch.Tensor, tm: Any) -> bool:
    return tuple(t.shape) == tm.shape and dtype_name(t) == tm.dtype


def _read_whole(ref: str, tm: Any, targets: list[LoadTensor], expected: dict[str, Expected]) -> np.ndarray:
    """Plan reading stored tensor ``ref`` whole into a new host array."""
    expected[ref] = Expected(tm.shape, tm.dtype)
    buf = np.empty(tm.shape, dtype=np.dtype(np_dtype(tm.dtype)))
    targets.append(LoadTensor(ref, numpy_shards(buf)))
    return buf


def numpy_shards(buf: np.ndarray) -> list[LoadShard]:
    """The read filling host array ``buf`` whole (straight into it where its dtype is the stored one)."""
    if not buf.size and buf.shape != ():
        return []
    return [LoadShard(Box.full(buf.shape), fill(buf), buf if buf.dtype.isnative else None)]


def expect_numpy(
    name: str,
    owner: Mapping[str, Any],
    key: str,
    stored: str | None,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    dropped: set[str],
) -> Callable[[], None]:
    """Plan reading stored entry ``stored`` into the numpy array ``owner[key]`` (target name ``name``), checked
    like a tensor (shape, dtype): in place, or, for a read-only array, into a new array of its dtype that
    ``finish`` puts in its place in ``owner``.

    Raises:
        UnsupportedDTypeError: the array's dtype has no checkpoint representation (naming ``name``).
        ValueError: a read-only array in a mapping that cannot be changed (naming ``name``).
    """
    arr = owner[key]
    if stored is None:
        return _nothing
    dtype = array_dtype(name, arr.dtype)
    out = arr if arr.flags.writeable else np.empty(arr.shape, dtype)
    if out is not arr and not isinstance(owner, MutableMapping):
        raise ValueError(
            f"{name}: a read-only numpy array in a read-only mapping cannot be loaded; pass a writable array "
            "(e.g. arr.copy()) or a dict"
        )
    read = LoadTensor(stored, numpy_shards(out))
    targets.append(read)
    expected[name] = Expected(arr.shape, dtype.name, stored=stored, reads=[read])
    if out is arr:
        return _nothing

    def finish() -> None:
        if name not in dropped:
            owner[key] = out  # type: ignore[index]

    return finish


def _nothing() -> None:
    return None


def load_extra(
    ns: str,
    value: Any,
    meta: CheckpointMetadata,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    result: dict[str, Any],
    options: AdapterOptions,
    modules: Mapping[str, torch.nn.Module] | None = None,
) -> Callable[[], None]:
    """Plan loading entry ``ns`` into ``value``; ``finish`` stores the decoded value in ``result[ns]``.

    ``modules`` are the target modules of nested namespaces (planned by the caller, loaded in place); a
    nested module with no module at its place in the target comes back as a state dict ``{fqn: tensor}``.
    """
    used: list[str] = []
    document = stored_document(meta, ns, used)
    rebuilt = ns not in meta.objects and ns not in meta.tensors and document is not None
    expected[ns] = Expected(stored=DCP_MAP) if rebuilt else Expected()  # a Writer's tree: found
    expected.update((name, Expected()) for name in used if name != ns)
    if document is None:
        return lambda: None
    types = meta.objects.get(f"{ns}/{ARRAY_TYPES}")
    numpy = set(types.value) if types is not None and isinstance(types.value, dict) else set()
    in_place = {k: v for k, v in _targets(document, value, "__array__").items() if is_array(v)}
    loaded: dict[str, Any] = {}
    as_numpy: set[str] = (
        set()
    )  # come back as numpy: a numpy target's, or stored from numpy and not loaded in place
    for ref in extras.array_refs(document, where=ns):
        tm = extras.referenced(meta.tensors, ref, ns)
        t = in_place.get(ref)
        if isinstance(t, np.ndarray):
            as_numpy.add(ref)
            if t.flags.writeable and t.shape == tm.shape and t.dtype.name == tm.dtype:
                read = LoadTensor(ref, numpy_shards(t))  # filled in place
                targets.append(read)
                expected[ref] = Expected(tm.shape, tm.dtype, reads=[read])
                loaded[ref] = t
            else:
                loaded[ref] = _read_whole(ref, tm, targets, expected)  # replaced, as a tensor target is
            continue
        if t is not None and getattr(t, "_local_tensor", t).is_meta:
            if is_dtensor(t):
                raise MetaDeviceError(
                    f"{ref}: a DTensor on the meta device cannot be filled in place; give it storage first "
                    "(e.g. distribute_tensor(torch.empty(...), mesh, placements)) and load again"
                )
            t = None  # a plain meta tensor is replaced by the loaded value
        if t is not None and (is_dtensor(t) or _same_kind(t, tm)):
            # fill the target's own tensor in its own layout (a DTensor reshards like a parameter)
            shape, pieces = layout(t)
            read = LoadTensor(ref, [load_shard(box, v) for box, v in pieces])
            targets.append(read)
            expected[ref] = Expected(shape, dtype_name(t), reads=[read])
            loaded[ref] = t
            continue
        loaded[ref] = _read_whole(ref, tm, targets, expected)
        if ref in numpy:
            as_numpy.add(ref)
    given = dict(modules or {})
    as_dicts: dict[str, dict[str, Any]] = {}
    for name in _listed(meta, ns) - set(given):
        # no module at its place in the target: its tensors come back as a state dict
        as_dicts[name] = {
            n[len(name) + 1 :]: _read_whole(n, tm, targets, expected)
            for n, tm in meta.tensors.items()
            if n.startswith(name + "/") and "/" not in n[len(name) + 1 :] and "~" not in n[len(name) + 1 :]
        }

    def finish() -> None:
        arrays = {
            k: v if isinstance(v, torch.Tensor) or k in as_numpy else as_torch(v).clone()
            for k, v in loaded.items()
        }
        subs: dict[str, Any] = dict(given)
        subs.update({n: {k: as_torch(v).clone() for k, v in d.items()} for n, d in as_dicts.items()})
        decoded = extras.decode(document, arrays, options.allow_pickle, where=ns, modules=subs)
        if isinstance(value, dict) and isinstance(decoded, dict):
            value.clear()
            value.update(decoded)
            result[ns] = value
        else:
            result[ns] = decoded

    return finish
