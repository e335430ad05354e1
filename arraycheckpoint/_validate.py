"""Argument checks of the public verbs: refusals that say what is wrong and how to fix it.

:mod:`arraycheckpoint.api` calls these before any I/O; they read the arguments only (and, to explain a
missing checkpoint, list the path).
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

from .errors import CheckpointNotFoundError, InvalidArgumentError, InvalidStateError

#: The ``framework=`` values and the adapter family each selects.
_FRAMEWORKS = {
    "torch": "torch",
    "ddp": "torch",
    "fsdp": "torch",
    "fsdp1": "torch",
    "fsdp2": "torch",
    "megatron": "megatron",
    "jax": "jax",
}


def check_state(state: Any, framework: str | None = None) -> None:
    """Refuse a ``state`` argument that cannot be what the caller meant, naming the fix.

    Raises:
        InvalidStateError: ``state`` is not a mapping, holds a plain torch ``DataLoader``, or holds objects
            of another framework than ``framework``.
    """
    if not isinstance(state, Mapping):
        kind = type(state).__name__
        raise InvalidStateError(
            f"state must be a mapping of names to objects, got a {kind}: "
            f"wrap it, e.g. acp.save(path, {{'model': model}})"
        )
    for ns, value in state.items():
        if _plain_loader(value):
            raise InvalidStateError(
                f"{ns}: a plain torch DataLoader has no resumable state (pickling it would not save its "
                "position). Use a loader implementing arraycheckpoint.data.ReshardableLoader, or torchdata's "
                f"StatefulDataLoader (restored through its state_dict()), or leave {ns!r} out of the state"
            )
        if type(value).__module__.startswith("accelerate.") and _plain_loader(
            getattr(value, "base_dataloader", None)
        ):
            raise InvalidStateError(
                f"{ns}: accelerate's {type(value).__name__} over a plain torch DataLoader has no resumable state "
                "(its state_dict() fails). Prepare it under Accelerator(dataloader_config=DataLoaderConfiguration("
                "use_stateful_dataloader=True)) (torchdata's StatefulDataLoader: its position is saved and "
                f"restored), or leave {ns!r} out of the state"
            )
    if framework is None:
        return
    kind = _FRAMEWORKS.get(framework)
    if kind is None:
        raise InvalidArgumentError(f"unknown framework {framework!r}; use one of {sorted(_FRAMEWORKS)}")
    torch = sys.modules.get("torch")
    if kind == "jax" and torch is not None:
        for ns, value in state.items():
            if isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor)):
                raise InvalidStateError(
                    f"{ns}: a torch {type(value).__name__} with framework={framework!r}: pass "
                    "framework='torch' (or a torch variant), or omit framework= to detect it"
                )
    if kind != "jax" and "jax" in sys.modules:
        from .adapters.jax import is_jax_state

        if is_jax_state(state):
            raise InvalidStateError(
                f"the state holds jax arrays but framework={framework!r}: pass framework='jax', or omit "
                "framework= to detect it"
            )


def _plain_loader(value: Any) -> bool:
    """Whether ``value`` is a plain ``torch.utils.data.DataLoader`` (no ``state_dict``: no position)."""
    return type(value).__name__ == "DataLoader" and type(value).__module__.startswith("torch.utils.data")


def check_kwargs(verb: str, kwargs: Mapping[str, Any], fn: Callable[..., Any]) -> None:
    """Refuse keyword arguments ``fn`` (which ``verb`` forwards to) does not take, under ``verb``'s name."""
    import inspect

    known = [n for n in inspect.signature(fn).parameters if not n.startswith("_")]
    unknown = sorted(k for k in kwargs if k not in known or k.startswith("_"))
    if unknown:
        raise InvalidArgumentError(
            f"{verb}() got unknown keyword argument(s) {', '.join(map(repr, unknown))}; "
            f"it accepts {', '.join(known[2:])}"
        )


def check_timeout(timeout: Any) -> float | None:
    """``timeout=`` of save/load: None (the communicator's default) or a positive finite number of seconds.

    Raises:
        InvalidArgumentError: anything else (a bool, a string, zero, a negative number, NaN or infinity).
    """
    if timeout is None:
        return None
    if (
        isinstance(timeout, bool)
        or not isinstance(timeout, numbers.Real)
        or not (math.isfinite(timeout) and timeout > 0)
    ):
        raise InvalidArgumentError(
            f"timeout must be a positive finite number of seconds (the liveness bound after which a stalled "
            f"rank fails the save or load), got {timeout!r}; pass None for the default"
        )
    return float(timeout)


def check_step(step: Any) -> int | None:
    """``step=`` of a save: None or an integer (``np.int64`` and 0-d integer tensors too), as the metadata
    stores it: anything else would commit a checkpoint whose metadata no load accepts.

    Raises:
        InvalidArgumentError: a bool, a float, a string, or any other non-integer.
    """
    if step is None:
        return None
    if not isinstance(step, bool):
        try:
            return operator.index(step)
        except TypeError:
            pass
    raise InvalidArgumentError(
        f"step must be an integer (the training step) or None, got {step!r} ({type(step).__name__})"
    )


def check_inflight(max_inflight_bytes: Any) -> None:
    """``max_inflight_bytes=``: None (the default bound) or a positive integer number of bytes.

    Raises:
        InvalidArgumentError: anything else (a negative bound made every write wait for the one before).
    """
    if max_inflight_bytes is None:
        return
    if isinstance(max_inflight_bytes, bool) or not isinstance(max_inflight_bytes, numbers.Integral):
        bad = True
    else:
        bad = max_inflight_bytes <= 0
    if bad:
        raise InvalidArgumentError(
            f"max_inflight_bytes must be a positive number of bytes or None (1 GiB), got {max_inflight_bytes!r}"
        )


def check_compression(compression: Any) -> str | None:
    """``compression=`` (or ``PlanOptions.compression``) of a save, checked before the snapshot rather than
    failing the background write, and normalised as the metadata stores it (lower case; ``"none"`` is None:
    a load refuses any other spelling).

    Raises:
        InvalidArgumentError: a name no codec preset has.
    """
    from .codecs.presets import COMPRESSIONS

    if compression is None:
        return None
    name = compression.lower() if isinstance(compression, str) else None
    if name == "none":
        return None
    if name in COMPRESSIONS:
        return name
    raise InvalidArgumentError(
        f"compression={compression!r} is not supported; use None or one of {', '.join(map(repr, COMPRESSIONS))}"
    )


def check_indivisible(indivisible: Any) -> None:
    """``indivisible=`` of a load: one of :data:`~arraycheckpoint.adapters.base.INDIVISIBLE_MODES`.

    Raises:
        InvalidArgumentError: any other value (it would otherwise act as ``"error"`` without a word).
    """
    from .adapters.base import INDIVISIBLE_MODES

    if indivisible not in INDIVISIBLE_MODES:
        raise InvalidArgumentError(
            f"indivisible={indivisible!r} is not a mode; use one of {', '.join(map(repr, INDIVISIBLE_MODES))}"
        )


def check_transforms(transforms: Any, jax_targets: bool) -> None:
    """``transforms=`` applies to jax targets only: refuse it for torch ones instead of ignoring it.

    Raises:
        InvalidArgumentError: non-empty ``transforms`` with a torch (or megatron) target.
    """
    if transforms and not jax_targets:
        raise InvalidArgumentError(
            f"transforms= applies to jax targets only and would be ignored here ({', '.join(sorted(transforms))}): "
            "for torch targets, load into a tensor of the stored layout and convert it yourself (e.g. "
            "model.weight.copy_(loaded.T)), or rename with key_map="
        )


def key_map_function(
    key_map: Callable[[str], str | None] | Mapping[str, str | None] | None, state: Mapping[str, Any]
) -> Callable[[str], str | None] | None:
    """``key_map`` as a function; a mapping's keys must be namespaced target names (``model/0.weight``)."""
    if key_map is None or callable(key_map):
        return key_map
    if not isinstance(key_map, Mapping):
        raise InvalidArgumentError(
            f"key_map must be a mapping or a function of target names, got {type(key_map).__name__}"
        )
    bare = sorted(k for k in key_map if not isinstance(k, str) or k.split("/", 1)[0] not in state)
    if bare:
        ns = next(iter(state), "model")
        raise InvalidArgumentError(
            f"key_map keys must be target names starting with a namespace of the state ({sorted(state)}); "
            f"these are not: {', '.join(map(repr, bare[:20]))}. Write them in full, "
            f"e.g. {f'{ns}/{bare[0]}'!r} -> {f'{ns}/<stored fqn>'!r}"
        )
    return MappingKeyMap(dict(key_map))


class MappingKeyMap:
    """A ``key_map`` mapping as the function adapters call; remembers which of its keys were asked for, so
    an entry that matches no target name (a typo, a name of another model) is reported, not ignored."""

    def __init__(self, mapping: dict[str, str | None]) -> None:
        self.mapping = mapping
        self.asked: set[str] = set()

    def __call__(self, name: str) -> str | None:
        self.asked.add(name)
        return self.mapping.get(name, name)

    def unmatched(self) -> list[str]:
        """The mapping's keys no target name matched (sorted)."""
        return sorted(k for k in self.mapping if k not in self.asked)


def check_key_map_used(
    key_map: Callable[[str], str | None] | None, strict: bool, report: dict[str, Any] | None
) -> None:
    """A ``key_map`` entry no target matched: an error under ``strict``, ``report["unmatched_key_map"]`` else.

    Raises:
        StateMismatchError: ``strict`` and some entries of a ``key_map`` mapping matched no target name.
    """
    if not isinstance(key_map, MappingKeyMap):
        return
    unmatched = key_map.unmatched()
    if report is not None:
        report["unmatched_key_map"] = unmatched
    if unmatched and strict:
        from .errors import StateMismatchError

        names = sorted(key_map.asked)
        raise StateMismatchError(
            f"key_map entries that match no target name ({len(unmatched)}): {', '.join(unmatched[:20])}; "
            f"target names look like {', '.join(names[:5]) or '(none)'} (pass strict=False to load anyway)"
        )


def _is_empty_target(value: Any) -> bool:
    """A target that expects nothing: None or an empty container."""
    return value is None or (isinstance(value, (Mapping, list, tuple)) and not value)


def check_namespaces_stored(meta: Any, job: Any, state: Mapping[str, Any], job_key_map: Any = None) -> None:
    """Strict loads: refuse a target namespace the checkpoint holds nothing for, naming the stored ones.

    Per-entry checks cannot see this: an optimizer loads only the state that is stored (a parameter that
    never stepped has none), so an optimizer target over a model-only checkpoint, or over one saved under
    another namespace (``"optim"`` loaded as ``"optimizer"``), would load nothing and say nothing.

    Raises:
        StateMismatchError: a non-empty target namespace with no stored entry under it (not checked with a
            ``key_map``, which may rename namespaces).
    """
    from .errors import StateMismatchError

    if job_key_map is not None:
        return  # names are renamed (a namespace too, possibly): the per-name checks and the key_map's decide
    heads = {n.split("/", 1)[0] for n in (*meta.tensors, *meta.objects) if "~" not in n.split("/", 1)[0]}
    mapped = {
        n.split("/", 1)[0]
        for n, e in job.expected.items()
        if e.problem is None and ((e.stored or n) in meta.tensors or (e.stored or n) in meta.objects)
    }
    empty = sorted(
        ns
        for ns, value in state.items()
        if not _is_empty_target(value) and ns not in heads and ns not in mapped
    )
    if empty:
        raise StateMismatchError(
            f"the checkpoint holds nothing for namespace(s) {', '.join(map(repr, empty))} of the load target: "
            f"it stores {', '.join(map(repr, sorted(heads))) or 'nothing'}. Name the target's namespaces as "
            "they were saved (e.g. {'optim': optimizer} for a checkpoint saved under 'optim'), leave out what "
            "was not saved, or pass strict=False to load the rest"
        )


#: What a file a newcomer passes as a checkpoint path probably is, by its suffix, and what to do instead.
_FILE_HINTS = (
    (
        (".safetensors",),
        "a safetensors file: pass the directory holding it ({parent}), which loads as a Hugging Face checkpoint",
    ),
    (
        (".distcp", ".metadata"),
        "part of a DCP checkpoint: pass the directory holding it ({parent}), with allow_pickle=True",
    ),
    (
        (".pt", ".pth", ".bin", ".ckpt", ".tar"),
        "a torch.save file? torch.load it, or make it a checkpoint with `arraycheckpoint import`",
    ),
)
#: Entries of a missing path's parent looked at for committed checkpoints to name (an error path only).
_SIBLINGS_SCANNED = 1000


def _file_hint(root: str) -> str:
    name = os.path.basename(root).lower()
    for suffixes, hint in _FILE_HINTS:
        if name.endswith(suffixes):
            return "; " + hint.format(parent=os.path.dirname(root) or ".")
    return ""


def _committed_beside(root: str) -> str:
    """``"; committed checkpoints beside it in <parent>: a, b"`` for a missing local ``root`` (a mistyped step
    or role), else ``""``."""
    from .format.metadata import CONTROL_LAYOUTS

    parent = os.path.dirname(root.rstrip(os.sep)) or "."
    try:
        with os.scandir(parent) as entries:
            names = [e.name for _, e in zip(range(_SIBLINGS_SCANNED), entries) if e.is_dir()]
    except OSError:
        return ""
    found = sorted(
        n for n in names if any(os.path.isfile(os.path.join(parent, n, f.committed)) for f in CONTROL_LAYOUTS)
    )
    if not found:
        return ""
    shown = ", ".join(found[:10]) + (f", ... ({len(found)} in all)" if len(found) > 10 else "")
    return f"; committed checkpoints beside it in {parent}: {shown}"


def explain_not_found(path: str, error: CheckpointNotFoundError) -> CheckpointNotFoundError:
    """A not-found error that says what is at ``path``: nothing (naming committed checkpoints beside it, on a
    local path), a file (what it may be), a directory of checkpoints, or a directory holding none."""
    from .format.metadata import marker_owner
    from .storage import LocalStorage, storage_for

    try:
        storage, root = storage_for(path)
        local = isinstance(storage, LocalStorage)
        if local and os.path.lexists(root) and not os.path.isdir(root):
            what = (
                f"a file, not a checkpoint directory{_file_hint(root)}"
                if os.path.isfile(root)
                else "not a directory (a broken link, a device, a FIFO)"
            )
            return CheckpointNotFoundError(f"no checkpoint at {path}: it is {what}")
        keys = storage.list(root)
        if not keys and not (local and os.path.isdir(root)):
            beside = _committed_beside(root) if local else ""
            return CheckpointNotFoundError(f"no checkpoint at {path}: the path does not exist{beside}")
        files = storage.control_files(root)
        partial = storage.exists(root, files.metadata)
    except Exception:  # noqa: BLE001 - the original error is the better message
        return error
    inner = sorted({o for o in map(marker_owner, keys) if o})
    if inner:
        return CheckpointNotFoundError(
            f"no committed checkpoint at {path} itself, but it holds committed checkpoints in "
            f"{', '.join(inner[:10])}: load one of those (a role: pass role=...)"
        )
    why = (
        f"it has {files.metadata} but no commit marker {files.committed}: a save there did not finish"
        if partial
        else f"no {files.committed}: a save there did not finish, or it is not a checkpoint directory"
    )
    hint = (_hub_cache_hint(root) or _torch_files_hint(root)) if local else ""
    return CheckpointNotFoundError(f"{path} exists but holds no committed checkpoint ({why}){hint}")


def _torch_files_hint(root: str) -> str:
    """What to do with a directory of ``torch.save`` weights (an older Hugging Face repository's
    ``pytorch_model.bin``): nothing reads them without unpickling, so say how to convert them."""
    try:
        names = sorted(n for n in os.listdir(root) if n.endswith((".bin", ".pt", ".pth")))
    except OSError:
        return ""
    if not names:
        return ""
    return (
        f"; it holds torch.save weights ({', '.join(names[:3])}), which are read only by unpickling: convert "
        f"them with `arraycheckpoint import {os.path.join(root, names[0])} NEW_PATH` (torch.load with "
        "weights_only=True), or load the model with transformers and save it with acp.save"
    )


def _hub_cache_hint(root: str) -> str:
    """What to load instead of a Hugging Face hub cache folder (``models--org--name`` or its ``snapshots``):
    its snapshot directories, which hold the files (as links the Hugging Face source follows)."""
    repo = os.path.dirname(root) if os.path.basename(root) == "snapshots" else root
    snapshots = os.path.join(repo, "snapshots")
    if not (os.path.isdir(snapshots) and os.path.isdir(os.path.join(repo, "blobs"))):
        return ""
    found = sorted(os.listdir(snapshots))[:3]
    shown = ", ".join(os.path.join(snapshots, f) for f in found) or f"{snapshots}/<commit>"
    return f"; it is a Hugging Face hub cache folder: load a snapshot directory ({shown})"
