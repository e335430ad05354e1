"""torch tensors as regions: dtype mapping, host copies in and out, and the layout of a (sharded) tensor.

A tensor's layout is the list of ``(global box, local view)`` pairs it holds on this rank:

* a plain tensor holds its whole box (under DDP every rank holds it: a replica the planner writes once);
* a DTensor holds the box ``compute_local_shape_and_global_offset`` gives for its mesh and placements;
* an FSDP1 original parameter (``use_orig_params=True``) holds a flat element range of the unsharded
  parameter, decomposed into at most ``2 * ndim - 1`` regular boxes (see :func:`flat_range_to_boxes`).
"""

from __future__ import annotations

import sys
import weakref
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np
import torch

from ...errors import UnsupportedDTypeError
from ...planning.items import ArraySource, LoadShard
from ...planning.regions import Box, flat_range_to_boxes
from ...planning.rules import Mesh

_TORCH_TO_NUMPY: dict[torch.dtype, np.dtype] = {
    torch.float32: np.dtype(np.float32),
    torch.float64: np.dtype(np.float64),
    torch.float16: np.dtype(np.float16),
    torch.bfloat16: np.dtype(ml_dtypes.bfloat16),
    torch.float8_e4m3fn: np.dtype(ml_dtypes.float8_e4m3fn),
    torch.float8_e5m2: np.dtype(ml_dtypes.float8_e5m2),
    torch.int8: np.dtype(np.int8),
    torch.int16: np.dtype(np.int16),
    torch.int32: np.dtype(np.int32),
    torch.int64: np.dtype(np.int64),
    torch.uint8: np.dtype(np.uint8),
    torch.bool: np.dtype(np.bool_),
    torch.complex64: np.dtype(np.complex64),
    torch.complex128: np.dtype(np.complex128),
}
for _t, _n in (
    ("float8_e4m3fnuz", "float8_e4m3fnuz"),
    ("float8_e5m2fnuz", "float8_e5m2fnuz"),
    ("uint16", "uint16"),
    ("uint32", "uint32"),
    ("uint64", "uint64"),
):
    if hasattr(torch, _t):
        _TORCH_TO_NUMPY[getattr(torch, _t)] = np.dtype(getattr(ml_dtypes, _n, None) or getattr(np, _n))
_NUMPY_TO_TORCH = {v: k for k, v in _TORCH_TO_NUMPY.items()}
# numpy has no bfloat16/float8: move their bytes through a same-width integer view
_BITS = {1: (np.uint8, torch.uint8), 2: (np.int16, torch.int16)}


def numpy_dtype(dtype: torch.dtype) -> np.dtype:
    """The numpy (ml_dtypes) dtype of a torch dtype; raises naming the dtype when there is none."""
    try:
        return _TORCH_TO_NUMPY[dtype]
    except KeyError:
        raise UnsupportedDTypeError(f"torch dtype {dtype} has no checkpoint representation") from None


def torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy (ml_dtypes) dtype; raises :class:`UnsupportedDTypeError` naming it when torch
    has none (``float8_e3m4``, ``float8_e4m3b11fnuz``: a JAX checkpoint may hold them)."""
    try:
        return _NUMPY_TO_TORCH[np.dtype(dtype)]
    except KeyError:
        raise UnsupportedDTypeError(f"torch has no dtype for {np.dtype(dtype).name}") from None


def _exotic(dtype: np.dtype) -> bool:
    known = _EXOTIC.get(dtype)
    if known is None:
        known = _EXOTIC[dtype] = dtype.kind == "V" or dtype.type.__module__.startswith("ml_dtypes")
    return known


#: dtype -> whether numpy lacks it (:func:`_exotic`), asked once per tensor of a save or load
_EXOTIC: dict[np.dtype, bool] = {}


def as_torch(arr: np.ndarray) -> torch.Tensor:
    """A torch view of a host numpy array (bfloat16/float8 through an integer view), of the same shape."""
    arr = np.ascontiguousarray(arr).reshape(np.shape(arr))  # ascontiguousarray makes a 0-d array 1-d
    if _exotic(arr.dtype):
        np_int, _ = _BITS[arr.dtype.itemsize]
        return torch.from_numpy(arr.view(np_int)).view(torch_dtype(arr.dtype))
    return torch.from_numpy(arr)


def host_view(out: np.ndarray) -> torch.Tensor:
    """A torch tensor aliasing ``out`` so torch can copy into it (no copy of its own)."""
    if _exotic(out.dtype):
        np_int, _ = _BITS[out.dtype.itemsize]
        return torch.from_numpy(out.view(np_int)).view(torch_dtype(out.dtype))
    return torch.from_numpy(out)


@dataclass
class TorchSource:
    """Copies a (possibly strided, possibly CUDA) tensor region into a host buffer.

    CUDA regions are copied asynchronously on a side stream into pinned memory (see
    :mod:`arraycheckpoint.adapters.torch.device`): :meth:`copy_into` then returns the copy's fence.
    """

    tensor: torch.Tensor

    def __post_init__(self) -> None:
        if self.tensor.is_cuda:
            from .device import use_cuda

            use_cuda()  # before the engine takes the staging buffers: they come pinned

    def borrowed_view(self) -> np.ndarray | None:
        """The tensor's own host memory as numpy (CPU tensors only), for saves the caller waits for."""
        t = self.tensor
        if t.requires_grad:
            t = t.detach()
        if t.device.type != "cpu" or t.is_conj() or t.is_neg():
            return None
        np_dtype = numpy_dtype(t.dtype)
        if _exotic(np_dtype):
            _, torch_int = _BITS[np_dtype.itemsize]
            return t.view(torch_int).numpy().view(np_dtype)
        return t.numpy()

    def region(self, shape: tuple[int, ...], index: tuple[slice, ...]) -> TorchSource | None:
        """A source of the part ``index`` of this region seen with ``shape`` (its box's lengths), or None when
        the tensor cannot be viewed with that shape (the engine then copies the whole region)."""
        t = self.tensor.detach()
        if tuple(t.shape) != tuple(shape):
            try:
                t = t.view(shape)
            except RuntimeError:
                return None
        return TorchSource(t[index])

    def copy_into(self, out: np.ndarray) -> Any:
        """Fill ``out``; returns None when done, or a fence (``wait()``) for an asynchronous device copy."""
        src = self.tensor.detach()
        dst = host_view(out)
        if src.is_cuda:
            from .device import snapshot_copy

            return snapshot_copy(src, dst)
        dst.copy_(src.reshape(dst.shape))
        return None


@dataclass
class NumpySource(ArraySource):
    """A host numpy array of torch state, in native byte order: a blocking save writes from its memory."""

    def copy_into(self, out: np.ndarray) -> None:
        np.copyto(out, np.asarray(self.array).reshape(out.shape), casting="equiv")

    def borrowed_view(self) -> np.ndarray | None:
        return np.asarray(self.array)

    def region(self, shape: tuple[int, ...], index: tuple[slice, ...]) -> NumpySource | None:
        sub = ArraySource.region(self, shape, index)
        return NumpySource(sub.array) if sub is not None else None


def load_shard(box: Box, view: torch.Tensor) -> Any:
    """A :class:`LoadShard` filling ``view`` in place.

    CPU views are read into directly, without a copy; CUDA views are read into a pinned pool buffer and
    copied to the device asynchronously (the caller's stream waits for the copy on the device).
    """

    if view.is_cuda:
        from .device import staging_buffer, use_cuda

        use_cuda()
        return LoadShard(box, _device_sink(view), staging=staging_buffer)
    target = TorchSource(view).borrowed_view() if box.volume else None
    return LoadShard(box, sink_for(view), target)


def _device_sink(view: torch.Tensor) -> Any:
    from .device import upload

    def sink(arr: np.ndarray) -> None:
        upload(view, as_torch(arr), arr)

    return sink


def sink_for(view: torch.Tensor) -> Any:
    """A load sink that copies a host array into ``view`` in place (casting if dtypes differ)."""

    def sink(arr: np.ndarray) -> None:
        with torch.no_grad():
            view.copy_(as_torch(arr).reshape(view.shape))

    return sink


@dataclass(frozen=True)
class FlatFragment:
    """This rank's slice of a flattened parameter (FSDP1): elements ``[start, stop)`` of ``shape``.

    ``rule`` is the layout rule every rank of the FSDP group shares (``("range", Mesh, offset, total)``, see
    :mod:`arraycheckpoint.planning.rules`), or None when it is not known.
    """

    shape: tuple[int, ...]
    start: int
    stop: int
    rule: tuple[Any, ...] | None = None


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor, without importing ``torch.distributed.tensor`` (and sympy) for a state that
    has none: a DTensor can only exist once that module was imported."""
    mod = sys.modules.get("torch.distributed.tensor")
    cls = getattr(mod, "DTensor", None) if mod is not None else None
    return cls is not None and isinstance(t, cls)


#: per device mesh: ``(global shape, placements)`` -> this rank's box (torch computes it in ~12 us through its
#: mesh layouts; a save asks once per tensor, and every parameter of a layer shares the mesh)
_LOCAL_BOXES: weakref.WeakKeyDictionary[Any, dict[tuple[Any, ...], Box]] = weakref.WeakKeyDictionary()
#: device mesh -> its shape and ranks as :class:`arraycheckpoint.planning.rules.Mesh` (``DeviceMesh.mesh``
#: rebuilds the rank tensor on every access: ~18 us)
_MESHES: weakref.WeakKeyDictionary[Any, Mesh] = weakref.WeakKeyDictionary()


def mesh_of(mesh: Any) -> Mesh:
    """``mesh`` (a torch ``DeviceMesh``) as a rule's :class:`~arraycheckpoint.planning.rules.Mesh`, computed
    once per mesh."""
    out = _MESHES.get(mesh)
    if out is None:
        out = _MESHES[mesh] = Mesh(
            tuple(int(s) for s in mesh.shape), tuple(int(r) for r in mesh.mesh.flatten().tolist())
        )
    return out


def _local_box(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...], compute: Any) -> Box:
    """This rank's box of a DTensor of global ``shape`` on ``mesh`` with ``placements``, cached per mesh under
    the rank's coordinate in it: meshes compare equal whatever rank this process is (a process that plays
    several ranks in turn, an in-process restart), and the box depends on the coordinate."""
    key = (shape, placements, mesh.get_coordinate())
    boxes = _LOCAL_BOXES.get(mesh)
    if boxes is None:
        boxes = _LOCAL_BOXES[mesh] = {}
    try:
        box = boxes.get(key)
    except TypeError:  # a placement that cannot be hashed: computed every time
        boxes, box = {}, None
    if box is None:
        local_shape, offset = compute(shape, mesh, placements)
        box = boxes[key] = Box(tuple(int(o) for o in offset), tuple(int(s) for s in local_shape))
    return box


def layout(
    t: torch.Tensor, fragment: FlatFragment | None = None
) -> tuple[tuple[int, ...], list[tuple[Box, torch.Tensor]]]:
    """Global shape of ``t`` and the ``(box, local view)`` pairs this rank holds."""
    if fragment is not None:
        local = t.detach().reshape(-1)
        pieces = []
        cursor = 0
        for box in flat_range_to_boxes(fragment.shape, fragment.start, fragment.stop):
            n = box.volume
            pieces.append((box, local[cursor : cursor + n].view(box.lengths)))
            cursor += n
        return fragment.shape, pieces
    if is_dtensor(t):
        from torch.distributed.tensor import Partial
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(isinstance(p, Partial) for p in t.placements):
            raise ValueError(
                "a DTensor with Partial placement holds unreduced values; reduce it before saving"
            )
        shape = tuple(t.shape)
        box = _local_box(shape, t.device_mesh, tuple(t.placements), compute_local_shape_and_global_offset)
        local = t._local_tensor.detach()
        if box.volume == 0:
            return shape, []
        return shape, [(box, local.reshape(box.lengths))]
    shape = tuple(t.shape)
    return shape, [(Box.full(shape), t.detach())]
