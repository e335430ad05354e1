"""What every adapter provides, and the strictness checks all adapters share.

An adapter only translates: framework objects to :class:`~arraycheckpoint.items.SaveRequest` on save, and to
a :class:`LoadJob` (regions to read, sinks to fill, a ``finish`` step) on load. It performs no I/O and runs
no collective; the engine does both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateMismatchError
from ..items import LoadTensor, SaveRequest
from ..metadata import CheckpointMetadata


@dataclass(frozen=True)
class AdapterOptions:
    """Options that reach the adapter from :func:`arraycheckpoint.save` / :func:`arraycheckpoint.load`."""

    allow_pickle: bool = False
    strict: bool = True
    allow_cast: bool = False
    step: int | None = None
    key_map: Callable[[str], str | None] | None = None  # load: target name -> stored name (None: skip)
    transforms: Mapping[str, Callable[[Any], Any]] = field(default_factory=dict)
    indivisible: str = "error"  # jax: "replicate" loads a non-dividing NamedSharding dimension replicated


@dataclass
class Expected:
    """A name the load target wants: a tensor (shape, dtype) or an object (shape None)."""

    shape: tuple[int, ...] | None = None
    dtype: str | None = None


@dataclass
class LoadJob:
    """An adapter's load: what to read, what it expects (for strict checks), and how to finish."""

    targets: list[LoadTensor]
    expected: dict[str, Expected]
    namespaces: set[str]
    finish: Callable[[], Any]
    optional: set[str] = field(default_factory=set)  # expected names whose absence is not an error
    # namespaces whose keys are split over ranks (megatron pipeline stages): "unexpected" is decided across
    # ranks, since no single rank can tell a key nobody loads from a key another stage loads
    global_namespaces: set[str] = field(default_factory=set)


class Adapter(ABC):
    """Translate one framework's state to and from the engine's items."""

    framework: str = ""

    @abstractmethod
    def save_request(self, state: Mapping[str, Any], options: AdapterOptions) -> SaveRequest:
        """Describe this rank's part of ``state``."""

    @abstractmethod
    def load_job(
        self, meta: CheckpointMetadata, state: Mapping[str, Any], options: AdapterOptions
    ) -> LoadJob:
        """Plan reading ``meta``'s checkpoint into ``state``."""


def unexpected_names(meta: CheckpointMetadata, wanted: set[str], namespaces: set[str]) -> list[str]:
    """Stored names under ``namespaces`` that nobody wants (format-internal ``~`` entries excepted)."""
    return sorted(
        n
        for n in set(meta.tensors) | set(meta.objects)
        if n.split("/", 1)[0] in namespaces
        and n not in wanted
        and "~" not in n
        and not any(n.startswith(e + "/") for e in wanted if e in meta.objects)
    )


def check_expected(meta: CheckpointMetadata, job: LoadJob, options: AdapterOptions) -> dict[str, list[str]]:
    """Compare what the target expects with what is stored.

    Returns a report ``{"missing": [...], "unexpected": [...], "mismatched": [...]}``. With ``strict`` any
    entry raises :class:`StateMismatchError` listing every offending name; without it, targets of missing
    or mismatched names are dropped (the intersection loads).
    """
    stored = set(meta.tensors) | set(meta.objects)
    missing = sorted(n for n in job.expected if n not in stored and n not in job.optional)
    mismatched = []
    for name, exp in job.expected.items():
        tm = meta.tensors.get(name)
        if tm is None or exp.shape is None:
            continue
        if tuple(exp.shape) != tm.shape:
            mismatched.append(f"{name}: checkpoint shape {list(tm.shape)} != target shape {list(exp.shape)}")
        elif exp.dtype is not None and exp.dtype != tm.dtype and not options.allow_cast:
            mismatched.append(
                f"{name}: checkpoint dtype {tm.dtype} != target dtype {exp.dtype} "
                "(pass allow_cast=True to convert)"
            )
    unexpected = sorted(
        n
        for n in stored
        if n.split("/", 1)[0] in job.namespaces
        and n not in job.expected
        and "~" not in n
        and not any(n.startswith(e + "/") for e in job.expected if e in meta.objects)
    )
    report = {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}
    if options.strict and any(report.values()):
        lines = [
            f"{k} ({len(v)}): " + ", ".join(v[:50]) + (" ..." if len(v) > 50 else "")
            for k, v in report.items()
            if v
        ]
        raise StateMismatchError(
            "checkpoint does not match the load target:\n  "
            + "\n  ".join(lines)
            + "\n(pass strict=False to load the intersection)"
        )
    bad = set(missing) | {m.split(":", 1)[0] for m in mismatched}
    job.targets[:] = [t for t in job.targets if t.name not in bad and t.name in meta.tensors]
    return report
