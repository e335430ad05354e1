"""The PyTorch adapter: ``nn.Module`` (plain, DDP, FSDP1, FSDP2/DTensor), optimizers and extra state.

State layout in the checkpoint:

* ``model/<fqn>``: parameters and persistent buffers, global shapes; tied weights stored once
  (``model/~aliases`` maps the other names); non-tensor module extra state as JSON objects; a state dict's
  numpy arrays beside its tensors, in their own dtype (a numpy target is filled in place and stays numpy);
* ``optimizer/<fqn>/<key>``: per-parameter state keyed by parameter FQN (never integer ids), with the
  parameter's layout; ``optimizer/~param_groups``: hyper-parameters with FQN lists (see :mod:`.optimizer`);
* any other key (``extra_state``, an EMA dict, ...): nested values as JSON plus arrays (see
  :mod:`.extra_state`); tensors and DTensors in it are saved in their own layout and loaded in place, so
  an EMA dict of DTensors reshards like the parameters; a module nested in it at any depth is stored like
  ``model`` under its escaped path (``ema/m/<fqn>``), so EMA and teacher modules reshard too.

Loads are keyed by target name; the stored name each reads comes from :class:`.module.StoredNames`
(``key_map``, then the checkpoint's tied-weight aliases).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import torch

from ...errors import MetaDeviceError, StateMismatchError, UnsupportedDTypeError
from ...format.metadata import CheckpointMetadata
from ...planning.items import LoadTensor, SaveObject, SaveRequest, SaveTensor
from ..base import Adapter, AdapterOptions, Expected, LoadJob
from .common import dtype_name, tensor_item
from .extra_state import DCP_MAP, expect_numpy, is_array, load_extra, nested_modules, save_extra
from .module import ModuleView, StoredNames, materialise
from .optimizer import _plain, _restore_like, load_optimizer, owner, save_optimizer  # noqa: F401
from .tensors import layout, load_shard

# _plain and _restore_like are imported from here by megatron_optim

#: a transformers model's config.json / generation_config.json, stored beside its tensors (``<ns>/~hf_config``)
HF_CONFIG = "~hf_config"


class TorchAdapter(Adapter):
    """Translates torch state; DDP, FSDP1 and FSDP2/DTensor are recognised from the objects."""

    framework = "torch"

    # ------------------------------------------------------------------------------------------- save
    def save_request(self, state: Mapping[str, Any], options: AdapterOptions) -> SaveRequest:
        tensors: list[SaveTensor] = []
        objects: list[SaveObject] = []
        nested: dict[str, torch.nn.Module] = {}
        for ns, value in state.items():
            if _is_extra(ns, value):
                save_extra(ns, value, tensors, objects, options, nested)
        views = _module_views(state)
        views.update({name: ModuleView(m) for name, m in nested.items()})
        for ns, value in state.items():
            if isinstance(value, torch.nn.Module):
                _save_module(ns, views[ns], tensors, objects, options)
            elif isinstance(value, torch.optim.Optimizer):
                save_optimizer(ns, value, owner(views, value)[1], tensors, objects, options)
            elif _is_state_dict(ns, value):
                tensors.extend(tensor_item(f"{ns}/{fqn}", t) for fqn, t in value.items())
        for name in nested:
            _save_module(name, views[name], tensors, objects, options)
        return SaveRequest(tensors, objects, framework=self.framework, step=options.step)

    # ------------------------------------------------------------------------------------------- load
    def load_job(
        self, meta: CheckpointMetadata, state: Mapping[str, Any], options: AdapterOptions
    ) -> LoadJob:
        flat = {ns for ns, v in state.items() if _is_state_dict(ns, v) or _saved_from_module(meta, ns, v)}
        nested = {
            ns: nested_modules(meta, ns, v) for ns, v in state.items() if _is_extra(ns, v) and ns not in flat
        }
        modules = {ns: v for ns, v in state.items() if isinstance(v, torch.nn.Module)}
        for subs in nested.values():
            modules.update(subs)
        for ns, value in modules.items():
            materialise(value, ns, options.device)
        targets: list[LoadTensor] = []
        expected: dict[str, Expected] = {}
        finishers: list[Callable[[], None]] = []
        dropped: set[str] = set()
        names = StoredNames(meta, _top_level_key_map(meta, modules, options.key_map))
        views = {ns: ModuleView(m) for ns, m in modules.items()}
        result = dict(state)
        # names under these entries are checked one by one: modules nested in extra state, and the
        # namespaces whose state-dict document an older save wrote (a stored entry the target lacks is unexpected)
        scoped = {name for subs in nested.values() for name in subs}
        for ns in modules:
            if _saved_as_state_dict(meta, ns):
                expected[ns] = Expected()
                scoped.add(ns)
            finishers.append(_load_module(ns, views[ns], names, targets, expected, dropped))
            finishers.extend(_load_module_extra(ns, views[ns], meta, targets, expected, options))
        for ns, value in state.items():
            if isinstance(value, torch.optim.Optimizer):
                model_ns, view = owner(views, value)
                finishers.append(
                    load_optimizer(
                        ns, value, model_ns, view, meta, names, targets, expected, dropped, options
                    )
                )
            elif ns in flat:
                refs = _document_refs(meta, ns)
                if refs is not None:
                    expected[ns] = Expected()  # an older save's document of the dict (see _document_refs)
                    scoped.add(ns)
                for fqn, t in value.items():
                    name = f"{ns}/{fqn}"
                    stored = names(name)
                    if refs and stored not in meta.tensors:
                        stored = refs.get(fqn, stored)
                    if isinstance(t, np.ndarray):
                        finishers.append(expect_numpy(name, value, fqn, stored, targets, expected, dropped))
                        continue
                    if t.is_meta:
                        raise MetaDeviceError(
                            f"{name}: a meta tensor in a state dict cannot be filled in place; pass the "
                            f"module itself (acp.load(path, {{{ns!r}: model}}, device=...)) to materialise it"
                        )
                    _expect_tensor(name, t, layout(t), names, targets, expected, stored)
            elif _is_extra(ns, value):
                finishers.append(load_extra(ns, value, meta, targets, expected, result, options, nested[ns]))

        def finish() -> dict[str, Any]:
            for f in finishers:
                f()
            return result

        return LoadJob(targets, expected, set(state), finish, dropped=dropped, scoped=scoped)


# ------------------------------------------------------------------------------------------- modules
def _save_module(ns: str, view: ModuleView, tensors: list, objects: list, options: AdapterOptions) -> None:
    """Describe a module's tensors (global layouts), tied-weight aliases and module extra state under ``ns``."""
    for fqn, t in view.tensors.items():
        shape, pieces = view.layout(t)
        tensors.append(tensor_item(f"{ns}/{fqn}", t, pieces, shape, view.rule_of(t)))
    if view.aliases:
        objects.append(SaveObject(f"{ns}/~aliases", dict(view.aliases)))
    hf = _hf_config(view.model)
    if hf:
        objects.append(SaveObject(f"{ns}/{HF_CONFIG}", hf))
    for fqn, value in view.extra.items():
        save_extra(f"{ns}/{fqn}", value, tensors, objects, options)


def _expect_tensor(
    name: str,
    t: torch.Tensor,
    placed: tuple[tuple[int, ...], list],
    names: StoredNames,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    stored: str | None = None,
) -> LoadTensor | None:
    """Plan reading target tensor ``name`` (global shape and local pieces ``placed``) from its stored entry
    (``stored``, default: what ``names`` maps ``name`` to)."""
    stored = stored or names(name)
    if stored is None:
        return None
    shape, pieces = placed
    try:
        read = LoadTensor(stored, [load_shard(box, v) for box, v in pieces])
        expected[name] = Expected(shape, dtype_name(t), stored=stored, reads=[read])
    except UnsupportedDTypeError as e:  # the dtype alone did not say which target tensor it was
        raise UnsupportedDTypeError(f"{name} (the load target): {e}") from None
    targets.append(read)
    return read


def _load_module(
    ns: str,
    view: ModuleView,
    names: StoredNames,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    dropped: set[str],
) -> Callable[[], None]:
    """Plan a module's tensors; ``finish`` checks that tied target weights were stored equal.

    A weight the target ties under several names loads from whichever of them the checkpoint stores (a
    Hugging Face directory stores a tied weight once, under one of its names, e.g. ``embed_tokens``).
    """
    stored_as = _tied_stored_names(ns, view, names)
    for fqn, t in view.tensors.items():
        _expect_tensor(f"{ns}/{fqn}", t, view.layout(t), names, targets, expected, stored_as.get(fqn))
    if names.aliases(ns):
        expected[f"{ns}/~aliases"] = Expected()
    if f"{ns}/{HF_CONFIG}" in names.meta.objects:
        expected[f"{ns}/{HF_CONFIG}"] = Expected()  # for export (config.json); nothing to load
    checks: list[tuple[str, str, list[torch.Tensor], list[torch.Tensor]]] = []
    for alias, primary in view.aliases.items():
        # a target that ties two names: a checkpoint storing them separately must hold equal tensors
        a_name, p_name = f"{ns}/{alias}", f"{ns}/{primary}"
        stored, primary_stored = names(a_name), stored_as.get(primary) or names(p_name)
        if stored is None or stored == primary_stored or stored not in names.meta.tensors:
            continue  # stored once (under the primary's name or the alias's): nothing to compare
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


def _hf_config(model: torch.nn.Module) -> dict[str, Any]:
    """A transformers model's ``config`` and ``generation_config`` as JSON (what ``save_pretrained`` writes
    beside the weights), kept so that ``arraycheckpoint export`` writes a directory transformers loads; empty
    for any other module."""
    import json

    out = {}
    for key in ("config", "generation_config"):
        cfg = getattr(model, key, None)
        to_json = getattr(cfg, "to_json_string", None)
        if to_json is None or (key == "config" and not getattr(cfg, "model_type", None)):
            continue
        try:
            doc = json.loads(to_json(use_diff=False) if key == "config" else to_json())
        except Exception:  # noqa: BLE001 - a config JSON cannot hold: the user passes --config to export
            continue
        if isinstance(doc, dict):
            out[key] = doc
    return out


def _top_level_key_map(
    meta: CheckpointMetadata,
    modules: Mapping[str, torch.nn.Module],
    key_map: Callable[[str], str | None] | None,
) -> Callable[[str], str | None] | None:
    """``key_map`` extended for model FQNs stored at the top level (no namespace), as torchtitan saves
    through DCP (``tok_embeddings.weight`` beside ``optimizer/...``): when exactly one target module's
    namespace has nothing stored under it and the checkpoint has top-level tensors, that module's
    ``<ns>/<fqn>`` reads ``<fqn>`` (only where ``<ns>/<fqn>`` itself is not stored). Ambiguous cases (two
    such modules) are left to an explicit ``key_map`` (``lambda n: n.split("/", 1)[1]``)."""
    top = {n for n in meta.tensors if "/" not in n}
    bare = [ns for ns in modules if not any(n.startswith(ns + "/") for n in meta.tensors)]
    if not top or len(bare) != 1:
        return key_map
    prefix = bare[0] + "/"

    def mapped(name: str) -> str | None:
        stored = key_map(name) if key_map else name
        if stored is not None and stored.startswith(prefix) and stored not in meta.tensors:
            fqn = stored[len(prefix) :]
            return fqn if fqn in top else stored
        return stored

    return mapped


def _tied_stored_names(ns: str, view: ModuleView, names: StoredNames) -> dict[str, str]:
    """``{primary fqn: stored entry}`` for each tied target weight whose primary name the checkpoint does not
    hold but one of its other names does (the entry under that other name)."""
    out: dict[str, str] = {}
    for alias, primary in view.aliases.items():
        if primary in out or names(f"{ns}/{primary}") in names.meta.tensors:
            continue
        stored = names(f"{ns}/{alias}")
        if stored is not None and stored in names.meta.tensors:
            out[primary] = stored
    return out


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
        load = load_extra(name, current, meta, targets, expected, out, options)
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


def _is_extra(ns: str, value: Any) -> bool:
    """A namespace stored as extra state (JSON plus arrays, nested modules as namespaces of their own)."""
    return not isinstance(value, (torch.nn.Module, torch.optim.Optimizer)) and not _is_state_dict(ns, value)


def _saved_from_module(meta: CheckpointMetadata, ns: str, value: Any) -> bool:
    """A state dict target (FQN -> tensor or numpy array) of a namespace other than ``model`` saved from a module:
    its tensors are stored as ``<ns>/<fqn>`` with no document, so it loads as a ``model`` state dict does.
    (A DCP Writer's namespaces have no document either: their key map rebuilds it, see ``stored_document``.)"""
    return (
        ns not in meta.objects
        and DCP_MAP not in meta.objects
        and isinstance(value, Mapping)
        and bool(value)
        and all(is_array(v) for v in value.values())
        and any(n.startswith(f"{ns}/") for n in meta.tensors)
    )


def _saved_as_state_dict(meta: CheckpointMetadata, ns: str) -> bool:
    """Whether namespace ``ns`` was saved from a state dict (FQN -> tensor) outside ``model``: a document
    of nothing but references to its own tensors ``<ns>/<fqn>``, which a module target reads directly."""
    obj = meta.objects.get(ns)
    doc = obj.value if obj is not None else None
    return (
        isinstance(doc, dict)
        and bool(doc)
        and all(isinstance(k, str) and v == {"__array__": f"{ns}/{k}"} for k, v in doc.items())
    )


def _document_refs(meta: CheckpointMetadata, ns: str) -> dict[str, str] | None:
    """``{key: stored array}`` of namespace ``ns``'s stored document when it holds nothing but array
    references, else None. Saves before 2026-11 (469cb39 and earlier) stored a ``model`` state dict holding
    numpy arrays as extra state: such a document, ``model/~arrays``, and the arrays under their escaped keys."""
    obj = meta.objects.get(ns)
    doc = obj.value if obj is not None else None
    if not isinstance(doc, dict) or not doc:
        return None
    refs = {k: v.get("__array__") for k, v in doc.items() if isinstance(v, dict) and len(v) == 1}
    if len(refs) != len(doc) or not all(isinstance(r, str) for r in refs.values()):
        return None
    return refs  # type: ignore[return-value]


def _is_state_dict(ns: str, value: Any) -> bool:
    """A ``model`` entry given as a state dict (FQN -> tensor/DTensor or numpy array) rather than a module."""
    return ns == "model" and isinstance(value, Mapping) and all(is_array(v) for v in value.values())
