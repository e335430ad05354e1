"""Small helpers the torch adapter's modules share: save items of tensors, dtype names, host buffers."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from ...planning.items import SaveShard, SaveTensor
from .dtensor_rule import dtensor_rule
from .tensors import TorchSource, as_torch, layout, numpy_dtype


def tensor_item(
    name: str, t: Any, pieces: list | None = None, shape: tuple | None = None, rule: tuple | None = None
) -> SaveTensor:
    """The save item of tensor ``t`` (numpy arrays too); a DTensor contributes only its local box.

    ``rule`` is the layout rule of ``pieces`` when the caller knows one (an FSDP1 flat range); a DTensor's
    rule is derived here."""
    if isinstance(t, np.ndarray):
        t = as_torch(t)
    if pieces is None:
        shape, pieces = layout(t)
    return SaveTensor(
        name=name,
        shape=shape,
        dtype=numpy_dtype(t.dtype),
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


def np_dtype(name: str) -> np.dtype:
    """The numpy dtype of a stored zarr v3 data type name."""
    from ...codecs import numpy_dtype as nd

    return nd(name)


def fill(buf: np.ndarray) -> Any:
    """A load sink copying a read region into the host buffer ``buf``."""

    def sink(arr: np.ndarray) -> None:
        buf[...] = arr

    return sink
