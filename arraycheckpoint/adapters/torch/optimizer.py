"""torch optimizers: per-parameter state keyed by the parameter's FQN, hyper-parameters as JSON.

Saved as ``<ns>/<fqn>/<key>`` (a tensor in its parameter's layout, or a JSON object) plus
``<ns>/~param_groups``. On load the state of a parameter follows the parameter: the stored name of its
state is derived from the stored name the parameter itself loads from (``key_map``, tied aliases), and a
parameter that is skipped (shape mismatch with ``strict=False``, ``key_map`` returning None) skips its
state too. A strict load compares each parameter's state keys with the target optimizer's. No I/O here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import InconsistentCheckpointError, InvalidStateError, StateMismatchError
from ...format import extras
from ...format.metadata import CheckpointMetadata
from ...planning.items import LoadTensor, SaveObject, SaveTensor
from ..base import AdapterOptions, Expected
from .common import dtype_name, np_dtype, tensor_item
from .module import ModuleView, StoredNames
from .tensors import is_dtensor, layout, load_shard

GROUPS = "~param_groups"


def owner(views: dict[str, ModuleView], opt: torch.optim.Optimizer) -> tuple[str, ModuleView]:
    """The namespace and view of the module in the state that owns ``opt``'s parameters."""
    params = {id(p) for g in opt.param_groups for p in g["params"]}
    for ns, view in views.items():
        if params & set(view.param_fqn):
            return ns, view
    raise InvalidStateError(
        "the optimizer's parameters belong to no module in the state: pass the model in the same call, "
        "e.g. acp.save(path, {'model': model, 'optimizer': optimizer}), so optimizer state is keyed by FQN"
    )


def fqn_of(view: ModuleView, p: torch.Tensor) -> str:
    try:
        return view.param_fqn[id(p)]
    except KeyError:
        raise InvalidStateError(
            "an optimizer parameter is not a parameter of the model passed with it: pass the module whose "
            "parameters the optimizer was built from"
        ) from None


def _follows_param(p: torch.Tensor, t: torch.Tensor) -> bool:
    """Optimizer state follows its parameter's layout when it has the parameter's local shape."""
    return not (is_dtensor(t) or t.dim() == 0 or tuple(t.shape) != tuple(p.shape))


def state_layout(view: ModuleView, p: torch.Tensor, t: torch.Tensor) -> tuple[tuple[int, ...], list]:
    """Global shape and local pieces of state ``t`` of parameter ``p`` (see :func:`_follows_param`)."""
    return layout(t, view.fragment_of(p)) if _follows_param(p, t) else layout(t)


def save_optimizer(
    ns: str,
    opt: torch.optim.Optimizer,
    view: ModuleView,
    tensors: list[SaveTensor],
    objects: list[SaveObject],
    options: AdapterOptions,
) -> None:
    """Append ``opt``'s state (keyed by FQN) and param groups to the save lists."""

    def encode(value: Any) -> Any:  # tuples, inf/nan, non-str keys survive; arrays become lists
        return extras.encode(_plain(value), ns, lambda _: False, options.allow_pickle)[0]

    groups = []
    for group in opt.param_groups:
        fqns = [fqn_of(view, p) for p in group["params"]]
        hyper = {k: v for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": fqns})
        for p, fqn in zip(group["params"], fqns):
            for key, value in opt.state.get(p, {}).items():
                name = f"{ns}/{fqn}/{key}"
                if isinstance(value, torch.Tensor):
                    shape, pieces = state_layout(view, p, value)
                    rule = view.rule_of(p) if _follows_param(p, value) else None
                    tensors.append(tensor_item(name, value, pieces, shape, rule))
                else:
                    objects.append(SaveObject(name, encode(value)))
    objects.append(SaveObject(f"{ns}/{GROUPS}", encode(groups)))


def load_optimizer(
    ns: str,
    opt: torch.optim.Optimizer,
    model_ns: str,
    view: ModuleView,
    meta: CheckpointMetadata,
    names: StoredNames,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
    dropped: set[str],
    options: AdapterOptions,
) -> Callable[[], None]:
    """Plan reading ``opt``'s state; the returned ``finish`` installs it (skipping ``dropped`` entries).

    Expected keys are target names (``<ns>/<target fqn>/<key>``); each parameter's entries form one group
    that requires the parameter's own entry (``<model_ns>/<fqn>``), so they load all-or-nothing with it.
    """
    by_stored_prefix: dict[str, list[str]] = {}
    for n in list(meta.tensors) + list(meta.objects):
        head, _, key = n.rpartition("/")
        if head.startswith(ns + "/") and "/" not in key:
            by_stored_prefix.setdefault(head, []).append(key)
    sources = {id(p): names(f"{model_ns}/{fqn_of(view, p)}") for g in opt.param_groups for p in g["params"]}
    stored_fqn = {
        id(p): _stored_fqn(sources[id(p)], model_ns, fqn_of(view, p))
        for g in opt.param_groups
        for p in g["params"]
        if sources[id(p)] is not None
    }
    stored_groups = meta.objects.get(f"{ns}/{GROUPS}")
    saved_groups = extras.decode(stored_groups.value, {}, options.allow_pickle) if stored_groups else []
    _check_groups(f"{ns}/{GROUPS}", saved_groups)
    if stored_groups is not None:
        expected[f"{ns}/{GROUPS}"] = Expected()
    plan: list[tuple[torch.Tensor, str, torch.Tensor | None, str]] = []
    restore: list[tuple[dict[str, Any], dict[str, Any], list[str]]] = []  # (group, saved, its entry groups)
    for i, group in enumerate(opt.param_groups):
        fqns = tuple(stored_fqn.get(id(p), fqn_of(view, p)) for p in group["params"])
        saved = _saved_group(saved_groups, i, fqns)
        # the state keys the optimizer will keep once the saved hyper-parameters are restored
        hyper = {k: v for k, v in {**group, **(saved or {})}.items() if k != "params"}
        probes: dict[int, set[str] | None] = {}  # by parameter rank: state can depend on it (Adafactor)
        entry_groups = []
        for p in group["params"]:
            fqn = fqn_of(view, p)
            if id(p) not in stored_fqn:
                continue  # key_map skips the parameter: its state stays as it is
            keys = sorted(by_stored_prefix.get(f"{ns}/{stored_fqn[id(p)]}", []))
            if not keys:
                continue
            if p.dim() not in probes:
                probes[p.dim()] = _probe_state_keys(opt, hyper, p)
            current = opt.state.get(p, {})
            target_keys = probes[p.dim()] if probes[p.dim()] is not None else (set(current) or None)
            group_name = f"{ns}/{fqn}"
            entry_groups.append(group_name)
            if target_keys is not None and target_keys != set(keys):
                expected[group_name] = Expected(
                    problem=(
                        f"per-parameter state keys differ: checkpoint {keys}, target "
                        f"{type(opt).__name__} {sorted(target_keys)} (build the optimizer the checkpoint was "
                        "saved with, or pass strict=False to load without this state)"
                    ),
                    group=group_name,
                )
            plan += _plan_state(
                ns,
                p,
                current,
                fqn,
                stored_fqn[id(p)],
                keys,
                view,
                meta,
                f"{model_ns}/{fqn}",
                sources[id(p)],
                targets,
                expected,
            )
        if saved:
            saved = _matching_hyper(
                f"{ns}/{GROUPS}[{saved_groups.index(saved)}]", group, saved, options.strict
            )
            restore.append((group, saved, entry_groups))
    _account_untied(ns, model_ns, view, names, by_stored_prefix, expected)

    def finish() -> None:
        for p, key, t, name in plan:
            if name in dropped:
                continue
            if t is None:
                value = extras.decode(meta.objects[expected[name].stored].value, {}, options.allow_pickle)
            else:
                value = t
            opt.state.setdefault(p, {})[key] = value
        for group, saved, entry_groups in restore:
            if any(g in dropped for g in entry_groups):
                continue  # a group whose state did not match keeps its own hyper-parameters too
            for k, v in saved.items():
                if k != "params":
                    group[k] = _restore_like(group.get(k), v)

    return finish


def _stored_fqn(source: str, model_ns: str, fqn: str) -> str:
    return source[len(model_ns) + 1 :] if source.startswith(model_ns + "/") else fqn  # model_ns may nest


def _saved_group(saved_groups: list[Any], i: int, fqns: tuple[str, ...]) -> dict[str, Any] | None:
    """The stored group with the same (stored) parameter names, else the ``i``-th one."""
    for g in saved_groups:
        if isinstance(g, dict) and tuple(g.get("params", ())) == fqns:
            return g
    return saved_groups[i] if i < len(saved_groups) and isinstance(saved_groups[i], dict) else None


def _plan_state(
    ns: str,
    p: torch.Tensor,
    current: dict[str, Any],
    fqn: str,
    sfqn: str,
    keys: list[str],
    view: ModuleView,
    meta: CheckpointMetadata,
    param_name: str,
    param_source: str,
    targets: list[LoadTensor],
    expected: dict[str, Expected],
) -> list[tuple[torch.Tensor, str, torch.Tensor | None, str]]:
    """Plan reading parameter ``p``'s stored state ``keys``; returns ``(param, key, tensor or None, name)``.

    Entries are keyed ``<ns>/<fqn>/<key>`` (target names), grouped per parameter and requiring the
    parameter's own entry ``param_name`` (stored as ``param_source``).
    """
    plan: list[tuple[torch.Tensor, str, torch.Tensor | None, str]] = []
    stored_param = meta.tensors.get(param_source)
    for key in keys:
        stored = f"{ns}/{sfqn}/{key}"
        name = f"{ns}/{fqn}/{key}"
        entry = Expected(stored=stored, group=f"{ns}/{fqn}", requires=param_name)
        if stored in meta.objects:
            plan.append((p, key, None, name))
        else:
            tm = meta.tensors[stored]
            t = current.get(key)
            if not isinstance(t, torch.Tensor):
                t = _new_state_tensor(view, p, tm, stored_param)
            shape, pieces = state_layout(view, p, t)
            read = LoadTensor(stored, [load_shard(box, v) for box, v in pieces])
            targets.append(read)
            entry.shape, entry.dtype, entry.reads = shape, dtype_name(t), [read]
            plan.append((p, key, t, name))
        expected[name] = entry
    return plan


def _account_untied(
    ns: str,
    model_ns: str,
    view: ModuleView,
    names: StoredNames,
    by_stored_prefix: dict[str, list[str]],
    expected: dict[str, Expected],
) -> None:
    """State stored for a parameter the target ties to another: accounted for, not loaded.

    The tied target parameter has one state (its primary's); the checkpoint's separate state of the
    other name has no place to go and is not an unexpected key.
    """
    for alias in view.aliases:
        source = names(f"{model_ns}/{alias}")
        if source is None or not source.startswith(model_ns + "/"):
            continue
        sfqn = source[len(model_ns) + 1 :]
        for key in by_stored_prefix.get(f"{ns}/{sfqn}", []):
            expected.setdefault(f"{ns}/{alias}/{key}", Expected(stored=f"{ns}/{sfqn}/{key}"))


def _probe_state_keys(
    opt: torch.optim.Optimizer, hyper: dict[str, Any], param: torch.Tensor
) -> set[str] | None:
    """The per-parameter state keys ``opt``'s class creates for ``param`` under ``hyper`` (None if unknowable).

    A fresh optimizer has no state to compare with, so one step of a twin optimizer of the same class, with
    the hyper-parameters the group will have after the load, on a private one-element parameter of
    ``param``'s rank, dtype and device shows the keys; the real parameters are untouched.
    """
    try:
        local = getattr(param, "_local_tensor", param)
        dummy = torch.zeros((1,) * param.dim(), dtype=local.dtype, device=local.device, requires_grad=True)
        twin = type(opt)([dummy], **opt.defaults)
        twin.param_groups[0].update(hyper)
        dummy.grad = torch.zeros_like(dummy)
        twin.step()
        return set(twin.state.get(dummy, {}))
    except Exception:  # noqa: BLE001 - an optimizer we cannot twin: nothing to compare with
        return None


def _new_state_tensor(view: ModuleView, p: torch.Tensor, tm: Any, stored_param: Any) -> torch.Tensor:
    """An empty state tensor laid out like ``p`` (parameter-shaped state) or a replicated one (scalars etc.).

    State is parameter-shaped when it has the stored parameter's shape: it then takes the *target*
    parameter's shape, so a parameter whose shape changed is reported rather than given misshapen state.
    """
    from .tensors import torch_dtype

    dtype = torch_dtype(np_dtype(tm.dtype))
    frag = view.fragment_of(p)
    global_shape = frag.shape if frag is not None else tuple(p.shape)
    param_shaped = tm.shape != () and (
        tm.shape == global_shape or (stored_param is not None and tm.shape == stored_param.shape)
    )
    if param_shaped:
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


def _check_groups(name: str, groups: Any) -> None:
    """The stored param groups are a list of objects whose ``params`` (where given) are names: anything else
    is damage, named (it was a bare ``KeyError: 0``, or silently nothing restored)."""
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise InconsistentCheckpointError(
            f"{name} is not a list of param groups (objects); the checkpoint is damaged"
        )
    for i, g in enumerate(groups):
        params = g.get("params", [])
        if not isinstance(params, list) or not all(isinstance(p, str) for p in params):
            raise InconsistentCheckpointError(f"{name}[{i}]: 'params' is not a list of parameter names")


def _like(current: Any, saved: Any) -> bool:
    """Whether hyper-parameter value ``saved`` can stand where the optimizer holds ``current``: a number for a
    number (or a 0-d tensor), a bool for a bool, a string for a string, a sequence of as many for a tuple;
    anything where either is None or of a type not known here."""
    if current is None or saved is None:
        return True
    if isinstance(current, bool):
        return isinstance(saved, bool)
    if isinstance(current, int | float) or (isinstance(current, torch.Tensor) and current.dim() == 0):
        return isinstance(saved, int | float) and not isinstance(saved, bool)
    if isinstance(current, str):
        return isinstance(saved, str)
    if isinstance(current, tuple | list):
        return (
            isinstance(saved, tuple | list)
            and len(saved) == len(current)
            and all(_like(c, v) for c, v in zip(current, saved, strict=True))
        )
    return True


def _matching_hyper(name: str, group: dict[str, Any], saved: dict[str, Any], strict: bool) -> dict[str, Any]:
    """``saved`` without hyper-parameters of another kind than the optimizer's own (``lr: "fast"`` loaded,
    then the first ``step()`` failed far from the load): strict, a :class:`StateMismatchError` naming them;
    otherwise they keep the optimizer's values."""
    bad = sorted(k for k, v in saved.items() if k != "params" and k in group and not _like(group[k], v))
    if bad and strict:
        raise StateMismatchError(
            f"{name}: hyper-parameter(s) of another kind than the optimizer's: "
            + ", ".join(f"{k}={saved[k]!r} (the optimizer has {group[k]!r})" for k in bad)
            + "; the checkpoint was saved from another optimizer or is damaged (pass strict=False to keep the "
            "optimizer's values for these)"
        )
    return {k: v for k, v in saved.items() if k not in bad}


def _restore_like(current: Any, saved: Any) -> Any:
    if isinstance(current, torch.Tensor):
        return torch.tensor(saved, dtype=current.dtype, device=current.device)
    return saved
