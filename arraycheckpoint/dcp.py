"""A storage plug-in for torch.distributed.checkpoint (DCP) that writes and reads arraycheckpoint's format.

Switch a DCP job with one argument::

    import torch.distributed.checkpoint as dcp
    import arraycheckpoint as acp
    import arraycheckpoint.dcp

    dcp.save(state_dict, storage_writer=acp.dcp.Writer("ckpt/step_100"))
    dcp.load(state_dict, storage_reader=acp.dcp.Reader("ckpt/step_100"))
    acp.load("ckpt/step_100", {"model": model})      # any other layout, or zarr / tensorstore / xarray

The result is an ordinary arraycheckpoint checkpoint: every tensor one Zarr v3 array with its global shape,
JSON metadata, crc32c, committed atomically. DCP's planner decides which rank writes which item (replicas
deduplicated); :meth:`Writer.prepare_global_plan` fits every tensor's items to a regular chunk grid in which
each item is exactly one chunk, so every stored file has one writer. A layout no regular grid holds that way
(uneven shards other than a shorter last one) fails with a :class:`~arraycheckpoint.PlanError` naming the
tensor and its layout.

Names. DCP flattens nested state dicts to dotted keys and records each key's path (``planner_data``); entries
are that path joined with ``/``, so FQNs with dots stay unambiguous: ``("model", "layers.0.w")`` ->
``model/layers.0.w``, and optimizer state ``("optimizer", "state", "layers.0.w", "exp_avg")`` ->
``optimizer/layers.0.w/exp_avg`` (the ``state`` level dropped, as :func:`arraycheckpoint.save` names it); a
flattened optimizer (``flatten_optimizer_state_dict=True``: ``optimizer.state.<fqn>.exp_avg``) is stored the
same way. Key components an entry name cannot hold (``w:1``, ``__w``, ``.w``) are escaped with ``~``; the
JSON metadata object ``~dcp`` records every key's entry, so :class:`Reader` gives the keys back exactly.
Non-tensor values (DCP pickles them: ``param_groups``, counters) are kept as DCP's bytes in ``~dcp`` for
:class:`Reader`; :func:`arraycheckpoint.load` never unpickles them, but reads the JSON copies the Writer also
stores of an optimizer's ``param_groups`` (``<ns>/~param_groups``) and non-tensor per-parameter state.

Like ``FileSystemWriter``, :class:`Writer` replaces a checkpoint at its path (``overwrite=True``), and it
leaves a JSON ``.metadata`` file in the checkpoint root for DCP-style resume discovery (torchtitan's
``_find_load_step``); see docs/integrations.md.

:class:`Reader` also reads checkpoints written by :func:`arraycheckpoint.save` (and Hugging Face / DCP load
sources): entry ``a/b`` is DCP key ``a.b``, ``ns/fqn/state`` is ``ns.state.fqn.state``.
"""

from __future__ import annotations

from .interop.dcpreader import Reader
from .interop.dcpwriter import Writer, fit_chunk_grid
from .sources.dcpkeys import DCP_OBJECT, DISCOVERY_FILE, dcp_key, entry_name, entry_names, native_objects

__all__ = [
    "DCP_OBJECT",
    "DISCOVERY_FILE",
    "Reader",
    "Writer",
    "dcp_key",
    "entry_name",
    "entry_names",
    "fit_chunk_grid",
    "native_objects",
]
