"""The PyTorch adapter: ``nn.Module`` (plain, DDP, FSDP1, FSDP2/DTensor), optimizers and extra state.

State layout in the checkpoint:

* ``model/<fqn>``: parameters and persistent buffers, global shapes; tied weights stored once
  (``model/~aliases`` maps the other names); non-tensor module extra state as JSON objects;
* ``optimizer/<fqn>/<key>``: per-parameter state keyed by parameter FQN (never integer ids), with the
  parameter's layout; ``optimizer/~param_groups``: hyper-parameters with FQN lists;
* any other key (``extra_state``, ...): nested values as JSON plus arrays (see :mod:`arraycheckpoint.extras`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from ... import extras
from ...items import LoadShard, LoadTensor, SaveObject, SaveRequest, SaveShard, SaveTensor
from ...metadata import CheckpointMetadata
from ...regions import Box
from ..base import Adapter, AdapterOptions, Expected, LoadJob
from .dtensor_rule import dtensor_rule
from .module import ModuleView
from .tensors import TorchSource, as_torch, is_dtensor, layout, load_shard, numpy_dtype


def _is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _tensor_item(name: str, t: Any, pieces: list | None = None, shape: tuple | None = None) -> SaveTensor:
    if isinstance(t, np.ndarray):
        t = as_torch(t)
    if pieces is None:
        shape = tuple(t.shape)
        pieces = [(Box.full(shape), t.detach())]
    return SaveTensor(
        name=name,
        shape=shape,
        dtype=numpy_dtype(t.dtype),
        shards=[SaveShard(box, TorchSource(view)) for box, view in pieces],
        rule=dtensor_rule(t),
    )


def _dtype_name(t: torch.Tensor) -> str:
    from ...codecs import zarr_dtype_name

    return zarr_dtype_name(numpy_dtype(t.dtype))


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
                self._save_optimizer(ns, value, _owner_view(views, value), tensors, objects, options)
            elif _is_state_dict(ns, value):
                for fqn, t in value.items():
                    shape, pieces = layout(t)
                    tensors.append(_tensor_item(f"{ns}/{fqn}", t, pieces, shape))
            else:
                doc, arrays = extras.encode(value, ns, _is_array, options.allow_pickle)
                objects.append(SaveObject(ns, doc))
                tensors.extend(_tensor_item(name, a) for name, a in arrays.items())
        return SaveRequest(tensors, objects, framework=self.framework, step=options.step)

    def _save_module(
        self, ns: str, view: ModuleView, tensors: list, objects: list, options: AdapterOptions
    ) -> None:
        for fqn, t in view.tensors.items():
            shape, pieces = view.layout(t)
            tensors.append(_tensor_item(f"{ns}/{fqn}", t, pieces, shape))
        if view.aliases:
            objects.append(SaveObject(f"{ns}/~aliases", dict(view.aliases)))
        for fqn, value in view.extra.items():
            doc, arrays = extras.encode(value, f"{ns}/{fqn}", _is_array, options.allow_pickle)
            objects.append(SaveObject(f"{ns}/{fqn}", doc))
            tensors.extend(_tensor_item(name, a) for name, a in arrays.items())

    def _save_optimizer(
        self,
        ns: str,
        opt: torch.optim.Optimizer,
        view: ModuleView,
        tensors: list,
        objects: list,
        options: AdapterOptions,
    ) -> None:
        def encode(value: Any) -> Any:  # tuples, inf/nan, non-str keys survive; arrays become lists
            return extras.encode(_plain(value), ns, lambda _: False, options.allow_pickle)[0]

        groups = []
        for group in opt.param_groups:
            fqns = [_fqn_of(view, p) for p in group["params"]]
            hyper = {k: v for k, v in group.items() if k != "params"}
            groups.append({**hyper, "params": fqns})
            for p, fqn in zip(group["params"], fqns):
                for key, value in opt.state.get(p, {}).items():
                    name = f"{ns}/{fqn}/{key}"
                    if isinstance(value, torch.Tensor):
                        shape, pieces = _state_layout(view, p, value)
                        tensors.append(_tensor_item(name, value, pieces, shape))
                    else:
                        objects.append(SaveObject(name, encode(value)))
        objects.append(SaveObject(f"{ns}/~param_groups", encode(groups)))

    # ------------------------------------------------------------------------------------------- load
    def load_job(
        self, meta: CheckpointMetadata, state: Mapping[str, Any], options: AdapterOptions
    ) -> LoadJob:
        targets: list[LoadTensor] = []
        expected: dict[str, Expected] = {}
        finishers: list[Any] = []
        optional: set[str] = set()
        views = _module_views(state)
        result = dict(state)
        for ns, value in state.items():
            if isinstance(value, torch.nn.Module):
                self._load_module(ns, views[ns], meta, targets, expected, options)
            elif isinstance(value, torch.optim.Optimizer):
                finishers.append(
                    self._load_optimizer(
                        ns, value, _owner_view(views, value), meta, targets, expected, optional, options
                    )
                )
            elif _is_state_dict(ns, value):
                for fqn, t in value.items():
                    name = _mapped(f"{ns}/{fqn}", options)
                    if name is None:
                        continue
                    shape, pieces = layout(t)
                    expected[name] = Expected(shape, _dtype_name(t))
                    targets.append(LoadTensor(name, [load_shard(box, v) for box, v in pieces]))
            else:
                finishers.append(self._load_extra(ns, value, meta, targets, expected, result, options))

        def finish() -> dict[str, Any]:
            for f in finishers:
                f()
            return result

        return LoadJob(targets, expected, set(state), finish, optional)

    def _load_module(self, ns, view, meta, targets, expected, options) -> None:
        for fqn, t in view.tensors.items():
            name = f"{ns}/{fqn}"
            stored = _mapped(name, options)
            if stored is None:
                continue
            shape, pieces = view.layout(t)
            expected[stored] = Expected(shape, _dtype_name(t))
            targets.append(LoadTensor(stored, [load_shard(box, v) for box, v in pieces]))
        for fqn in view.extra:
            expected[f"{ns}/{fqn}"] = Expected()
        if f"{ns}/~aliases" in meta.objects:
            expected[f"{ns}/~aliases"] = Expected()

    def _load_optimizer(self, ns, opt, view, meta, targets, expected, optional, options):
        stored_groups = meta.objects.get(f"{ns}/~param_groups")
        plan: list[tuple[torch.Tensor, str, torch.Tensor]] = []
        for group in opt.param_groups:
            for p in group["params"]:
                fqn = _fqn_of(view, p)
                prefix = f"{ns}/{fqn}/"
                keys = sorted(
                    {
                        n[len(prefix) :]
                        for n in list(meta.tensors) + list(meta.objects)
                        if n.startswith(prefix)
                    }
                )
                current = opt.state.get(p, {})
                for key in keys:
                    name = prefix + key
                    if name in meta.objects:
                        expected[name] = Expected()
                        plan.append((p, key, None))
                        continue
                    tm = meta.tensors[name]
                    t = current.get(key)
                    if not isinstance(t, torch.Tensor):
                        t = _new_state_tensor(view, p, tm)
                    shape, pieces = _state_layout(view, p, t)
                    expected[name] = Expected(shape, _dtype_name(t))
                    targets.append(LoadTensor(name, [load_shard(box, v) for box, v in pieces]))
                    plan.append((p, key, t))
        if stored_groups is not None:
            expected[f"{ns}/~param_groups"] = Expected()

        def finish() -> None:
            for p, key, t in plan:
                stored = meta.objects[f"{ns}/{_fqn_of(view, p)}/{key}"] if t is None else None
                value = t if t is not None else extras.decode(stored.value, {}, options.allow_pickle)
                opt.state.setdefault(p, {})[key] = value
            if stored_groups is None:
                return
            saved_groups = extras.decode(stored_groups.value, {}, options.allow_pickle)
            by_params = {tuple(g["params"]): g for g in saved_groups}
            for i, group in enumerate(opt.param_groups):
                fqns = tuple(_fqn_of(view, p) for p in group["params"])
                saved = by_params.get(fqns) or (saved_groups[i] if i < len(saved_groups) else None)
                if saved:
                    for k, v in saved.items():
                        if k != "params":
                            group[k] = _restore_like(group.get(k), v)

        return finish

    def _load_extra(self, ns, value, meta, targets, expected, result, options):
        obj = meta.objects.get(ns)
        expected[ns] = Expected()
        if obj is None:
            return lambda: None
        loaded: dict[str, Any] = {}
        for ref in extras.array_refs(obj.value):
            tm = meta.tensors[ref]
            expected[ref] = Expected(tm.shape, tm.dtype)
            buf = np.empty(tm.shape, dtype=np.dtype(_np_dtype(tm.dtype)))
            loaded[ref] = buf
            targets.append(
                LoadTensor(
                    ref, [LoadShard(Box.full(tm.shape), _fill(buf))] if buf.size or tm.shape == () else []
                )
            )

        def finish() -> None:
            arrays = {k: as_torch(v).clone() for k, v in loaded.items()}
            decoded = extras.decode(obj.value, arrays, options.allow_pickle)
            if isinstance(value, dict) and isinstance(decoded, dict):
                value.clear()
                value.update(decoded)
                result[ns] = value
            else:
                result[ns] = decoded

        return finish


def _fill(buf: np.ndarray):
    def sink(arr: np.ndarray) -> None:
        buf[...] = arr

    return sink


def _np_dtype(name: str) -> np.dtype:
    from ...codecs import numpy_dtype as nd

    return nd(name)


def _mapped(name: str, options: AdapterOptions) -> str | None:
    return options.key_map(name) if options.key_map else name


def _module_views(state: Mapping[str, Any]) -> dict[str, ModuleView]:
    return {ns: ModuleView(v) for ns, v in state.items() if isinstance(v, torch.nn.Module)}


def _owner_view(views: dict[str, ModuleView], opt: torch.optim.Optimizer) -> ModuleView:
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for view in views.values():
        if params & set(view.param_fqn):
            return view
    raise ValueError(
        "the optimizer's parameters belong to no module in the state; save the model in the same call, "
        "e.g. acp.save(path, {'model': model, 'optimizer': optimizer}), so optimizer state is keyed by FQN"
    )


def _fqn_of(view: ModuleView, p: torch.Tensor) -> str:
    try:
        return view.param_fqn[id(p)]
    except KeyError:
        raise ValueError("an optimizer parameter is not a parameter of the saved model") from None


def _state_layout(view: ModuleView, p: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, ...], list]:
    """Optimizer state follows its parameter's layout when it has the parameter's local shape."""
    if is_dtensor(t) or t.dim() == 0 or tuple(t.shape) != tuple(p.shape):
        return layout(t)
    return layout(t, view.fragment_of(p))


def _new_state_tensor(view: ModuleView, p: torch.Tensor, tm: Any) -> torch.Tensor:
    """An empty state tensor laid out like ``p`` (param-shaped state) or a replicated one (scalars etc.)."""
    from .tensors import torch_dtype

    dtype = torch_dtype(_np_dtype(tm.dtype))
    frag = view.fragment_of(p)
    global_shape = frag.shape if frag is not None else tuple(p.shape)
    if tm.shape == global_shape and tm.shape != ():
        return torch.zeros_like(p, dtype=dtype)
    return torch.zeros(tm.shape, dtype=dtype)


def _plain(v: Any) -> Any:
    """Tensors inside optimizer hyper-parameters and state become Python numbers/lists (JSON-able)."""
    if isinstance(v, torch.Tensor):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (list, tuple)):
        return type(v)(_plain(x) for x in v)
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _restore_like(current: Any, saved: Any) -> Any:
    if isinstance(current, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    return saved


def _is_state_dict(ns: str, value: Any) -> bool:
    """A ``model`` entry given as a state dict (FQN -> tensor/DTensor) rather than a module."""
    return (
        ns == "model"
        and isinstance(value, Mapping)
        and all(isinstance(v, torch.Tensor) for v in value.values())
    )
