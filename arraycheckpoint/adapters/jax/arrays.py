"""jax.Array leaves as regions: pytree names, shard boxes, target shardings and array assembly.

Pure translation between JAX objects and :mod:`arraycheckpoint.planning.items`; no I/O, no collectives.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np

from ...codecs import zarr_dtype_name
from ...errors import ArrayCheckpointError, UnsupportedDTypeError
from ...planning.items import ArraySource, SaveShard, SaveTensor
from ...planning.regions import Box
from .sharding_rule import sharding_rule


def key_name(key: Any) -> str:
    """One pytree path entry as a name component (dict key, sequence index, attribute, flattened index)."""
    for attr in ("key", "idx", "name"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key).strip(".[]'\"")


def leaf_name(ns: str, path: Sequence[Any]) -> str:
    """``model`` + ``(DictKey('layers'), SequenceKey(0), DictKey('w'))`` -> ``model/layers.0.w`` (torch FQN style)."""
    return f"{ns}/{'.'.join(key_name(k) for k in path)}" if path else ns


def leaf_names(
    ns: str, tree: Any, flat: Sequence[tuple[tuple[Any, ...], Any]]
) -> list[tuple[str, str | None]]:
    """Each leaf's ``(name, legacy name or None)``.

    A flax ``nnx.Variable`` (the leaves of an ``nnx.State``: ``Param``, ``BatchStat``, ...) flattens to its
    ``.value``: its array is named by the variable's path (``model/dense.kernel``, the name torch and a plain
    pytree give it), not ``model/dense.kernel.value``; that older name is returned as the legacy name, for
    checkpoints saved before.
    """
    variables = _nnx_variable_paths(tree)
    out: list[tuple[str, str | None]] = []
    for path, _leaf in flat:
        if variables and len(path) > 1 and tuple(path[:-1]) in variables:
            out.append((leaf_name(ns, path[:-1]), leaf_name(ns, path)))
        else:
            out.append((leaf_name(ns, path), None))
    return out


def _nnx_variable_paths(tree: Any) -> set[tuple[Any, ...]]:
    """Paths of the flax ``nnx.Variable`` nodes in ``tree`` (empty when flax.nnx was never imported)."""
    nnx = sys.modules.get("flax.nnx")
    variable = getattr(nnx, "Variable", None) if nnx is not None else None
    if variable is None:
        return set()
    flat, _ = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, variable))
    return {tuple(path) for path, leaf in flat if isinstance(leaf, variable)}


def flatten(tree: Any) -> tuple[list[tuple[tuple[Any, ...], Any]], Any]:
    """``(path, leaf)`` pairs of ``tree`` and its treedef."""
    return jax.tree_util.tree_flatten_with_path(tree)


def is_jax_array(x: Any) -> bool:
    return isinstance(x, jax.Array)


def is_array_target(x: Any) -> bool:
    """Leaves that load as arrays: jax arrays, abstract ``ShapeDtypeStruct`` and numpy arrays."""
    return isinstance(x, (jax.Array, jax.ShapeDtypeStruct, np.ndarray))


def is_key(x: Any) -> bool:
    """Whether ``x`` is a typed PRNG key array (``jax.random.key``; flax ``nnx.Rngs`` streams), concrete or
    abstract: stored as its key data (``jax.random.key_data``: uint32, one trailing dimension more)."""
    dtype = getattr(x, "dtype", None)
    try:
        return dtype is not None and bool(jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key))
    except TypeError:
        return False


def key_data_target(name: str, leaf: Any) -> tuple[Any, str]:
    """The target a typed key leaf loads through: its key data's shape, dtype and sharding, and the name of
    its PRNG implementation (to wrap the loaded data back into keys)."""
    if isinstance(leaf, jax.Array):
        return jax.random.key_data(leaf), str(jax.random.key_impl(leaf))
    impl = getattr(getattr(leaf.dtype, "_impl", None), "name", None)  # jax.random.key_impl takes arrays only
    if impl is None:
        raise ArrayCheckpointError(f"{name}: cannot tell the PRNG implementation of the key target {leaf}")
    data = jax.eval_shape(jax.random.key_data, leaf)
    # the key's own sharding: a NamedSharding's spec leaves the trailing key dimension whole
    return jax.ShapeDtypeStruct(data.shape, data.dtype, sharding=getattr(leaf, "sharding", None)), impl


def box_of(index: tuple[slice, ...], shape: Sequence[int]) -> Box:
    """The global box of a shard index (a tuple of slices, possibly open-ended)."""
    offsets, lengths = [], []
    for sl, dim in zip(index, shape):
        start, stop, step = sl.indices(dim)
        if step != 1:
            raise ArrayCheckpointError(f"a shard index with step {step} is not a regular region")
        offsets.append(start)
        lengths.append(max(0, stop - start))
    return Box(tuple(offsets), tuple(lengths))


class JaxShardSource(ArraySource):
    """One device buffer of a ``jax.Array``.

    ``stable_view`` offers the engine a host view it may write from without a staging copy: jax arrays are
    immutable, and on the CPU backend ``numpy.asarray`` aliases the device buffer (a donated buffer that is
    still referenced this way is not reused by XLA). On accelerators it returns None and the engine copies
    into its staging buffers as usual.
    """

    def stable_view(self) -> np.ndarray | None:
        if self.array.device.platform != "cpu":
            return None
        return np.asarray(self.array)


def stored_dtype_name(name: str, dtype: np.dtype) -> str:
    """The zarr v3 data type name of ``dtype``; raises :class:`UnsupportedDTypeError` naming the array
    ``name`` when the format has none (``int4``, ``float4_e2m1fn``, ``float8_e8m0fnu``)."""
    try:
        return zarr_dtype_name(dtype)
    except UnsupportedDTypeError as e:
        raise UnsupportedDTypeError(f"{name}: {e}") from None


def save_tensor(name: str, value: Any) -> SaveTensor:
    """A :class:`SaveTensor` for a jax or numpy array: one shard per distinct addressable region.

    Replicas on several local devices are reported once (the planner balances writes across processes;
    copying the same region twice into host memory would only cost time). Replicas on other processes are
    reported by those processes, and the planner writes each region once.
    """
    shape = tuple(int(s) for s in value.shape)
    dtype = np.dtype(value.dtype)
    stored_dtype_name(name, dtype)  # int4, float4, ...: refused here, naming the array
    if isinstance(value, np.ndarray):
        return SaveTensor(name, shape, dtype, [SaveShard(Box.full(shape), ArraySource(value))])
    shards: list[SaveShard] = []
    seen: set[Box] = set()
    for shard in value.addressable_shards:
        box = box_of(shard.index, shape)
        if box in seen:
            continue
        seen.add(box)
        shards.append(SaveShard(box, JaxShardSource(shard.data)))
    return SaveTensor(name, shape, dtype, shards, sharding_rule(value))


def target_sharding(name: str, leaf: Any, indivisible: str) -> jax.sharding.Sharding:
    """The sharding a loaded leaf gets, checked for even division.

    A ``ShapeDtypeStruct`` without a sharding loads onto the first local device. A ``NamedSharding`` whose
    dimension does not divide by its mesh axes raises (naming the tensor and the axis), or with
    ``indivisible="replicate"`` that dimension is replicated instead.
    """
    sharding = getattr(leaf, "sharding", None)
    if sharding is None:
        return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    shape = tuple(leaf.shape)
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = list(sharding.spec) + [None] * (len(shape) - len(sharding.spec))
        changed = False
        for dim, entry in enumerate(spec):
            axes = _axes(entry)
            if not axes:
                continue
            parts = math.prod(sharding.mesh.shape[a] for a in axes)
            if shape[dim] % parts == 0:
                continue
            if indivisible == "replicate":
                spec[dim] = None
                changed = True
                continue
            raise ArrayCheckpointError(
                f"tensor {name!r} (process {jax.process_index()}): dimension {dim} of size {shape[dim]} does not "
                f"divide by mesh axis {'x'.join(axes)} of size {parts} (NamedSharding spec {sharding.spec}); "
                "jax shards evenly only. Choose a spec or mesh that divides the dimension, or pass "
                "indivisible='replicate' to load that dimension replicated"
            )
        if changed:
            return jax.sharding.NamedSharding(
                sharding.mesh, jax.sharding.PartitionSpec(*spec), memory_kind=sharding.memory_kind
            )
        return sharding
    try:
        sharding.addressable_devices_indices_map(shape)
    except Exception as e:  # noqa: BLE001 - jax's IndivisibleError is private
        raise ArrayCheckpointError(
            f"tensor {name!r} (process {jax.process_index()}): its sharding cannot hold shape {list(shape)}: {e}"
        ) from e
    return sharding


def _axes(entry: Any) -> tuple[str, ...]:
    if entry is None or entry is jax.sharding.PartitionSpec.UNCONSTRAINED:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def local_boxes(sharding: jax.sharding.Sharding, shape: tuple[int, ...]) -> dict[Any, Box]:
    """``device -> box`` for every addressable device of ``sharding`` over a tensor of ``shape``."""
    return {d: box_of(idx, shape) for d, idx in sharding.addressable_devices_indices_map(shape).items()}


def assemble(
    shape: tuple[int, ...],
    dtype: np.dtype,
    sharding: jax.sharding.Sharding,
    region: Callable[[Box], np.ndarray],
) -> jax.Array:
    """A jax.Array of ``shape`` in ``sharding`` whose device buffers come from ``region(box)`` (host arrays)."""

    def data(index: tuple[slice, ...]) -> np.ndarray:
        return np.asarray(region(box_of(index, shape)), dtype=dtype)

    return jax.make_array_from_callback(shape, sharding, data)


#: jax adopts a host buffer aligned to this many bytes without copying it (and copies anything less aligned).
HOST_ALIGNMENT = 64


def aligned_empty(shape: tuple[int, ...], dtype: np.dtype, alignment: int = HOST_ALIGNMENT) -> np.ndarray:
    """An uninitialised C-contiguous host array whose data starts on an ``alignment``-byte boundary."""
    nbytes = math.prod(shape) * dtype.itemsize
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    return raw[start : start + nbytes].view(dtype).reshape(shape)
