"""The PyTorch adapter: ``nn.Module`` (plain, DDP, FSDP1, FSDP2/DTensor), optimizers and extra state.

State layout in the checkpoint:

* ``model/<fqn>``: parameters and persistent buffers, global shapes; tied weights stored once
  (``model/~aliases`` maps the other names); non-tensor module extra state as JSON objects;
* ``optimizer/<fqn>/<key>``: per-parameter state keyed by parameter FQN (never integer ids), with the
  parameter's layout; ``optimizer/~param_groups``: hyper-parameters with FQN lists (see :mod:`.optimizer`);
* any other key (``extra_state``, an EMA dict, ...): nested values as JSON plus arrays (see
  :mod:`arraycheckpoint.extras`); tensors and DTensors in it are saved in their own layout and loaded in
  place, so an EMA dict of DTensors reshards like the parameters; ``<ns>/~arrays`` records which arrays
  were numpy arrays, so they come back as numpy.

Loads are keyed by target name; the stored name each reads comes from :class:`.module.StoredNames`
(``key_map``, then the checkpoint's tied-weight aliases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ... import extras
from ...errors import MetaDeviceError, StateMismatchError
from ...items import LoadShard, LoadTensor, SaveObject, SaveRequest, SaveTensor
from ...metadata import CheckpointMetadata
from ...regions import Box
from ..base import Adapter, AdapterOptions, Expected, LoadJob
from .common import dtype_name, fill, np_dtype, tensor_item
from .module import ModuleView, StoredNames, materialise
from .optimizer import _plain, _restore_like, load_optimizer, owner, save_optimizer  # noqa: F401
from .tensors import as_torch, is_dtensor, layout, load_shard

# _plain and _restore_like are imported from here by megatron_optim
ARRAY_TYPES = "~arrays"  # <ns>/~arrays: {array name: "numpy"} for arrays that were not torch tensors


def _is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


class TorchAdapter(Adapter):
    """Translates torch state; DDP, FSDP1 and FSDP2/DTensor are recognised from the objects."""

    framework = "torch"

    # ------------------------------------------------------------------------------------------- save
    def save_request(self, state: Mapping[str, Any], options: AdapterOptions) -> SaveRequest:
        tensors: list[SaveTensor] = []
        objects: list[SaveObject] = []
        views = _module_views(state)
        for ns, value in state.items():
            if isinstance(value, torch.nn.Module):
                self._save_module(ns, views[ns], tensors, objects, options)
            elif isinstance(value, torch.optim.Optimizer):
                save_optimizer(ns, value, owner(views, value)[1], tensors, objects, options)
            elif _is_state_dict(ns, value):
                tensors.extend(tensor_item(f"{ns}/{fqn}", t) for fqn, t in value.items())
            else:
                _save_extra(ns, value, tensors, objects, options)
        return SaveRequest(tensors, objects, framework=self.framework, step=options.step)

    def _save_module(
        self, ns: str, view: ModuleView, tensors: list, objects: list, options: AdapterOptions
    ) -> None:
        for fqn, t in view.tensors.items():
            shape, pieces = view.layout(t)
            tensors.append(tensor_item(f"{ns}/{fqn}", t, pieces, shape, view.rule_of(t)))
        if view.aliases:
            objects.append(SaveObject(f"{ns}/~aliases", dict(view.aliases)))
        for fqn, value in view.extra.items():
            _save_extra(f"{ns}/{fqn}", value, tensors, objects, options)

    # ------------------------------------------------------------------------------------------- load
    def load_job(
        self, meta: CheckpointMetadata, state: Mapping[str, Any], options: AdapterOptions
    ) -> LoadJob:
        for ns, value in state.items():
            if isinstance(value, torch.nn.Module):
                materialise(value, ns, options.device)
        targets: list[LoadTensor] = []
        expected: dict[str, Expected] = {}
        finishers: list[Callable[[], None]] = []
        dropped: set[str] = set()
        names = StoredNames(meta, options.key_map)
        views = _module_views(state)
        result = dict(state)
        for ns, value in state.items():
            if isinstance(value, torch.nn.Module):
                finishers.append(_load_module(ns, views[ns], names, targets, expected, dropped))
                finishers.extend(_load_module_extra(ns, views[ns], meta, targets, expected, options))
            elif isinstance(value, torch.optim.Optimizer):
                model_ns, view = owner(views, value)
                finishers.append(
                    load_optimizer(
                        ns, value, model_ns, view, meta, names, targets, expected, dropped, options
                    )
                )
            elif _is_state_dict(ns, value):
                for fqn, t in value.items():
                    if t.is_meta:
                        raise MetaDeviceError(
                            f"{ns}/{fqn}: a meta tensor in a state dict cannot be filled in place; pass the "
                            f"module itself (acp.load(path, {{{ns!r}: model}}, device=...)) to materialise it"
                        )
                    _expect_tensor(f"{ns}/{fqn}", t, layout(t), names, targets, expected)
            else:
                finishers.append(_load_extra(ns, value, meta, targets, expected, result, options))

        def finish() -> dict[str, Any]:
            for f in finishers:
                f()
            return result

        return LoadJob(targets, expected, set(state), finish, dropped=dropped)


# ------------------------------------------------------------------------------------------- modules
def _expect_tensor(
    name: str,
    t: torch.Tensor,
    placed: tuple[tuple[int, ...], list],
    names: StoredNames,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
) -> LoadTensor | None:
    """Plan reading target tensor ``name`` (global shape and local pieces ``placed``) from its stored entry."""
    stored = names(name)
    if stored is None:
        return None
    shape, pieces = placed
    read = LoadTensor(stored, [load_shard(box, v) for box, v in pieces])
    targets.append(read)
    expected[name] = Expected(shape, dtype_name(t), stored=stored, reads=[read])
    return read


def _load_module(
    ns: str,
    view: ModuleView,
    names: StoredNames,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    dropped: set[str],
) -> Callable[[], None]:
    """Plan a module's tensors; ``finish`` checks that tied target weights were stored equal."""
    for fqn, t in view.tensors.items():
        _expect_tensor(f"{ns}/{fqn}", t, view.layout(t), names, targets, expected)
    if names.aliases(ns):
        expected[f"{ns}/~aliases"] = Expected()
    checks: list[tuple[str, str, list[torch.Tensor], list[torch.Tensor]]] = []
    for alias, primary in view.aliases.items():
        # a target that ties two names: a checkpoint storing them separately must hold equal tensors
        a_name, p_name = f"{ns}/{alias}", f"{ns}/{primary}"
        stored, primary_stored = names(a_name), names(p_name)
        if stored is None or stored == primary_stored:
            continue
        t = view.tensors[primary]
        shape, pieces = view.layout(t)
        copies = [torch.empty_like(v) for _, v in pieces]
        _expect_tensor(
            a_name, t, (shape, list(zip([b for b, _ in pieces], copies))), names, targets, expected
        )
        checks.append((a_name, p_name, [v for _, v in pieces], copies))

    def finish() -> None:
        for a_name, p_name, views, copies in checks:
            if a_name in dropped or p_name in dropped:
                continue
            if not all(torch.equal(v, c) for v, c in zip(views, copies)):
                raise StateMismatchError(
                    f"{a_name} and {p_name} are one tied parameter in the target but hold different values "
                    f"in the checkpoint (stored as {expected[a_name].stored} and {expected[p_name].stored}): "
                    "untie them in the model, or choose one with key_map "
                    f"(e.g. key_map={{{a_name!r}: {expected[p_name].stored!r}}})"
                )

    return finish


def _load_module_extra(
    ns: str,
    view: ModuleView,
    meta: CheckpointMetadata,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    options: AdapterOptions,
) -> list[Callable[[], None]]:
    """Module extra state (``get_extra_state``): decoded like extra state, handed to ``set_extra_state``."""
    finishers = []
    for fqn, current in view.extra.items():
        name = f"{ns}/{fqn}"
        out: dict[str, Any] = {}
        load = _load_extra(name, current, meta, targets, expected, out, options)
        owner_name = fqn[: -len("._extra_state")] if fqn.endswith("._extra_state") else ""
        module = view.model.get_submodule(owner_name)

        def finish(load=load, out=out, name=name, module=module) -> None:
            load()
            if name in out:
                module.set_extra_state(out[name])

        finishers.append(finish)
    return finishers


def _module_views(state: Mapping[str, Any]) -> dict[str, ModuleView]:
    return {ns: ModuleView(v) for ns, v in state.items() if isinstance(v, torch.nn.Module)}


def _is_state_dict(ns: str, value: Any) -> bool:
    """A ``model`` entry given as a state dict (FQN -> tensor/DTensor) rather than a module."""
    return (
        ns == "model"
        and isinstance(value, Mapping)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )


# ------------------------------------------------------------------------------------------- extras
def _save_extra(ns: str, value: Any, tensors: list, objects: list, options: AdapterOptions) -> None:
    doc, arrays = extras.encode(value, ns, _is_array, options.allow_pickle)
    objects.append(SaveObject(ns, doc))
    tensors.extend(tensor_item(name, a) for name, a in arrays.items())
    numpy = {name: "numpy" for name, a in arrays.items() if isinstance(a, np.ndarray)}
    if numpy:
        objects.append(SaveObject(f"{ns}/{ARRAY_TYPES}", numpy))


def _in_place_targets(doc: Any, value: Any) -> dict[str, torch.Tensor]:
    """``{array name: target tensor}`` for stored arrays whose place in ``value`` holds a torch tensor."""
    out: dict[str, torch.Tensor] = {}

    def walk(d: Any, v: Any) -> None:
        if isinstance(d, list) and isinstance(v, (list, tuple)):
            for x, y in zip(d, v):
                walk(x, y)
        elif isinstance(d, dict):
            if len(d) == 1 and "__array__" in d:
                if isinstance(v, torch.Tensor):
                    out[d["__array__"]] = v
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


def _load_extra(ns, value, meta, targets, expected, result, options) -> Callable[[], None]:
    obj = meta.objects.get(ns)
    expected[ns] = Expected()
    if obj is None:
        return lambda: None
    types = meta.objects.get(f"{ns}/{ARRAY_TYPES}")
    numpy = set(types.value) if types is not None and isinstance(types.value, dict) else set()
    in_place = _in_place_targets(obj.value, value)
    loaded: dict[str, Any] = {}
    for ref in extras.array_refs(obj.value):
        tm = meta.tensors[ref]
        t = in_place.get(ref)
        if t is not None and getattr(t, "_local_tensor", t).is_meta:
            if is_dtensor(t):
                raise MetaDeviceError(
                    f"{ref}: a DTensor on the meta device cannot be filled in place; give it storage first "
                    "(e.g. distribute_tensor(torch.empty(...), mesh, placements)) and load again"
                )
            t = None  # a plain meta tensor is replaced by the loaded value
        if t is not None and ref not in numpy and (is_dtensor(t) or _same_kind(t, tm)):
            # fill the target's own tensor in its own layout (a DTensor reshards like a parameter)
            shape, pieces = layout(t)
            read = LoadTensor(ref, [load_shard(box, v) for box, v in pieces])
            targets.append(read)
            expected[ref] = Expected(shape, dtype_name(t), reads=[read])
            loaded[ref] = t
            continue
        expected[ref] = Expected(tm.shape, tm.dtype)
        buf = np.empty(tm.shape, dtype=np.dtype(np_dtype(tm.dtype)))
        loaded[ref] = buf
        targets.append(
            LoadTensor(ref, [LoadShard(Box.full(tm.shape), fill(buf))] if buf.size or tm.shape == () else [])
        )

    def finish() -> None:
        arrays = {
            k: v if isinstance(v, torch.Tensor) or k in numpy else as_torch(v).clone()
            for k, v in loaded.items()
        }
        decoded = extras.decode(obj.value, arrays, options.allow_pickle, where=ns)
        if isinstance(value, dict) and isinstance(decoded, dict):
            value.clear()
            value.update(decoded)
            result[ns] = value
        else:
            result[ns] = decoded

    return finish
