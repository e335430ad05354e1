"""Translation of megatron-core sharded state dicts into regions (the part the model and optimizer share).

See :mod:`arraycheckpoint.adapters.torch.megatron` for the naming scheme and what is stored.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch

from ...errors import ArrayCheckpointError
from ...format import extras
from ...format.metadata import CheckpointMetadata
from ...planning.items import LoadShard, LoadTensor, SaveObject, SaveShard, SaveTensor
from ...planning.regions import Box, flat_range_to_boxes, intersect
from ..base import AdapterOptions, Expected
from .megatron_grid import grid_rules
from .tensors import TorchSource, as_torch, load_shard, numpy_dtype

Path = tuple[Any, ...]
STACKED = (
    "~stacked"  # per-namespace object {name: stacked-layer axes}, per rank (listing ranks: records_stacked)
)


# ------------------------------------------------------------------------------------------ detection
def megatron_mapping() -> Any:
    from megatron.core.dist_checkpointing import mapping

    return mapping


def _is_sharded_leaf(v: Any) -> bool:
    m = megatron_mapping()
    return isinstance(
        v, (m.ShardedTensor, m.ShardedObject, m.ShardedTensorFactory, m.LocalNonpersistentObject)
    )


def is_megatron_module(v: Any) -> bool:
    """True for a megatron-core module (or wrapper) that provides ``sharded_state_dict()``."""
    return isinstance(v, torch.nn.Module) and callable(getattr(v, "sharded_state_dict", None))


def _has_sharded_leaf(tree: Any, depth: int = 0) -> bool:
    if depth > 64:
        return False
    if _is_sharded_leaf(tree):
        return True
    if isinstance(tree, Mapping):
        return any(_has_sharded_leaf(v, depth + 1) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return any(_has_sharded_leaf(v, depth + 1) for v in tree)
    return False


def is_megatron_value(v: Any) -> bool:
    if isinstance(v, torch.nn.Module):
        return is_megatron_module(v)
    if isinstance(v, (list, tuple)) and v and all(isinstance(m, torch.nn.Module) for m in v):
        return all(is_megatron_module(m) for m in v)
    return isinstance(v, Mapping) and _has_sharded_leaf(v)


def is_megatron_state(state: Mapping[str, Any]) -> bool:
    """True when a value of ``state`` is a megatron module (``sharded_state_dict()``) or a sharded state dict."""
    try:
        megatron_mapping()
    except ImportError:
        return False
    return any(is_megatron_value(v) for v in state.values())


# ------------------------------------------------------------------------------------------ layouts
def global_rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


def is_main_replica(replica_id: Any) -> bool:
    """megatron's rule: the main copy has replica id ``0`` or all-zero components."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(int(r) == 0 for r in replica_id)


def records_stacked(prepended: int, boxes: list[Box]) -> bool:
    """Whether the main replica of these boxes of a stacked tensor lists it in ``~stacked``: when a box
    starts at the origin of the layer axes (after the ``prepended`` ones). One main replica holds it per
    layer, so about one rank per pipeline stage lists each tensor, not every TP and DP rank."""
    return any(not any(b.offsets[prepended:]) for b in boxes)


def sharded_tensor_pieces(st: Any) -> list[tuple[Box, torch.Tensor]]:
    """The ``(global box, local view)`` pairs of a ``ShardedTensor`` (views alias ``st.data``).

    Prepended (stacked-layer) axes become leading length-1 axes of the box; a ``flattened_range`` is
    decomposed into at most ``2 * ndim - 1`` regular boxes. Raises naming the key when a box leaves the
    global shape.
    """
    shape = tuple(int(s) for s in st.global_shape)
    offset = tuple(int(o) for o in st.global_offset)
    pre = int(st.prepend_axis_num)
    local_shape = tuple(int(s) for s in st.local_shape)
    data = st.data
    if data is None:
        raise ArrayCheckpointError(
            f"ShardedTensor {st.key!r} on rank {global_rank()} has no data; pass real tensors"
        )
    pieces: list[tuple[Box, torch.Tensor]] = []
    flat = getattr(st, "flattened_range", None)
    if flat is not None:
        flat_data = data.reshape(-1) if data.is_contiguous() else data.view(-1)
        cursor = 0
        for box in flat_range_to_boxes(local_shape, int(flat.start), int(flat.stop)):
            n = box.volume
            view = flat_data[cursor : cursor + n].view((1,) * pre + box.lengths)
            cursor += n
            gbox = Box(
                offset[:pre] + tuple(o + b for o, b in zip(offset[pre:], box.offsets)),
                (1,) * pre + box.lengths,
            )
            pieces.append((gbox, view))
    else:
        view = data[(None,) * pre] if pre else data
        pieces.append((Box(offset, (1,) * pre + local_shape), view))
    for box, _ in pieces:
        if not box.within(shape):
            raise ArrayCheckpointError(
                f"ShardedTensor {st.key!r} on rank {global_rank()}: region {box} lies outside its global shape "
                f"{list(shape)}; fix global_offset/global_shape in the module's sharded_state_dict()"
            )
    return [(b, v) for b, v in pieces if b.volume]


def _clip(pieces: list[tuple[Box, torch.Tensor]], shape: tuple[int, ...]) -> list[tuple[Box, torch.Tensor]]:
    """The parts of ``pieces`` inside a tensor of ``shape`` (views narrowed accordingly)."""
    out = []
    for box, view in pieces:
        part = intersect(box, Box.full(shape))
        if part is not None:
            out.append((part, view[part.slices(box)]))
    return out


def walk(tree: Any, path: Path = ()) -> Iterator[tuple[Path, Any]]:
    """Leaves of a nested dict/list, sharded leaves included as leaves."""
    if isinstance(tree, Mapping) and not _is_sharded_leaf(tree):
        for k, v in tree.items():
            yield from walk(v, (*path, k))
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            yield from walk(v, (*path, i))
    else:
        yield path, tree


def _rebuild(tree: Any, leaf: Callable[[Path, Any], Any], path: Path = ()) -> Any:
    """A copy of ``tree`` (dicts and lists) with every leaf replaced by ``leaf(path, value)``."""
    if isinstance(tree, Mapping) and not _is_sharded_leaf(tree):
        return {k: _rebuild(v, leaf, (*path, k)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_rebuild(v, leaf, (*path, i)) for i, v in enumerate(tree)]
    return leaf(path, tree)


def sharded_state_dict_of(value: Any) -> Any:
    """The sharded state dict of a megatron module, a list of model chunks, or a sharded dict itself."""
    if isinstance(value, torch.nn.Module):
        return value.sharded_state_dict()
    if isinstance(value, (list, tuple)) and value and all(isinstance(m, torch.nn.Module) for m in value):
        return [m.sharded_state_dict() for m in value]
    return value


def _is_array(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, np.ndarray))


def _dtype_name(dtype: torch.dtype) -> str:
    from ...codecs import zarr_dtype_name

    return zarr_dtype_name(numpy_dtype(dtype))


def object_name(ns: str, obj: Any) -> str:
    """Checkpoint name of a ``ShardedObject``: ``<ns>/<key>/shard_<offset>_<shape>`` (megatron's unique key)."""
    offset = ".".join(str(int(o)) for o in obj.global_offset) or "0"
    shape = ".".join(str(int(s)) for s in obj.global_shape) or "1"
    return f"{ns}/{obj.key}/shard_{offset}_{shape}"


# ------------------------------------------------------------------------------------------ save side
class SaveBuilder:
    """Collects one rank's tensors and objects, merging shards that share a name."""

    def __init__(self, options: AdapterOptions) -> None:
        self.options = options
        self.tensors: dict[str, SaveTensor] = {}
        self.objects: list[SaveObject] = []
        self.stacked: dict[str, dict[str, int]] = {}  # ns -> {name: prepended (stacked-layer) axes}
        self.leading: dict[str, int] = {}  # name -> prepended axes (their splits prefer pipeline / experts)

    def tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        pieces: list[tuple[Box, torch.Tensor]],
        main: bool,
    ) -> None:
        np_dtype = numpy_dtype(dtype)
        item = self.tensors.get(name)
        if item is None:
            item = self.tensors[name] = SaveTensor(name, shape, np_dtype)
        elif item.shape != shape or item.dtype != np_dtype:
            raise ArrayCheckpointError(
                f"tensor {name!r} on rank {global_rank()}: two shards disagree on the global tensor "
                f"({list(item.shape)} {item.dtype} vs {list(shape)} {np_dtype}); keys must name one global tensor"
            )
        # every replica is declared (``main`` only documents which one megatron calls the main copy): the
        # planner writes each region once and picks its writer among all holders by worst fit, so writes
        # spread over the data-parallel replicas instead of piling onto DP rank 0; the snapshot copies only
        # what this rank was assigned once the plan is cached
        del main
        known = {s.box for s in item.shards}
        item.shards.extend(SaveShard(b, TorchSource(v)) for b, v in pieces if b not in known)

    def sharded_tensor(self, name: str, st: Any) -> None:
        shape = tuple(int(s) for s in st.global_shape)
        pieces = sharded_tensor_pieces(st)
        main = is_main_replica(st.replica_id)
        self.leading[name] = int(st.prepend_axis_num)
        self.tensor(name, shape, st.data.dtype, pieces, main)
        if (
            st.prepend_axis_num
            and main
            and records_stacked(int(st.prepend_axis_num), [b for b, _v in pieces])
        ):
            self.stacked.setdefault(name.split("/", 1)[0], {})[name] = int(st.prepend_axis_num)

    def finish(self) -> tuple[list[SaveTensor], list[SaveObject]]:
        """The collected items, plus one ``<ns>/~stacked`` object per namespace (used to unstack layers).

        On megatron's process grids (:mod:`.megatron_grid`) each tensor's boxes become a mesh rule where they
        are one (the engine checks it against the boxes), so TP/PP/DP/EP ranks declare alike."""
        rules = grid_rules()
        if rules is not None:
            rules.begin()  # the budget of mesh positions is per save
            for item in self.tensors.values():
                if item.rule is None and item.shards:
                    item.rule = rules.rule(
                        item.shape, [s.box for s in item.shards], self.leading.get(item.name, 0)
                    )
        stacked = [
            SaveObject(f"{ns}/{STACKED}", dict(sorted(v.items())), scope="rank")
            for ns, v in self.stacked.items()
        ]
        return list(self.tensors.values()), self.objects + stacked

    def factory(self, factory: Any, name_of: Callable[[str], str]) -> None:
        """Save a ``ShardedTensorFactory`` as the sharded tensors its ``build_fn`` makes."""
        m = megatron_mapping()
        for _, st in walk(factory.build()):
            if isinstance(st, m.ShardedTensor):
                self.sharded_tensor(name_of(st.key), st)

    def value(self, name: str, value: Any, main: bool, scope: str = "rank") -> None:
        """A JSON value (its arrays stored as whole tensors) reported by the main replica only."""
        if not main:
            return
        doc, arrays = extras.encode(value, name, _is_array, self.options.allow_pickle)
        self.objects.append(SaveObject(name, doc, scope=scope))
        for aname, a in arrays.items():
            t = as_torch(a) if isinstance(a, np.ndarray) else a.detach()
            shape = tuple(t.shape)
            self.tensor(aname, shape, t.dtype, [(Box.full(shape), t)], True)

    def tree(self, ns: str, tree: Any) -> None:
        m = megatron_mapping()
        common: dict[str, Any] = {}
        for path, leaf in walk(tree):
            if isinstance(leaf, m.ShardedTensorFactory):
                self.factory(leaf, lambda key: f"{ns}/{key}")
            elif isinstance(leaf, m.ShardedTensor):
                self.sharded_tensor(f"{ns}/{leaf.key}", leaf)
            elif isinstance(leaf, m.ShardedObject):
                self.value(object_name(ns, leaf), leaf.data, is_main_replica(leaf.replica_id))
            elif isinstance(leaf, m.LocalNonpersistentObject):
                continue
            else:
                common[_path_key(path)] = leaf
        if common:  # megatron's "common" state: plain values, stored from rank 0 as in dist_checkpointing
            self.value(f"{ns}/~common", common, global_rank() == 0, scope="global")


def _path_key(path: Path) -> str:
    return "/".join(str(p) for p in path)


# ------------------------------------------------------------------------------------------ load side
class LoadBuilder:
    """Collects one rank's load targets and the steps that complete a load."""

    def __init__(self, meta: CheckpointMetadata, options: AdapterOptions) -> None:
        self.meta = meta
        self.options = options
        self.targets: dict[str, LoadTensor] = {}
        self.expected: dict[str, Expected] = {}
        self.finishers: list[Callable[[], None]] = []

    def mapped(self, name: str) -> str | None:
        return self.options.key_map(name) if self.options.key_map else name

    def regions(
        self, name: str, shape: tuple[int, ...], dtype: torch.dtype, pieces: list[tuple[Box, torch.Tensor]]
    ) -> bool:
        stored = self.mapped(name)
        if stored is None:
            return False
        self.expected[stored] = Expected(shape, _dtype_name(dtype))
        target = self.targets.setdefault(stored, LoadTensor(stored))
        target.shards.extend(load_shard(b, v) for b, v in pieces)
        return True

    def sharded_tensor(self, name: str, st: Any) -> None:
        shape = tuple(int(s) for s in st.global_shape)
        pieces = sharded_tensor_pieces(st)
        stored = self.mapped(name)
        tm = self.meta.tensors.get(stored) if stored is not None else None
        if getattr(st, "allow_shape_mismatch", False) and tm is not None and len(tm.shape) == len(shape):
            # e.g. a vocabulary padded differently under another TP size: load the overlap, keep the rest
            shape, pieces = tm.shape, _clip(pieces, tm.shape)
        self.regions(name, shape, st.data.dtype, pieces)

    def value(self, name: str, default: Any) -> Callable[[], Any]:
        """Expect the object ``name``; returns a getter of its decoded value (``default`` when absent)."""
        stored = self.mapped(name)
        if stored is None:
            return lambda: default
        self.expected[stored] = Expected()
        obj = self.meta.objects.get(stored)
        if obj is None:
            return lambda: default
        doc = obj.value if obj.scope == "global" else obj.per_rank[min(obj.per_rank)]
        buffers: dict[str, np.ndarray] = {}
        for ref in extras.array_refs(doc, where=stored):
            tm = self.meta.tensors.get(ref)
            if tm is None:
                continue
            self.expected[ref] = Expected(tm.shape, tm.dtype)
            from ...codecs import numpy_dtype as zarr_numpy_dtype

            buf = buffers[ref] = np.empty(tm.shape, dtype=zarr_numpy_dtype(tm.dtype))

            def fill(arr: np.ndarray, buf: np.ndarray = buf) -> None:
                buf[...] = arr

            self.targets.setdefault(ref, LoadTensor(ref)).shards.append(LoadShard(Box.full(tm.shape), fill))

        def get() -> Any:
            arrays = {k: as_torch(v).clone() for k, v in buffers.items()}
            return extras.decode(doc, arrays, self.options.allow_pickle)

        return get

    def tree(self, ns: str, tree: Any) -> Callable[[], Any]:
        """Plan loading a sharded dict in place; returns a getter of the loaded plain state dict."""
        m = megatron_mapping()
        getters: dict[Path, Callable[[], Any]] = {}
        common_paths: list[Path] = []
        for path, leaf in walk(tree):
            if isinstance(leaf, m.ShardedTensorFactory):
                getters[path] = self.factory(leaf, lambda key: f"{ns}/{key}")
            elif isinstance(leaf, m.ShardedTensor):
                self.sharded_tensor(f"{ns}/{leaf.key}", leaf)
                getters[path] = lambda leaf=leaf: leaf.data
            elif isinstance(leaf, m.ShardedObject):
                get = self.value(object_name(ns, leaf), leaf.data)

                def obj_value(leaf: Any = leaf, get: Callable[[], Any] = get) -> Any:
                    leaf.data = get()
                    return leaf.data

                getters[path] = obj_value
            elif isinstance(leaf, m.LocalNonpersistentObject):
                getters[path] = leaf.unwrap
            else:
                common_paths.append(path)
        common = self.value(f"{ns}/~common", None) if common_paths else (lambda: None)

        def result() -> Any:
            loaded_common = common() or {}

            def leaf_value(path: Path, leaf: Any) -> Any:
                if path in getters:
                    return getters[path]()
                return loaded_common.get(_path_key(path), leaf)

            return _rebuild(tree, leaf_value)

        return result

    def factory(self, factory: Any, name_of: Callable[[str], str]) -> Callable[[], Any]:
        """Load a ``ShardedTensorFactory``: fill its built tensors; the getter merges them into ``factory.data``."""
        m = megatron_mapping()
        built = factory.build()
        for _, st in walk(built):
            if isinstance(st, m.ShardedTensor):
                self.sharded_tensor(name_of(st.key), st)

        def merged() -> Any:
            sub = _rebuild(built, lambda _p, st: st.data if isinstance(st, m.ShardedTensor) else st)
            value = factory.merge_fn(sub)
            target = factory.data
            if isinstance(value, torch.Tensor) and isinstance(target, torch.Tensor) and value is not target:
                with torch.no_grad():
                    target.copy_(value.reshape(target.shape))
                return target
            return value

        return merged
