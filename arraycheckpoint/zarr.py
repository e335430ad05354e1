"""Teach zarr-python the data types of arraycheckpoint checkpoints: ``import arraycheckpoint.zarr``.

Checkpoints store bfloat16 and float8 tensors under tensorstore's zarr v3 names (``bfloat16``,
``float8_e4m3fn``, ...). zarr-python 3.1 has no such types, and although arraycheckpoint declares them under
the ``zarr.data_type`` entry-point group, zarr-python 3.1.x never loads that group by itself: any listing of a
group holding one bfloat16 array fails. Importing this module registers the types once per process::

    import zarr
    import arraycheckpoint.zarr  # noqa: F401  (registration only)

    root = zarr.open_group("ckpt/step_100", mode="r")
    root.tree()
    w = root["model/layers.0.attn.wq.weight"][...]  # numpy array of dtype ml_dtypes.bfloat16

From format 5 on, small arrays live in packs (ZIP files under ``.acp/packs/``), which a plain walk of the
checkpoint directory does not see. :func:`checkpoint_store` returns a read-only zarr store presenting the whole
checkpoint as one hierarchy, every packed array at its natural path (:mod:`arraycheckpoint.interop.zarrstore`)::

    from arraycheckpoint.zarr import checkpoint_store

    root = zarr.open_group(checkpoint_store("ckpt/step_100"), mode="r")
    root.tree()  # packed and unpacked tensors alike

It imports zarr, numpy and ml_dtypes (and arraycheckpoint's own light modules), never torch, jax or
tensorstore. Nothing else happens at import: no array is opened and no global zarr setting changes.
"""

from __future__ import annotations

from .codecs.dtypes import ML_DTYPE_CLASSES, register_zarr_dtypes
from .interop.zarrstore import CheckpointStore, checkpoint_store

__all__ = ["ML_DTYPE_CLASSES", "CheckpointStore", "checkpoint_store", "register_zarr_dtypes"]

register_zarr_dtypes()
