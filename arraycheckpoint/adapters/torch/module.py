"""torch modules and optimizers as named tensors: FQN clean-up, tied weights, FSDP1 flat fragments.

This module reads framework objects and produces names, layouts and sinks; it does no I/O.
"""

from __future__ import annotations

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
        for p, shape, info in zip(params, flat._shapes, flat._shard_param_infos):
            start, stop = (
                (info.intra_param_start_idx, info.intra_param_end_idx + 1) if info.in_shard else (0, 0)
            )
            out[id(p)] = FlatFragment(tuple(int(s) for s in shape), start, stop)
    return out


def is_fsdp1(model: torch.nn.Module) -> bool:
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    except ImportError:  # pragma: no cover
        return False
    return any(isinstance(m, FSDP) for m in model.modules())


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
            if isinstance(t, torch.Tensor):
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
