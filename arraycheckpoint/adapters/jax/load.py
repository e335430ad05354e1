""":func:`load_jax`: :func:`arraycheckpoint.load` with the options only JAX targets have."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

from ...collectives import Communicator
from .adapter import Transform


def load_jax(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    allow_cast: bool = False,
    key_map: Callable[[str], str | None] | Mapping[str, str] | None = None,
    transforms: Mapping[str, Transform] | None = None,
    indivisible: str = "error",
    comm: Communicator | None = None,
    report: dict[str, list[str]] | None = None,
) -> dict[str, Any]:
    """Load a checkpoint (saved by JAX or PyTorch) into new jax arrays: :func:`arraycheckpoint.load` with
    ``framework="jax"``.

    Args:
        path: checkpoint path or URL.
        state: ``{namespace: pytree}`` whose array leaves are ``jax.ShapeDtypeStruct`` (with ``sharding``),
            ``jax.Array`` (its sharding is used) or ``numpy.ndarray`` (loaded whole, on the host).
        strict, allow_pickle, allow_cast, key_map, report: as in :func:`arraycheckpoint.load`
            (``key_map`` maps a target name such as ``params/dense.kernel`` to a stored name).
        transforms: target name -> function applied to the whole stored tensor (numpy) that returns the
            target's global layout, e.g. ``{"params/dense.kernel": np.transpose}`` for a torch
            ``Linear.weight``. A transformed tensor is read in full on every process, then sliced.
        indivisible: ``"error"`` raises when a ``NamedSharding`` dimension does not divide by its mesh axis
            (the message names the tensor and axis); ``"replicate"`` loads that dimension replicated.
        comm: the communicator (as in :func:`arraycheckpoint.load`).

    Returns:
        A dict shaped like ``state`` with new arrays (leaves the checkpoint lacks, under ``strict=False``,
        are returned unchanged).

    Example:
        >>> abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params)
        >>> restored = load_jax("ckpt", {"model": abstract}, transforms={"model/fc.kernel": np.transpose})
    """
    from ...api import load

    return load(
        path,
        state,
        framework="jax",
        strict=strict,
        allow_pickle=allow_pickle,
        allow_cast=allow_cast,
        key_map=key_map,
        transforms=transforms,
        indivisible=indivisible,
        comm=comm,
        report=report,
    )
