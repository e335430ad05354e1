"""DCP keys and arraycheckpoint entries: the naming both ways, and the JSON objects of DCP's non-tensor values.

Shared by the DCP load source (:mod:`.dcp`) and the DCP plug-in (:mod:`arraycheckpoint.dcp`): DCP flattens
nested state dicts to dotted keys and records each key's path; an entry is that path joined with ``/``
(components an entry name cannot hold escaped with ``~``), an optimizer's ``state`` level dropped, a flattened
optimizer's keys named the same way. Pure: no I/O.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ..errors import UnsafeNameError
from ..format.metadata import ObjectMeta, check_name

#: JSON object holding DCP's key -> entry mapping and its non-tensor values (base64 of DCP's bytes)
DCP_OBJECT = "~dcp"
MAX_BYTE_IO = 16 << 20  # a non-tensor value DCP pickles: param_groups, counters; not data
#: the file DCP's resume discovery looks for (torchtitan's ``_find_load_step``); JSON here, never a pickle
DISCOVERY_FILE = ".metadata"
_FLAT = ("state.", "param_groups.")  # torch's flatten_optimizer_state_dict keys


def _escape_part(part: str) -> str:
    """One key component as an entry name component: as it is when allowed, else escaped with ``~``
    (``~`` -> ``~~``, ``/`` -> ``~s``, ``\\`` -> ``~b``, ``:`` -> ``~c``, NUL -> ``~0``, a leading ``.`` ->
    ``~d``, a leading ``__`` -> ``~u_``). FileSystemWriter accepts keys such as ``w:1``, ``__w``, ``.w``;
    the writer records every key's entry, so a round trip gives the key back exactly."""
    try:
        if "/" not in part:
            return check_name(part)
    except UnsafeNameError:
        pass
    out = (
        part.replace("~", "~~").replace("/", "~s").replace("\\", "~b").replace(":", "~c").replace("\0", "~0")
    )
    if out.startswith("."):
        out = "~d" + out[1:]
    if out.startswith("__"):
        out = "~u" + out[1:]
    return "~e" + out if out in ("", "zarr.json") else out


def _join(parts: Sequence[str]) -> str:
    return check_name("/".join(_escape_part(p) for p in parts))


def entry_name(fqn: str, path: Sequence[Any] | None) -> str:
    """The entry a DCP key is stored under (see the module docstring)."""
    if not path:
        return _join(fqn.split("/"))
    parts = [str(p) for p in path]
    if len(parts) == 4 and parts[1] == "state":  # optimizer state: <ns>/<param fqn>/<state>
        parts = [parts[0], parts[2], parts[3]]
    return _join(parts)


def _flat_optimizers(paths: Mapping[str, Sequence[Any] | None]) -> set[str]:
    """Namespaces holding a flattened optimizer state dict (``flatten_optimizer_state_dict=True``, as
    torchtitan saves): every key below them is ``state.<fqn>.<key>`` or ``param_groups.<fqn>.<hyper>``."""
    subs: dict[str, list[str | None]] = {}
    for path in paths.values():
        if path:
            subs.setdefault(str(path[0]), []).append(str(path[1]) if len(path) == 2 else None)
    return {
        ns
        for ns, keys in subs.items()
        if all(k is not None and k.startswith(_FLAT) for k in keys)
        and any(k is not None and k.startswith("param_groups.") for k in keys)
    }


def _flat_parts(path: Sequence[Any]) -> tuple[str, str, str, str]:
    """``(namespace, "state" or "param_groups", param fqn, key)`` of a flattened optimizer key's path
    (state and hyper-parameter names hold no dot; the FQN between them may)."""
    kind, _, rest = str(path[1]).partition(".")
    fqn, _, key = rest.rpartition(".")
    return str(path[0]), kind, fqn, key


def entry_names(keys: Iterable[str], paths: Mapping[str, Sequence[Any] | None]) -> dict[str, str]:
    """DCP key -> entry for every key of one checkpoint: :func:`entry_name`, except that a flattened
    optimizer's ``<ns>.state.<fqn>.<key>`` is stored as ``<ns>/<fqn>/<key>`` like an unflattened one, so
    :func:`arraycheckpoint.load` reads it into an optimizer."""
    flat = _flat_optimizers(paths)
    out = {}
    for k in keys:
        path = paths.get(k)
        if path and len(path) == 2 and str(path[0]) in flat and str(path[1]).startswith("state."):
            ns, _, fqn, key = _flat_parts(path)
            out[k] = _join([ns, fqn, key])
        else:
            out[k] = entry_name(k, path)
    return out


def native_objects(
    names: Mapping[str, str], paths: Mapping[str, Sequence[Any] | None], values: Mapping[str, Any]
) -> dict[str, ObjectMeta]:
    """The JSON objects :func:`arraycheckpoint.load` reads, from DCP's non-tensor values (``values``: key ->
    JSON document, as :func:`arraycheckpoint.format.extras.encode` makes it): an optimizer's ``param_groups``
    (DCP's list, or a flattened optimizer's ``param_groups.<fqn>.<hyper>`` gathered into groups of equal
    hyper-parameters) as ``<ns>/~param_groups``, and non-tensor per-parameter state as ``<ns>/<fqn>/<key>``."""
    from ..format import extras

    flat = _flat_optimizers(paths)
    out: dict[str, ObjectMeta] = {}
    hyper: dict[str, dict[str, dict[str, Any]]] = {}  # ns -> fqn -> {name: value}
    indexed: dict[str, dict[int, dict[str, Any]]] = {}  # ns -> group index -> {name: value}
    for k, doc in values.items():
        path = [str(p) for p in paths.get(k) or ()]
        if len(path) == 2 and path[1] == "param_groups":
            name = _join([path[0], "~param_groups"])
            out[name] = ObjectMeta(name, "global", doc)
        elif len(path) == 4 and path[1] == "param_groups" and path[2].isdigit():  # DCP flattens the list
            indexed.setdefault(path[0], {}).setdefault(int(path[2]), {})[path[3]] = extras.decode(doc, {})
        elif len(path) == 4 and path[1] == "state":
            out[names[k]] = ObjectMeta(names[k], "global", doc)
        elif len(path) == 2 and path[0] in flat:
            ns, kind, fqn, key = _flat_parts(path)
            if kind == "state":
                out[names[k]] = ObjectMeta(names[k], "global", doc)
            else:
                hyper.setdefault(ns, {}).setdefault(fqn, {})[key] = extras.decode(doc, {})
        elif path and all(
            not p.isdigit() for p in path
        ):  # any other value (``step``, ``m.n``): its own object
            out[names[k]] = ObjectMeta(names[k], "global", doc)
    for ns, by_index in indexed.items():
        name = _join([ns, "~param_groups"])
        groups_list = [by_index[i] for i in sorted(by_index)]
        out[name] = ObjectMeta(name, "global", extras.encode(groups_list, ns, lambda _: False)[0])
    for ns, by_param in hyper.items():
        groups: dict[str, dict[str, Any]] = {}
        for fqn, h in by_param.items():
            sig = json.dumps(extras.encode(h, ns, lambda _: False)[0], sort_keys=True)
            groups.setdefault(sig, {**h, "params": []})["params"].append(fqn)
        name = _join([ns, "~param_groups"])
        out[name] = ObjectMeta(name, "global", extras.encode(list(groups.values()), ns, lambda _: False)[0])
    return out


def json_value(value: Any) -> Any:
    """``value`` (a non-tensor DCP value) as a JSON document of :mod:`arraycheckpoint.format.extras`, or None
    when JSON cannot hold it (it then stays DCP's bytes only)."""
    from ..adapters.torch.optimizer import _plain
    from ..format import extras

    try:
        doc, arrays = extras.encode(_plain(value), "~dcp", lambda _: False)
    except Exception:  # noqa: BLE001 - not JSON-able: kept as DCP's bytes only
        return None
    return None if arrays else doc


def dcp_key(entry: str) -> str:
    """The DCP flattened key of an entry written by :func:`arraycheckpoint.save`."""
    parts = entry.split("/")
    if len(parts) == 3:
        parts = [parts[0], "state", parts[1], parts[2]]
    return ".".join(parts)
