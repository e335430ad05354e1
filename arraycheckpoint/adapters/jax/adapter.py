"""The JAX adapter: pytrees of ``jax.Array`` (any sharding) to and from the engine's items.

Names: each top-level entry of the state is a namespace; a leaf's pytree key path is joined with ``.``
beneath it, so ``{"model": {"layers": [{"w": x}]}}`` stores ``model/layers.0.w``, the FQN torch gives the
same parameter. Dicts, lists, tuples, NamedTuples, dataclasses and registered pytree nodes (flax/optax
states) all flatten through :mod:`jax.tree_util`.

* Save: every distinct addressable shard of a ``jax.Array`` is one region (``shard.index``); replicas on other
  processes are reported too and the planner writes each region once, balancing writers. Non-array leaves
  (ints, strings, ...) are JSON objects. A namespace holding no ``jax.Array`` at all (``extra_state``) is
  stored the way the torch adapter stores it (one JSON document plus arrays), so both frameworks read it.
* Load: targets are ``jax.ShapeDtypeStruct`` (with ``.sharding``), concrete arrays (their shardings are
  used) or numpy arrays (read whole); each process reads only the distinct regions its addressable devices
  hold and gets new arrays back. A namespace without jax leaves whose name is a stored JSON document loads
  as that document (torch ``extra_state``). ``allow_cast`` converts dtypes; ``transforms`` maps a target
  name to a function applied to the *whole* stored tensor (already cast to the target dtype): a layout
  change such as transposing torch ``Linear.weight [out, in]`` into a flax ``Dense.kernel [in, out]`` moves
  every region, so a transformed tensor is read in full on every process and then sliced; untransformed
  tensors read only their own regions.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import jax
import numpy as np

from ...codecs import numpy_dtype
from ...errors import ArrayCheckpointError
from ...format import extras
from ...format.metadata import CheckpointMetadata
from ...planning.items import LoadShard, LoadTensor, SaveObject, SaveRequest, SaveTensor
from ...planning.regions import Box
from ..base import INDIVISIBLE_MODES, Adapter, AdapterOptions, Expected, LoadJob
from .arrays import (
    aligned_empty,
    assemble,
    flatten,
    is_array_target,
    is_jax_array,
    is_key,
    key_data_target,
    leaf_names,
    local_boxes,
    save_tensor,
    stored_dtype_name,
    target_sharding,
)

Transform = Callable[[np.ndarray], np.ndarray]


def is_jax_state(state: Mapping[str, Any]) -> bool:
    """True when any leaf of ``state`` is a ``jax.Array`` or a ``jax.ShapeDtypeStruct``."""
    return any(
        isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) for leaf in jax.tree_util.tree_leaves(dict(state))
    )


def _host_array(x: Any) -> bool:
    return isinstance(x, (np.ndarray, jax.Array))


class JaxAdapter(Adapter):
    """Translates pytrees of jax arrays.

    Args:
        transforms: target name -> function of the full stored host array returning the target's global
            layout (merged with ``AdapterOptions.transforms``).
        indivisible: ``"error"`` (default) or ``"replicate"``: what to do with a ``NamedSharding`` target
            dimension that does not divide by its mesh axis.
    """

    framework = "jax"

    def __init__(self, transforms: Mapping[str, Transform] | None = None, indivisible: str = "error") -> None:
        if indivisible not in INDIVISIBLE_MODES:
            raise ValueError(f"indivisible must be one of {INDIVISIBLE_MODES}, got {indivisible!r}")
        self.transforms = dict(transforms or {})
        self.indivisible = indivisible

    # ------------------------------------------------------------------------------------------- save
    def save_request(self, state: Mapping[str, Any], options: AdapterOptions) -> SaveRequest:
        tensors: list[SaveTensor] = []
        objects: list[SaveObject] = []
        for ns, value in state.items():
            flat, _ = flatten(value)
            if not any(is_jax_array(leaf) for _, leaf in flat):
                doc, arrays = extras.encode(value, ns, _host_array, options.allow_pickle)
                objects.append(SaveObject(ns, doc))
                tensors.extend(save_tensor(n, np.asarray(a)) for n, a in arrays.items())
                continue
            for (_path, leaf), (name, _legacy) in zip(flat, leaf_names(ns, value, flat)):
                if isinstance(leaf, jax.ShapeDtypeStruct):
                    raise ArrayCheckpointError(
                        f"{name}: a jax.ShapeDtypeStruct has no values to save; pass the concrete jax.Array"
                    )
                if isinstance(leaf, (jax.Array, np.ndarray)):
                    tensors.append(save_tensor(name, jax.random.key_data(leaf) if is_key(leaf) else leaf))
                else:
                    doc, _ = extras.encode(leaf, name, lambda _: False, options.allow_pickle)
                    objects.append(SaveObject(name, doc))
        topology = {"jax_process_count": jax.process_count(), "jax_device_count": jax.device_count()}
        return SaveRequest(tensors, objects, framework=self.framework, step=options.step, topology=topology)

    # ------------------------------------------------------------------------------------------- load
    def load_job(
        self, meta: CheckpointMetadata, state: Mapping[str, Any], options: AdapterOptions
    ) -> LoadJob:
        transforms = {**dict(options.transforms), **self.transforms}
        indivisible = getattr(options, "indivisible", None) or self.indivisible  # if AdapterOptions grows it
        targets: list[LoadTensor] = []
        expected: dict[str, Expected] = {}
        finishers: list[Callable[[], None]] = []
        result: dict[str, Any] = dict(state)
        for ns, value in state.items():
            flat, treedef = flatten(value)
            abstract_or_jax = any(isinstance(leaf, (jax.Array, jax.ShapeDtypeStruct)) for _, leaf in flat)
            if not abstract_or_jax and (ns in meta.objects or not flat):
                finishers.append(self._load_extra(ns, value, meta, targets, expected, result, options))
                continue
            leaves = [leaf for _, leaf in flat]
            setters: list[tuple[int, Callable[[], Any]]] = []
            for i, ((_path, leaf), (name, legacy)) in enumerate(zip(flat, leaf_names(ns, value, flat))):
                stored = options.key_map(name) if options.key_map else name
                if (
                    legacy is not None
                    and stored == name
                    and name not in meta.tensors
                    and legacy in meta.tensors
                ):
                    stored = (
                        legacy  # an nnx variable saved before it was named by its path (``<path>.value``)
                    )
                if stored is None:
                    continue
                if is_array_target(leaf) and not is_key(leaf) and _only_object(meta, stored):
                    expected[stored] = Expected()  # a plain value saved where the target holds an array
                    setters.append((i, _value_as_array(meta, name, stored, leaf, indivisible, options)))
                elif not is_array_target(leaf) and stored in meta.tensors:
                    expected[stored] = Expected()  # an array saved where the target holds a plain value
                    got: dict[str, np.ndarray] = {}
                    full = Box.full(meta.tensors[stored].shape)
                    targets.append(LoadTensor(stored, [LoadShard(full, _keep(got, "full"))]))
                    setters.append((i, _array_as_value(name, got, leaf, options)))
                elif is_array_target(leaf):
                    impl = None
                    if is_key(leaf):  # loads as its key data, wrapped back into keys
                        leaf, impl = key_data_target(name, leaf)
                    load = _ArrayLoad(name, stored, leaf, transforms.get(name), indivisible, options)
                    expected[stored] = load.expected()
                    targets.append(load.target(meta))
                    setters.append((i, load.build if impl is None else _wrapped_keys(load.build, impl)))
                else:
                    expected[stored] = Expected()
                    setters.append((i, _object_getter(meta, stored, leaf, options)))
            finishers.append(_tree_finisher(ns, treedef, leaves, setters, result))

        def finish() -> dict[str, Any]:
            for f in finishers:
                f()
            return result

        return LoadJob(targets, expected, set(state), finish)

    def _load_extra(self, ns, value, meta, targets, expected, result, options) -> Callable[[], None]:
        """A namespace without arrays to shard: the torch-compatible JSON document plus host arrays."""
        obj = meta.objects.get(ns)
        expected[ns] = Expected()
        if obj is None:
            return lambda: None
        buffers: dict[str, dict[str, np.ndarray]] = {}
        for ref in extras.array_refs(obj.value, where=ns):
            tm = extras.referenced(meta.tensors, ref, ns)
            expected[ref] = Expected(tm.shape, tm.dtype)
            got = buffers[ref] = {}
            targets.append(LoadTensor(ref, [LoadShard(Box.full(tm.shape), _keep(got, "full"))]))

        def finish() -> None:
            arrays = {k: v["full"] for k, v in buffers.items() if "full" in v}
            result[ns] = extras.decode(obj.value, arrays, options.allow_pickle)

        return finish


def _wrapped_keys(build: Callable[[], Any], impl: str) -> Callable[[], Any]:
    """``build``'s key data as keys of ``impl`` (a key the checkpoint does not hold stays the target's)."""

    def get() -> Any:
        data = build()
        return data if data is _NOT_LOADED else jax.random.wrap_key_data(data, impl=impl)

    return get


@dataclass
class _ArrayLoad:
    """One array leaf of the load target: the regions to read and how to build the new array."""

    name: str
    stored: str
    leaf: Any
    transform: Transform | None
    indivisible: str
    options: AdapterOptions
    got: dict[Box, np.ndarray] = field(default_factory=dict)
    boxes: list[Box] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.shape = tuple(int(s) for s in self.leaf.shape)
        self.dtype = np.dtype(self.leaf.dtype)
        self.numpy = isinstance(self.leaf, np.ndarray)
        self.sharding = None if self.numpy else target_sharding(self.name, self.leaf, self.indivisible)

    def expected(self) -> Expected:
        if self.transform is not None:
            return Expected()  # shape/dtype are checked after the transform
        return Expected(self.shape, stored_dtype_name(f"{self.name} (the load target)", self.dtype))

    def target(self, meta: CheckpointMetadata) -> LoadTensor:
        tm = meta.tensors.get(self.stored)
        if tm is None:
            return LoadTensor(self.stored, [])
        if self.transform is not None or self.numpy:
            self.boxes = [Box.full(tm.shape)]
            shared: set[Box] = set()
        else:
            boxes = list(local_boxes(self.sharding, self.shape).values())
            self.boxes = sorted(set(boxes))
            shared = {b for b in self.boxes if boxes.count(b) > 1}
        # the engine reads straight into 64-byte-aligned host buffers, which jax then adopts without a copy
        # (it copies anything less aligned). A region several devices hold (replication) is read into a
        # plain array that jax copies per device: one host buffer aliased by several device arrays is not
        # safe to donate.
        direct = numpy_dtype(tm.dtype) == self.dtype
        shards = []
        for b in self.boxes:
            if b.volume == 0:
                continue
            sink = _keep(self.got, b, self.dtype, self.options.allow_cast, self.name)
            if direct and b not in shared:
                buf = aligned_empty(b.lengths, self.dtype)
                self.got[b] = buf
                shards.append(LoadShard(b, sink, target=buf))
            else:
                shards.append(LoadShard(b, sink))
        return LoadTensor(self.stored, shards)

    def build(self) -> Any:
        if not self.boxes or not all(b in self.got or b.volume == 0 for b in self.boxes):
            return _NOT_LOADED
        if self.transform is not None:
            full = np.asarray(self.transform(self.got[self.boxes[0]]))
            if tuple(full.shape) != self.shape:
                raise ArrayCheckpointError(
                    f"tensor {self.name!r}: the transform returned shape {list(full.shape)}, the target has "
                    f"{list(self.shape)}"
                )
            full = _cast(full, self.dtype, self.name, self.options.allow_cast)
            if self.numpy:
                return np.array(full)
            return assemble(self.shape, self.dtype, self.sharding, lambda b: full[b.slices()])
        if self.numpy:
            return self.got.get(self.boxes[0], np.zeros(self.shape, self.dtype))
        return assemble(self.shape, self.dtype, self.sharding, self._region)

    def _region(self, box: Box) -> np.ndarray:
        if box.volume == 0:
            return np.zeros(box.lengths, self.dtype)
        return self.got[box]


_NOT_LOADED = object()


def _keep(
    got: dict, key: Any, dtype: np.dtype | None = None, allow_cast: bool = True, name: str = ""
) -> Callable[[np.ndarray], None]:
    def sink(arr: np.ndarray) -> None:
        got[key] = arr if dtype is None else _cast(arr, dtype, name, allow_cast)

    return sink


def _cast(arr: np.ndarray, dtype: np.dtype, name: str, allow_cast: bool) -> np.ndarray:
    if arr.dtype == dtype:
        return arr
    if not allow_cast:
        raise ArrayCheckpointError(
            f"tensor {name!r}: stored dtype {arr.dtype} != target dtype {dtype} (pass allow_cast=True to convert)"
        )
    return arr.astype(dtype)


def _only_object(meta: CheckpointMetadata, stored: str) -> bool:
    return stored not in meta.tensors and stored in meta.objects


def _stored_value(meta: CheckpointMetadata, stored: str, options: AdapterOptions) -> Any:
    obj = meta.objects[stored]
    value = obj.value if obj.scope == "global" else next(iter(obj.per_rank.values()), None)
    return extras.decode(value, {}, options.allow_pickle)


def _value_as_array(
    meta: CheckpointMetadata, name: str, stored: str, leaf: Any, indivisible: str, options: AdapterOptions
) -> Callable[[], Any]:
    """An array target whose checkpoint entry is a plain value (``step`` saved as an int): that value as an
    array of the target's shape, dtype (exactly, unless ``allow_cast``) and sharding."""

    def get() -> Any:
        value = _stored_value(meta, stored, options)
        shape, dtype = tuple(int(s) for s in leaf.shape), np.dtype(leaf.dtype)
        raw = np.asarray(value) if isinstance(value, (bool, int, float, list, np.ndarray)) else None
        if raw is None or raw.dtype == object or raw.shape != shape:
            raise ArrayCheckpointError(
                f"{name!r}: the checkpoint holds the value {value!r} (shape {list(np.shape(value))}), the target "
                f"an array of shape {list(shape)}"
            )
        arr = raw.astype(dtype)
        if not options.allow_cast and not _same_values(arr, raw):
            raise ArrayCheckpointError(
                f"{name!r}: the stored value {value!r} is not exactly a {dtype} (pass allow_cast=True to convert)"
            )
        if isinstance(leaf, np.ndarray):
            return arr
        return jax.device_put(arr, target_sharding(name, leaf, indivisible))

    return get


def _array_as_value(
    name: str, got: dict[str, np.ndarray], leaf: Any, options: AdapterOptions
) -> Callable[[], Any]:
    """A plain-value target (``step = 0`` of a fresh ``TrainState``) whose checkpoint entry is an array:
    for a ``bool``, ``int`` or ``float`` target a 0-d array as a value of the target's type (exactly, unless
    ``allow_cast``; any other shape is an error), for any other target the numpy array saved."""

    def get() -> Any:
        if "full" not in got:
            return _NOT_LOADED
        arr = np.asarray(got["full"])
        if not isinstance(leaf, (bool, int, float)):
            return arr
        kind = type(leaf).__name__
        if arr.ndim != 0:
            raise ArrayCheckpointError(
                f"{name!r}: the checkpoint holds a {arr.dtype} array of shape {list(arr.shape)}, which does not "
                f"fit the target's plain {kind}"
            )
        stored = arr.item()  # a Python number: compared with the converted value exactly (int to float too)
        try:
            value = type(leaf)(stored)
        except (TypeError, ValueError, OverflowError) as e:
            raise ArrayCheckpointError(
                f"{name!r}: the stored {arr.dtype} value {stored!r} is no {kind}: {e}"
            ) from None
        same = value == stored or (value != value and stored != stored)  # NaN is NaN
        if not options.allow_cast and not same:
            raise ArrayCheckpointError(
                f"{name!r}: the stored {arr.dtype} value {stored!r} is not exactly a {kind} "
                "(pass allow_cast=True to convert)"
            )
        return value

    return get


def _same_values(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether ``a`` holds exactly the values of ``b`` (NaN equal to NaN)."""
    with np.errstate(invalid="ignore"):
        same = a == b
    if a.dtype.kind in "fc" or b.dtype.kind in "fc":
        same = same | (np.isnan(a.astype(np.complex128)) & np.isnan(b.astype(np.complex128)))
    return bool(np.all(same))


def _object_getter(
    meta: CheckpointMetadata, stored: str, leaf: Any, options: AdapterOptions
) -> Callable[[], Any]:
    def get() -> Any:
        obj = meta.objects.get(stored)
        if obj is None:
            return _NOT_LOADED
        value = obj.value if obj.scope == "global" else next(iter(obj.per_rank.values()), None)
        return extras.decode(value, {}, options.allow_pickle)

    return get


def _tree_finisher(ns, treedef, leaves, setters, result) -> Callable[[], None]:
    def finish() -> None:
        out = list(leaves)
        for i, build in setters:
            value = build()
            if value is not _NOT_LOADED:
                out[i] = value
        result[ns] = jax.tree_util.tree_unflatten(treedef, out)

    return finish
