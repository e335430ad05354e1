"""megatron-core adapter: ``sharded_state_dict()`` checkpoints that load back under any TP/PP/DP layout.

megatron-core (0.16.x) describes every rank's part of the model with a *sharded state dict*: a nested dict
whose leaves are

* ``ShardedTensor``: ``data`` (a view of the local parameter) is the box ``global_offset`` /
  ``(1,) * prepend_axis_num + local_shape`` of the global tensor ``key`` of ``global_shape``. Stacked layers
  (``decoder.layers.*``) carry ``prepend_axis_num`` leading axes the local data lacks; a
  ``flattened_range`` (older versions, distributed optimizers) is decomposed into regular boxes;
* ``ShardedObject``: an opaque value per ``(key, global_offset)``; stored once per unique key and offset as
  JSON (see :mod:`arraycheckpoint.format.extras`);
* ``ShardedTensorFactory``: built (``build_fn``) into sharded tensors on save; on load the built tensors are
  filled and ``merge_fn`` folds them back into the factory's tensor, in place;
* ``LocalNonpersistentObject``: never stored; restored from the local value.

Every replica of a region is declared on save; the planner writes each region once, choosing its writer among
all replicas by worst fit (so writes spread over the data-parallel ranks), and once the plan is cached the
snapshot copies only what this rank writes or sends. On load every rank asks for all of its regions.
Where megatron's process grids are known (:mod:`.megatron_grid`: its ``parallel_state``), each tensor's boxes
are declared as a mesh rule on a grid, so TP/PP/DP/EP ranks declare alike and nothing is gathered to plan.

Names in the checkpoint: ``<ns>/<ShardedTensor.key>`` (``model/decoder.layers.mlp.linear_fc2.weight``, with
the stacked layer axis first), ``<ns>/<key>/shard_<offset>_<shape>`` for sharded objects, and
``optimizer/<key>/<state>`` for a standard torch optimizer's per-parameter state laid out like the parameter.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch

from ...format.metadata import SAFETENSORS_FRAMEWORK, CheckpointMetadata
from ...planning.items import SaveRequest
from ..base import Adapter, AdapterOptions, LoadJob
from .megatron_optim import load_optimizer, save_optimizer
from .megatron_shards import (  # noqa: F401 - re-exported: the public names of this adapter
    STACKED,
    LoadBuilder,
    SaveBuilder,
    is_main_replica,
    is_megatron_module,
    is_megatron_state,
    is_megatron_value,
    object_name,
    sharded_state_dict_of,
    sharded_tensor_pieces,
)


# ------------------------------------------------------------------------------------------ adapter
class MegatronAdapter(Adapter):
    """megatron-core modules and sharded state dicts, optimizer state by ShardedTensor key, other state via torch.

    ``{"model": gpt_model}`` (or ``{"model": model.sharded_state_dict()}``, or a list of virtual-pipeline
    chunks), ``{"optimizer": torch_optimizer}`` over the module's parameters, and any other value (handled
    by the torch adapter: ``extra_state`` dicts etc.).
    """

    framework = "megatron"

    def save_request(self, state: Mapping[str, Any], options: AdapterOptions) -> SaveRequest:
        from .adapter import TorchAdapter

        builder = SaveBuilder(options)
        trees = {ns: sharded_state_dict_of(v) for ns, v in state.items() if is_megatron_value(v)}
        rest: dict[str, Any] = {}
        for ns, value in state.items():
            if ns in trees:
                builder.tree(ns, trees[ns])
            elif isinstance(value, torch.optim.Optimizer):
                save_optimizer(ns, value, trees, builder)
            else:
                rest[ns] = value
        tensors, objects = builder.finish()
        if rest:
            other = TorchAdapter().save_request(rest, options)
            tensors += other.tensors
            objects += other.objects
        return SaveRequest(tensors, objects, framework=self.framework, step=options.step)

    def load_job(
        self, meta: CheckpointMetadata, state: Mapping[str, Any], options: AdapterOptions
    ) -> LoadJob:
        from .adapter import TorchAdapter

        builder = LoadBuilder(meta, options)
        result = dict(state)
        trees = {ns: sharded_state_dict_of(v) for ns, v in state.items() if is_megatron_value(v)}
        steps: list[Callable[[], None]] = []
        rest: dict[str, Any] = {}
        for ns, value in state.items():
            if ns in trees:
                get = builder.tree(ns, trees[ns])
                steps.append(_finish_tree(ns, value, get, result))
            elif isinstance(value, torch.optim.Optimizer):
                steps.append(load_optimizer(ns, value, trees, builder))
            else:
                rest[ns] = value
        targets = list(builder.targets.values())
        expected = dict(builder.expected)
        namespaces: set[str] = set()  # megatron ranks hold disjoint key sets (PP): no per-rank "unexpected"
        optional: set[str] = set()
        other_finish: Callable[[], Any] = lambda: {}  # noqa: E731
        dropped: set[str] = set()
        scoped: set[str] = set()
        if rest:
            other = TorchAdapter().load_job(meta, rest, options)
            dropped, scoped = other.dropped, other.scoped  # the torch finishers read this very set
            targets += other.targets
            expected.update(other.expected)
            namespaces |= other.namespaces
            optional |= other.optional
            other_finish = other.finish

        def finish() -> dict[str, Any]:
            for step in steps:
                step()
            if rest:
                loaded = other_finish()
                result.update({k: loaded[k] for k in rest if k in loaded})
            return result

        optional |= _not_in_hf(meta, expected)
        job = LoadJob(targets, expected, namespaces, finish, optional, dropped=dropped, scoped=scoped)
        # Namespaces whose "unexpected" keys can only be judged on the union of every rank's expectations
        # (pipeline stages hold disjoint keys); read by a cross-rank check in acp.load where available.
        job.global_namespaces = set(trees) | {
            ns for ns, v in state.items() if isinstance(v, torch.optim.Optimizer)
        }
        return job


def _not_in_hf(meta: CheckpointMetadata, expected: Mapping[str, Any]) -> set[str]:
    """Expected objects a Hugging Face safetensors directory never holds: megatron's ``_extra_state``.

    TransformerEngine keeps FP8 scaling state in ``<module>._extra_state`` objects; an HF directory has
    tensors only, so a strict load from one must not ask for them (they keep their current value).
    """
    if meta.framework != SAFETENSORS_FRAMEWORK:
        return set()
    return {
        name
        for name, e in expected.items()
        if e.shape is None and any(part.endswith("_extra_state") for part in name.split("/"))
    }


def _finish_tree(ns: str, value: Any, get: Callable[[], Any], result: dict[str, Any]) -> Callable[[], None]:
    """After the reads: merge factories, set objects, and hand modules their state (tensors are in place)."""

    def step() -> None:
        loaded = get()
        if isinstance(value, torch.nn.Module):
            _apply_to_module(value, loaded)
        elif isinstance(value, (list, tuple)) and all(isinstance(m, torch.nn.Module) for m in value):
            for module, sd in zip(value, loaded):
                _apply_to_module(module, sd)
        else:
            result[ns] = loaded

    return step


def _apply_to_module(module: torch.nn.Module, loaded: Mapping[str, Any]) -> None:
    """``module.load_state_dict`` with the loaded values (tensors were filled in place; this sets extra state)."""
    module.load_state_dict(dict(loaded), strict=False)


__all__ = [
    "MegatronAdapter",
    "is_main_replica",
    "is_megatron_module",
    "is_megatron_state",
    "object_name",
    "sharded_state_dict_of",
    "sharded_tensor_pieces",
]
