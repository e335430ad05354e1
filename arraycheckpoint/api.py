"""The public verbs: :func:`save`, :func:`save_async`, :func:`load`, :func:`read_metadata`.

They pick the adapter from the objects in ``state`` (or the ``framework=`` argument), let it translate, and
hand the result to the engine. ``save`` is ``save_async(...).result()``: one code path.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ._validate import (
    _FRAMEWORKS,
    check_compression,
    check_indivisible,
    check_inflight,
    check_key_map_used,
    check_kwargs,
    check_namespaces_stored,
    check_state,
    check_step,
    check_timeout,
    check_transforms,
    explain_not_found,
    key_map_function,
)
from .adapters.base import Adapter, AdapterOptions, LoadJob, check_expected, unexpected_names
from .checks.bounds import MAX_JSON_DEPTH
from .engine import DEFAULT_INFLIGHT_BYTES, SaveOptions, engine
from .engine.load import gc_paused
from .errors import CheckpointNotFoundError, InvalidArgumentError, InvalidStateError, StateMismatchError
from .format.metadata import SAFETENSORS_FRAMEWORK, CheckpointMetadata
from .planning.plan import PlanOptions
from .runtime.collectives import Communicator, default_communicator
from .runtime.future import CheckpointFuture
from .storage import storage_for
from .storage.base import reading


def _adapter(framework: str) -> Adapter:
    kind = _FRAMEWORKS.get(framework)
    if kind is None:
        raise InvalidArgumentError(f"unknown framework {framework!r}; use one of {sorted(_FRAMEWORKS)}")
    if kind == "torch":
        from .adapters.torch import TorchAdapter

        return TorchAdapter()
    if kind == "megatron":
        from .adapters.torch.megatron import MegatronAdapter

        return MegatronAdapter()
    from .adapters.jax import JaxAdapter

    return JaxAdapter()


def detect_framework(state: Mapping[str, Any]) -> str:
    """The framework of ``state``'s objects: megatron, jax or torch (modules, optimizers, tensors)."""
    check_state(state)
    if "megatron.core" in sys.modules:
        from .adapters.torch.megatron import is_megatron_state

        if is_megatron_state(state):
            return "megatron"
    if "jax" in sys.modules:
        from .adapters.jax import is_jax_state

        if is_jax_state(state):
            return "jax"
    return "torch"


def _communicator(comm: Communicator | None, framework: str, timeout: float | None = None) -> Communicator:
    """``comm``, else the framework's default (``timeout``: the liveness bound if the torch one is created now)."""
    if comm is not None:
        return comm
    if _FRAMEWORKS.get(framework) == "jax":
        from .adapters.jax import jax_communicator

        return jax_communicator()
    return default_communicator(timeout)


def save_async(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    framework: str | None = None,
    step: int | None = None,
    overwrite: bool = False,
    allow_pickle: bool = False,
    compression: str | None = None,
    plan_options: PlanOptions | None = None,
    comm: Communicator | None = None,
    max_inflight_bytes: int | None = None,
    role: str | None = None,
    timeout: float | None = None,
    _blocking: bool = False,
) -> CheckpointFuture:
    """Start saving ``state`` to ``path``; returns once the snapshot is taken.

    Call on every rank with the same structure. ``fut.staged`` completes when training may mutate its
    tensors again; ``fut.result()`` when the checkpoint is committed (or raises the error of any rank).

    Args:
        path: local path or URL (``file://``, ``memory://``, ``s3://``, any fsspec URL).
        state: ``{"model": module or state_dict, "optimizer": optimizer, "extra_state": {...}, ...}``.
        framework: ``torch``/``ddp``/``fsdp``/``fsdp2``/``megatron``/``jax``; detected when omitted.
        step: training step recorded in the metadata.
        overwrite: replace a committed checkpoint at ``path``.
        allow_pickle: permit values JSON cannot hold (then loading needs ``allow_pickle=True`` too).
        compression: ``None`` or ``"zstd"`` for the stored chunks.
        plan_options: chunk-size knobs of the planner.
        comm: the communicator; defaults to torch.distributed's world (a dedicated gloo group) or one process.
        max_inflight_bytes: bound on bytes handed to storage and not yet written.
        role: save as role ``role`` (e.g. ``"actor"``): a checkpoint of its own at ``<path>/<role>``.
        timeout: liveness bound in seconds (the same on every rank): a rank that stops progressing (stopped,
            frozen, its host gone) makes every rank's save fail with :class:`StalledRankError` naming it
            about this long after it stalled. Slow but live ranks are waited for, however long. Default:
            the communicator's (``ACP_LIVENESS_TIMEOUT``, else 300 s).

    Example:
        >>> fut = acp.save_async("ckpt/step_100", {"model": model, "optimizer": opt}, step=100)
        >>> fut.staged.result(); train_more(); fut.result()
    """
    # -- roles and special values (PerRank, state_dict objects, dataloaders): arraycheckpoint.stateful --
    from . import stateful

    check_state(state, framework)
    liveness_timeout = check_timeout(timeout)
    step = check_step(step)
    check_inflight(max_inflight_bytes)
    path = stateful.role_path(path, role)
    with _nesting_checked():
        special, state = stateful.split(state)
        # --
        framework = framework or detect_framework(state)
        adapter = _adapter(framework)
        request = adapter.save_request(state, AdapterOptions(allow_pickle=allow_pickle, step=step))
        request.framework = framework
        comm = _communicator(comm, framework, liveness_timeout)
        stateful.extend_request(
            request, special, comm, AdapterOptions(allow_pickle=allow_pickle, step=step), role
        )
    request.topology = {"world_size": comm.world_size, "framework": framework, **request.topology}
    plan = plan_options or PlanOptions()
    if compression is not None:
        plan = dataclasses.replace(plan, compression=compression)
    if plan.compression is not None:
        plan = dataclasses.replace(plan, compression=check_compression(plan.compression))
    options = SaveOptions(
        overwrite=overwrite,
        plan=plan,
        max_inflight_bytes=max_inflight_bytes or DEFAULT_INFLIGHT_BYTES,
        blocking=_blocking,
        liveness_timeout=liveness_timeout,
    )
    return engine().save_async(os.fspath(path), request, comm, options)


@contextlib.contextmanager
def _nesting_checked() -> Iterator[None]:
    """A state nested ~1,000 deep (or a dict or list that holds itself) is an :class:`InvalidStateError`
    before anything is written, not a ``RecursionError`` from deep inside the adapters."""
    from .stateful import METADATA_WRAPPING

    try:
        yield
    except RecursionError as e:
        raise InvalidStateError(
            "the state nests too deep to save, or holds a dict or list that contains itself: a saved value "
            f"may nest at most {MAX_JSON_DEPTH - METADATA_WRAPPING} levels; flatten it"
        ) from e


def save(path: str | os.PathLike[str], state: Mapping[str, Any], **kwargs: Any) -> CheckpointMetadata:
    """Save ``state`` and wait until it is committed. Same arguments as :func:`save_async`.

    Returns the committed metadata on the coordinator (None on other ranks).
    """
    check_kwargs("save", kwargs, save_async)
    # the caller waits: as in a load, no cyclic collection passes over the objects the save keeps alive until
    # it commits (a gen-2 pass in the commit's metadata was 65 of 230 ms of a 2,000-tensor save). save_async
    # leaves the collector alone: the training thread runs beside it
    with gc_paused():
        return save_async(path, state, _blocking=True, **kwargs).result()


def load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    framework: str | None = None,
    strict: bool = True,
    allow_pickle: bool = False,
    allow_cast: bool = False,
    key_map: Callable[[str], str | None] | Mapping[str, str] | None = None,
    transforms: Mapping[str, Callable[[Any], Any]] | None = None,
    indivisible: str = "error",
    dedup_reads: bool = False,
    record_metrics: bool = False,
    comm: Communicator | None = None,
    report: dict[str, list[str]] | None = None,
    role: str | None = None,
    device: Any = None,
    all_or_nothing: bool = False,
    max_inflight_bytes: int | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Load a committed checkpoint into ``state`` under the current (any) parallel layout.

    torch objects are restored in place; jax targets (arrays or ``ShapeDtypeStruct`` with shardings) come
    back as new arrays in the returned dict. Each rank reads only the regions its shards need.

    Args:
        path: checkpoint path or URL.
        state: the load target, structured like the saved state (a subset of namespaces is fine).
        strict: raise :class:`StateMismatchError` listing missing/unexpected keys and shape/dtype mismatches;
            with ``strict=False`` the intersection loads and ``report`` (if given) receives the rest.
        allow_pickle: permit unpickling values saved with ``allow_pickle=True`` (trusted checkpoints only).
        allow_cast: load into targets whose dtype differs from the stored one (converting).
        key_map: target name -> stored name: a mapping or a function (returning None to skip a key). Names
            are namespaced (``"model/head.weight"``); a mapping key without a namespace of ``state`` is
            refused. An optimizer's per-parameter state follows its parameter's mapping.
        transforms: jax: ``{target_name: fn}``; ``fn`` maps the whole stored tensor (numpy) to the target's
            global layout (e.g. ``np.transpose`` for torch Linear -> flax Dense kernels).
        indivisible: jax: ``"error"`` (default) or ``"replicate"`` for a target dimension that does not
            divide by its mesh axis.
        dedup_reads: read each region that several ranks need once and share it through the
            communicator (collective; see the README's measurements for when it pays).
        record_metrics: store every rank's load phases in the checkpoint as ``.acp/metrics-load.json``
            (collective; the checkpoint's storage must be writable). ``report["metrics"]`` always receives
            this rank's phases.
        comm: the communicator (default: as for :func:`save_async`).
        role: load role ``role`` (``<path>/<role>``); other roles under ``path`` are not touched.
        device: torch: materialise modules built on the meta device on this device (``to_empty``) and
            fill them from the checkpoint; without it a meta-device target is refused.
        max_inflight_bytes: bound on bytes read and not yet delivered to their targets (default 1 GiB): a load
            holds at most this much above the state (regions larger than it are read in slabs).
        all_or_nothing: read everything into staging arrays first and copy into the targets only when every
            read succeeded. By default torch targets are written in place as regions arrive, so a load that
            fails midway (a damaged chunk, a checkpoint deleted under the reader) may leave them partly
            overwritten; this mode prevents that at the cost of holding the loaded bytes twice (opt-in).
        timeout: liveness bound in seconds of the load's collectives (strict checks across ranks,
            ``dedup_reads``, ``record_metrics``), as for :func:`save_async`.

    Returns:
        ``state`` with loaded values (the same objects for torch; new arrays for jax).

    Raises:
        CheckpointNotFoundError: nothing committed at ``path``.
        StateMismatchError: strict load of a non-matching target.
        CorruptCheckpointError: stored bytes failed their checksums (the tensor is named).
        MetaDeviceError: a module on the meta device and no ``device``.
        InvalidArgumentError / InvalidStateError: arguments that cannot work (the message says the fix).
    """
    # -- roles and special values: arraycheckpoint.stateful --
    from . import stateful

    check_state(state, framework)
    check_indivisible(indivisible)
    check_inflight(max_inflight_bytes)
    liveness_timeout = check_timeout(timeout)
    key_map = key_map_function(key_map, state)
    path = stateful.role_path(path, role)
    # registered as being read from the first look at it: a manager's retention in this process skips it;
    # no garbage collection passes over the objects the load keeps alive until it returns, and they are all
    # freed (by reference counting) inside _load, before the collector is back: a collection right after
    # would walk the metadata, the targets and the read plan (20 objects per tensor) only to find them dead
    with reading(*storage_for(os.fspath(path))), gc_paused():
        return _load(
            path,
            state,
            framework=framework,
            strict=strict,
            allow_pickle=allow_pickle,
            allow_cast=allow_cast,
            key_map=key_map,
            transforms=transforms,
            indivisible=indivisible,
            dedup_reads=dedup_reads,
            record_metrics=record_metrics,
            comm=comm,
            report=report,
            device=device,
            all_or_nothing=all_or_nothing,
            max_inflight_bytes=max_inflight_bytes,
            liveness_timeout=liveness_timeout,
        )


def _load(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    framework: str | None,
    strict: bool,
    allow_pickle: bool,
    allow_cast: bool,
    key_map: Callable[[str], str | None] | None,
    transforms: Mapping[str, Callable[[Any], Any]] | None,
    indivisible: str,
    dedup_reads: bool,
    record_metrics: bool,
    comm: Communicator | None,
    report: dict[str, list[str]] | None,
    device: Any,
    all_or_nothing: bool,
    max_inflight_bytes: int | None,
    liveness_timeout: float | None,
) -> dict[str, Any]:
    """:func:`load` after its argument checks, inside its ``reading`` and ``gc_paused`` blocks."""
    from . import stateful

    eng = engine()
    try:
        storage, root, meta = eng.read_metadata(
            os.fspath(path), allow_pickle=allow_pickle, timeout=liveness_timeout
        )
    except CheckpointNotFoundError as e:
        raise explain_not_found(os.fspath(path), e) from None
    special, state = stateful.split(state, meta)
    # --
    framework = framework or detect_framework(state)
    check_transforms(transforms, _FRAMEWORKS.get(framework) == "jax")
    options = AdapterOptions(
        allow_pickle=allow_pickle,
        strict=strict,
        allow_cast=allow_cast,
        key_map=key_map,
        transforms=dict(transforms or {}),
        indivisible=indivisible,
        device=device,
    )
    job = _adapter(framework).load_job(meta, state, options)
    job = stateful.merge_load(
        job,
        special,
        meta,
        lambda: _communicator(comm, framework, liveness_timeout),
        options,
        lambda targets: eng.load(storage, root, meta, targets),  # a dataloader's index rows
    )  # stateful
    if strict:
        check_namespaces_stored(meta, job, state, key_map)
    check_key_map_used(key_map, strict, report)
    try:
        found = check_expected(meta, job, options)
    except StateMismatchError as e:
        hint = _conversion_hint(meta, state)
        if not hint:
            raise
        raise StateMismatchError(f"{e}\n{hint}") from None
    needs_comm = dedup_reads or record_metrics or (strict and job.global_namespaces)
    communicator = _communicator(comm, framework, liveness_timeout) if needs_comm else None
    if communicator is not None:
        eng.wait_idle()  # a save in flight still uses the group (and its timeout)
        communicator.set_liveness_timeout(liveness_timeout)
    if strict and job.global_namespaces:
        _check_unexpected_across_ranks(meta, job, communicator)
    if report is not None:
        report.update(found)
    recorder = eng.load(
        storage,
        root,
        meta,
        job.targets,
        comm=communicator,
        dedup_reads=dedup_reads,
        all_or_nothing=all_or_nothing,
        max_inflight_bytes=max_inflight_bytes or DEFAULT_INFLIGHT_BYTES,
    )
    if report is not None:
        report["metrics"] = recorder.to_json()["phases"]
    if record_metrics:
        from .engine import record_load_metrics

        record_load_metrics(root, recorder, communicator)
    return job.finish()


def _conversion_hint(meta: CheckpointMetadata, state: Mapping[str, Any]) -> str:
    """Why a Hugging Face directory's keys miss a transformers model's names, where transformers itself
    converts them at load (transformers 5 renames and fuses weights per model type: Mixtral's per-expert
    ``block_sparse_moe.experts.0.w1.weight`` become one ``mlp.experts.gate_up_proj``), else ``""``."""
    transformers = sys.modules.get("transformers")
    if meta.framework != SAFETENSORS_FRAMEWORK or transformers is None:
        return ""
    for ns, value in state.items():
        model_type = getattr(getattr(value, "config", None), "model_type", None)
        if not isinstance(value, getattr(transformers, "PreTrainedModel", ())) or not model_type:
            continue
        try:
            from transformers.conversion_mapping import get_checkpoint_conversion_mapping

            rules = get_checkpoint_conversion_mapping(model_type)
        except Exception:  # noqa: BLE001 - a transformers without the mapping: no hint
            return ""
        if rules:
            return (
                f"transformers renames or fuses {model_type!r} weights when it loads a Hugging Face directory "
                f"({len(rules)} conversion rules), so the files' keys are not the names of {ns!r}: load the "
                f"directory once with {type(value).__name__}.from_pretrained(path), acp.save the model, and "
                "load that checkpoint"
            )
    return ""


def load_jax(
    path: str | os.PathLike[str],
    state: Mapping[str, Any],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    allow_cast: bool = False,
    key_map: Callable[[str], str | None] | Mapping[str, str] | None = None,
    transforms: Mapping[str, Callable[[Any], Any]] | None = None,
    indivisible: str = "error",
    comm: Communicator | None = None,
    report: dict[str, list[str]] | None = None,
    timeout: float | None = None,
) -> dict[str, Any]:
    """Load a checkpoint (saved by JAX or PyTorch) into new jax arrays: :func:`load` with ``framework="jax"``.

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
        comm, timeout: as in :func:`arraycheckpoint.load`.

    Returns:
        A dict shaped like ``state`` with new arrays (leaves the checkpoint lacks, under ``strict=False``,
        are returned unchanged).

    Example:
        >>> abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params)
        >>> restored = load_jax("ckpt", {"model": abstract}, transforms={"model/fc.kernel": np.transpose})
    """
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
        timeout=timeout,
    )


def _check_unexpected_across_ranks(meta: CheckpointMetadata, job: LoadJob, comm: Communicator) -> None:
    """Stored keys of split namespaces (megatron pipeline stages) that no rank loads: a strict error."""
    wanted = job.stored_names()
    if comm.world_size > 1:
        engine().wait_idle()  # the checkpoint group must be idle before this collective
        # the ranks of a stage want the same names: each distinct list travels once, not once per rank
        distinct = {id(w): w for w in comm.all_gather_distinct_json(sorted(wanted))}
        wanted = set().union(*distinct.values())
    extra = unexpected_names(meta, wanted, job.global_namespaces)
    if extra:
        raise StateMismatchError(
            f"checkpoint keys no rank loads ({len(extra)}): "
            + ", ".join(extra[:50])
            + "\n(pass strict=False to load the intersection)"
        )


def read_metadata(path: str | os.PathLike[str]) -> CheckpointMetadata:
    """The validated metadata of the committed checkpoint at ``path``."""
    try:
        return engine().read_metadata(os.fspath(path))[2]
    except CheckpointNotFoundError as e:
        raise explain_not_found(os.fspath(path), e) from None
