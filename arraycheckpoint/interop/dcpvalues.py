"""What :class:`arraycheckpoint.dcp.Reader` serves DCP beyond the stored tensors: the non-tensor values and
tied-weight names of a checkpoint that :func:`arraycheckpoint.save` (or a load source) wrote.

DCP asks for every key of its target state dict. A checkpoint of :class:`arraycheckpoint.dcp.Writer` keeps
DCP's own bytes for its non-tensor values (the ``~dcp`` object); any other checkpoint stores them as JSON
objects, which are laid out here under the keys DCP flattens a state dict to (its own
``flatten_state_dict``, so the keys are exactly the target's):

* a plain object ``<ns>/<name>`` (``extra_state``, ``lr_scheduler/last_epoch``): its value under the key path
  of its name, dicts and lists flattened as DCP flattens them (tensors inside it are the stored tensors);
* an optimizer's ``<ns>/~param_groups``: both as DCP's ``<ns>.param_groups.<i>.<hyper>`` and, when every group
  names its parameters, as torch's flattened optimizer state dict (``flatten_optimizer_state_dict=True``, as
  torchtitan saves) ``<ns>.param_groups.<fqn>.<hyper>``;
* ``<ns>/~aliases`` (tied weights stored once): each alias's key, described as the stored tensor.

A value stored as a pickle is served only with ``allow_pickle=True``. No metadata is pickled: DCP gets each
value as ``torch.save`` bytes, as its own reader hands them.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import ArrayCheckpointError, PickleNotAllowedError
from ..format.metadata import CheckpointMetadata
from ..sources.dcpkeys import DCP_OBJECT, dcp_key

PARAM_GROUPS = "~param_groups"
ALIASES = "~aliases"


def _key_path(name: str) -> list[str]:
    """The DCP key path of an entry or object written by :func:`arraycheckpoint.save` (see :func:`dcp_key`)."""
    parts = name.split("/")
    return [parts[0], "state", parts[1], parts[2]] if len(parts) == 3 else parts


def _nest(path: list[str], value: Any) -> dict[str, Any]:
    for part in reversed(path):
        value = {part: value}
    return value


def native_values(
    meta: CheckpointMetadata, allow_pickle: bool
) -> tuple[dict[str, Any], dict[str, tuple[Any, ...]]]:
    """DCP key -> non-tensor value, and DCP key -> key path, of ``meta``'s JSON objects (see the module
    docstring). Tensors inside an object are left out (they are stored tensors, served as such)."""
    import torch
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from ..format import extras

    values: dict[str, Any] = {}
    paths: dict[str, tuple[Any, ...]] = {}

    def add(state: dict[str, Any]) -> None:
        flat, mapping = flatten_state_dict(state)
        for key, value in flat.items():
            if not isinstance(value, torch.Tensor) and key not in values:
                values[key] = value
                paths[key] = tuple(mapping[key])

    for name, obj in sorted(meta.objects.items()):
        parts = name.split("/")
        special = [p for p in parts if p.startswith("~")]
        if obj.scope != "global" or obj.value is None or name == DCP_OBJECT:
            continue
        if special and (special != [PARAM_GROUPS] or parts[-1] != PARAM_GROUPS or len(parts) != 2):
            continue  # aliases, DCP's own bytes, escaped names: not values of the target's keys
        placeholders = {ref: torch.empty(0) for ref in extras.array_refs(obj.value)}
        try:
            value = extras.decode(obj.value, placeholders, allow_pickle=allow_pickle, where=name)
        except PickleNotAllowedError:
            continue  # served only with allow_pickle=True; DCP then names the key missing
        except ArrayCheckpointError:
            continue  # a value this reader cannot restore (damaged): acp.load names it
        if not special:
            add(_nest(_key_path(name), value))
            continue
        ns = parts[0]
        if not isinstance(value, list) or not all(isinstance(g, Mapping) for g in value):
            continue
        add({ns: {"param_groups": value}})
        fqns = [g.get("params") for g in value]
        if all(isinstance(f, list) and all(isinstance(p, str) for p in f) for f in fqns):
            flat = {
                f"param_groups.{fqn}.{k}": v
                for g in value
                for fqn in g["params"]
                for k, v in g.items()
                if k != "params"
            }
            add({ns: flat})
    return values, paths


def aliases(meta: CheckpointMetadata) -> dict[str, str]:
    """DCP key of each tied weight's alias -> the entry stored for it (``<ns>/~aliases``), for stored tensors
    only."""
    out: dict[str, str] = {}
    for name, obj in meta.objects.items():
        ns, _, last = name.rpartition("/")
        if last != ALIASES or not ns or not isinstance(obj.value, Mapping):
            continue
        for alias, stored in obj.value.items():
            entry = f"{ns}/{stored}"
            if isinstance(alias, str) and isinstance(stored, str) and entry in meta.tensors:
                out[dcp_key(f"{ns}/{alias}")] = entry
    return out
