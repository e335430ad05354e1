"""torch modules and optimizers as named tensors: FQN clean-up, tied weights, FSDP1 flat fragments.

This module reads framework objects and produces names, layouts and sinks; it does no I/O.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any

import torch

from .tensors import FlatFragment, layout

_WRAPPER_PREFIXES = ("_fsdp_wrapped_module.", "_checkpoint_wrapped_module.", "_orig_mod.")


def clean_fqn(name: str) -> str:
    """Strip wrapper components (FSDP1, activation checkpointing, torch.compile) from a parameter name."""
    for p in _WRAPPER_PREFIXES:
        name = name.replace(p, "")
    return name


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside DDP (``.module``); FSDP wrappers are handled by name clean-up."""
    from torch.nn.parallel import DistributedDataParallel

    while isinstance(model, DistributedDataParallel):
        model = model.module
    return model


def fsdp1_fragments(model: torch.nn.Module) -> dict[int, FlatFragment]:
    """``id(orig_param) -> FlatFragment`` for every FSDP1 (``use_orig_params=True``) parameter in ``model``."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return {}
    out: dict[int, FlatFragment] = {}
    for m in FSDP.fsdp_modules(model):
        handle = getattr(m, "_handle", None)
        if handle is None:
            continue
        flat = handle.flat_param
        params = getattr(flat, "_params", None)
        if params is None:
            raise ValueError(
                "FSDP1 model without use_orig_params=True: wrap it with use_orig_params=True so each "
                "parameter is addressable by name"
            )
        rules = flat_range_rules(handle)
        for i, (p, shape, info) in enumerate(zip(params, flat._shapes, flat._shard_param_infos)):
            start, stop = (
                (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            )
            rule = rules[i] if rules is not None else None
            out[id(p)] = FlatFragment(tuple(int(s) for s in shape), start, stop, rule)
    return out


def flat_range_rules(handle: Any) -> list[tuple[Any, ...]] | None:
    """``("range", Mesh, offset, total)`` per original parameter of an FSDP1 flat parameter, or None.

    FSDP1 concatenates the parameters (with alignment padding between them and world-size padding at the
    end: ``_numels_with_padding``) and gives rank ``i`` of its process group chunk ``i`` of
    ``torch.chunk(flat, world_size)``; every rank of the group knows these numbers, so every rank states
    the same rule. The engine checks it against the range this rank really holds.
    """
    import torch.distributed as dist

    from ...planning.rules import Mesh

    flat = handle.flat_param
    numels = getattr(flat, "_numels_with_padding", None)
    padding = getattr(flat, "_is_padding_mask", None)
    group = getattr(handle, "process_group", None)
    if numels is None or padding is None or group is None or not dist.is_initialized():
        return None
    if not getattr(handle, "uses_sharded_strategy", True):
        return None  # NO_SHARD: every rank holds every parameter whole (declared as a replica)
    try:
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
    except Exception:  # noqa: BLE001 - a group we cannot enumerate: declare boxes
        return None
    if len(ranks) != int(handle.world_size):
        return None
    mesh = Mesh((len(ranks),), ranks)
    total = sum(int(n) for n in numels)
    rules, offset = [], 0
    for n, is_pad in zip(numels, padding):
        if not is_pad:
            rules.append(("range", mesh, offset, total))
        offset += int(n)
    return rules


def is_fsdp1(model: torch.nn.Module) -> bool:
    """Whether ``model`` contains FSDP1 wrappers.

    Looked up in ``sys.modules``, never imported: an FSDP1 module can only exist once its package was imported,
    and importing ``torch.distributed.fsdp`` (which pulls in DTensor and sympy) cost a fresh process's first
    load seconds for a plain module.
    """
    fsdp = sys.modules.get("torch.distributed.fsdp")
    cls = getattr(fsdp, "FullyShardedDataParallel", None) if fsdp is not None else None
    return cls is not None and any(isinstance(m, cls) for m in model.modules())


def _is_extra_state(fqn: str) -> bool:
    """Whether ``fqn`` is a module's ``get_extra_state()`` (``state_dict`` names it ``<module>._extra_state``).

    Extra state may be a tensor (Transformer Engine serialises its FP8 metadata into a ``uint8`` tensor); it is
    still no parameter: ``get_extra_state`` builds it afresh on every call, so a load that filled the target's
    copy in place filled a temporary and never called ``set_extra_state`` (the saved state was lost)."""
    return fqn.rsplit(".", 1)[-1] == "_extra_state"


class ModuleView:
    """Named tensors of a module (params and persistent buffers), deduplicated, with their layouts."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = unwrap(model)
        self.fragments = fsdp1_fragments(self.model) if is_fsdp1(self.model) else {}
        self.tensors: dict[str, torch.Tensor] = {}
        self.aliases: dict[str, str] = {}
        self.extra: dict[str, Any] = {}
        seen: dict[int, str] = {}
        for raw, t in self._named_state():
            fqn = clean_fqn(raw)
            if isinstance(t, torch.Tensor) and not _is_extra_state(fqn):
                if id(t) in seen:
                    self.aliases[fqn] = seen[id(t)]
                    continue
                seen[id(t)] = fqn
                self.tensors[fqn] = t
            else:
                self.extra[fqn] = t
        self.param_fqn = {id(p): fqn for fqn, p in self.tensors.items()}

    def _named_state(self) -> Iterator[tuple[str, Any]]:
        if self.fragments:
            # FSDP1: module.state_dict() would all-gather; walk the original parameters instead.
            yield from self.model.named_parameters(remove_duplicate=False)
            persistent = {
                f"{mn}.{bn}" if mn else bn
                for mn, m in self.model.named_modules()
                for bn, _ in m.named_buffers(recurse=False)
                if bn not in m._non_persistent_buffers_set
            }
            for name, b in self.model.named_buffers(remove_duplicate=False):
                if name in persistent:
                    yield name, b
            return
        yield from self.model.state_dict(keep_vars=True).items()

    def layout(self, t: torch.Tensor) -> tuple[tuple[int, ...], list]:
        """Global shape and local ``(box, view)`` pairs of one of this module's tensors (or a same-layout one)."""
        return layout(t, self.fragments.get(id(t)))

    def fragment_of(self, param: torch.Tensor) -> FlatFragment | None:
        return self.fragments.get(id(param))

    def rule_of(self, param: torch.Tensor) -> tuple[Any, ...] | None:
        """The layout rule of an FSDP1 parameter's flat range (None for anything else)."""
        frag = self.fragments.get(id(param))
        return frag.rule if frag is not None else None


def _is_meta(t: torch.Tensor) -> bool:
    local = getattr(t, "_local_tensor", t)  # a DTensor's own storage
    return bool(local.is_meta)


def non_persistent_buffers(model: torch.nn.Module) -> set[str]:
    """Names of ``model``'s non-persistent buffers (never saved: rotary ``inv_freq``, causal masks...)."""
    return {
        f"{mn}.{bn}" if mn else bn
        for mn, m in model.named_modules()
        for bn in m._non_persistent_buffers_set
        if m._buffers.get(bn) is not None
    }


def materialise(model: torch.nn.Module, ns: str, device: Any) -> None:
    """Give a module built on the meta device real (uninitialised) storage for the checkpoint to fill.

    Without ``device`` a module with meta tensors is refused: filling meta tensors in place would load
    nothing. Non-persistent buffers are not in any checkpoint, so a meta one is refused too (naming it):
    its value comes from the module's own initialisation, which only the caller can re-run.

    Raises:
        MetaDeviceError: naming the meta tensors and the fix.
    """
    from ...errors import MetaDeviceError

    model = unwrap(model)
    metas = [clean_fqn(n) for n, t in _all_tensors(model) if _is_meta(t)]
    if not metas:
        return
    shown = ", ".join(f"{ns}/{n}" for n in metas[:8]) + (
        f" (+{len(metas) - 8} more)" if len(metas) > 8 else ""
    )
    if device is None:
        raise MetaDeviceError(
            f"{shown}: on the meta device, where loading would fill nothing. Pass device=... to acp.load "
            f"(e.g. device='cuda') to materialise {ns!r} from the checkpoint, or call "
            f"{ns}.to_empty(device=...) yourself first"
        )
    lost = sorted(clean_fqn(n) for n in non_persistent_buffers(model) if _is_meta(_get(model, n)))
    if lost:
        raise MetaDeviceError(
            f"{', '.join(f'{ns}/{n}' for n in lost)}: non-persistent buffers on the meta device. They are not "
            "saved in checkpoints, so materialising from one would leave them uninitialised: call "
            f"{ns}.to_empty(device=...), re-run their initialisation (e.g. recompute rotary inv_freq), then load"
        )
    # to_empty re-allocates every tensor: keep the real non-persistent buffers of a partly-meta module
    kept = {n: _get(model, n).detach().clone() for n in non_persistent_buffers(model)}
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(
        True
    )  # keep each Parameter object: optimizers hold them
    try:
        model.to_empty(device=device)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)
    with torch.no_grad():
        for n, value in kept.items():
            _get(model, n).copy_(value)


def _all_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=True)
    yield from model.named_buffers(remove_duplicate=True)


def _get(model: torch.nn.Module, name: str) -> torch.Tensor:
    mod, _, leaf = name.rpartition(".")
    return getattr(model.get_submodule(mod) if mod else model, leaf)


class StoredNames:
    """Target name -> checkpoint entry: the caller's ``key_map``, then the checkpoint's tied-weight aliases.

    A checkpoint stores tied weights once (``<ns>/~aliases`` maps the other names to the stored one), so a
    target where they are separate parameters reads the one stored tensor into each.
    """

    def __init__(self, meta: Any, key_map: Any) -> None:
        self.meta = meta
        self.key_map = key_map

    def __call__(self, name: str) -> str | None:
        stored = self.key_map(name) if self.key_map else name
        if stored is None or stored in self.meta.tensors:
            return stored
        ns, _, fqn = stored.rpartition("/")  # a module nested in a dict: ns is its path (ema/m)
        primary = self.aliases(ns).get(fqn)
        return f"{ns}/{primary}" if isinstance(primary, str) else stored

    def aliases(self, ns: str) -> dict[str, Any]:
        """The stored alias table of namespace ``ns`` (``{alias_fqn: stored_fqn}``), empty when untied."""
        obj = self.meta.objects.get(f"{ns}/~aliases")
        return obj.value if obj is not None and isinstance(obj.value, dict) else {}
