"""Small helpers the torch adapter's modules share: save items of tensors, dtype names, host buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...errors import UnsupportedDTypeError
from ...planning.items import SaveShard, SaveTensor
from ...planning.regions import Box
from .dtensor_rule import dtensor_rule
from .tensors import NumpySource, TorchSource, as_torch, layout, numpy_dtype


def tensor_item(
    name: str, t: Any, pieces: list | None = None, shape: tuple | None = None, rule: tuple | None = None
) -> SaveTensor:
    """The save item of tensor ``t`` (numpy arrays too); a DTensor contributes only its local box.

    ``rule`` is the layout rule of ``pieces`` when the caller knows one (an FSDP1 flat range); a DTensor's
    rule is derived here. A numpy array is written from its own memory in its own dtype (those torch lacks,
    such as ``float8_e3m4``, included), as one replicated box."""
    if isinstance(t, np.ndarray) and pieces is None:
        arr = native(np.asarray(t))
        return SaveTensor(
            name, arr.shape, array_dtype(name, arr.dtype), [SaveShard(Box.full(arr.shape), NumpySource(arr))]
        )
    if isinstance(t, np.ndarray):
        t = as_torch(t)
    try:
        dtype = numpy_dtype(t.dtype)
    except UnsupportedDTypeError as e:  # the dtype alone did not say which of a model's tensors it was
        raise UnsupportedDTypeError(
            f"{name}: {e} (convert it, e.g. .view(torch.uint8), before saving)"
        ) from None
    if pieces is None:
        shape, pieces = layout(t)
    return SaveTensor(
        name=name,
        shape=shape,
        dtype=dtype,
        shards=[SaveShard(box, TorchSource(view)) for box, view in pieces],
        rule=rule if rule is not None else dtensor_rule(t),
    )


def dtype_name(t: torch.Tensor) -> str:
    """The zarr v3 data type name of a torch tensor's dtype."""
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        from ...codecs import zarr_dtype_name

        name = _DTYPE_NAMES[t.dtype] = zarr_dtype_name(numpy_dtype(t.dtype))
    return name


#: torch dtype -> zarr v3 data type name (asked once per tensor of a load or save)
_DTYPE_NAMES: dict[torch.dtype, str] = {}


def native(arr: np.ndarray) -> np.ndarray:
    """``arr`` in native byte order (a copy only where it is not: checkpoints are little-endian)."""
    return arr if arr.dtype.isnative else arr.astype(arr.dtype.newbyteorder("="))


def array_dtype(name: str, dtype: np.dtype) -> np.dtype:
    """The native dtype a numpy array ``name`` is stored in; raises naming the array when the format has none.

    Raises:
        UnsupportedDTypeError: naming ``name``, its dtype and the supported ones.
    """
    from ...codecs import SUPPORTED_DTYPES, zarr_dtype_name

    dtype = dtype.newbyteorder("=") if not dtype.isnative else dtype
    try:
        zarr_dtype_name(dtype)
    except (ValueError, TypeError):
        raise UnsupportedDTypeError(
            f"{name}: numpy dtype {dtype} cannot be stored in a checkpoint; supported: "
            + ", ".join(SUPPORTED_DTYPES)
        ) from None
    return dtype


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored zarr v3 data type name."""
    from ...codecs import numpy_dtype as nd

    return nd(name)


def fill(buf: np.ndarray) -> Any:
    """A load sink copying a read region into the host buffer ``buf``."""

    def sink(arr: np.ndarray) -> None:
        buf[...] = arr

    return sink
