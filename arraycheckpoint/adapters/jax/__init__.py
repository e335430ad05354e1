"""JAX support: pytrees of ``jax.Array`` with any sharding, single- and multi-controller.

``arraycheckpoint.save``/``load`` pick this adapter for states holding ``jax.Array`` or
``jax.ShapeDtypeStruct`` leaves. :func:`arraycheckpoint.load_jax` is the same load with the JAX-only options (layout
transforms, replicated fallback for indivisible shardings). Importing this subpackage imports jax;
``import arraycheckpoint`` never does.
"""

from __future__ import annotations

from .adapter import JaxAdapter, is_jax_state
from .communicator import JaxCommunicator, jax_communicator

__all__ = ["JaxAdapter", "JaxCommunicator", "is_jax_state", "jax_communicator"]
