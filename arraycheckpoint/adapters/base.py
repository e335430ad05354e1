"""What every adapter provides, and the strictness checks all adapters share.

An adapter only translates: framework objects to :class:`~arraycheckpoint.planning.items.SaveRequest` on save, and to
a :class:`LoadJob` (regions to read, sinks to fill, a ``finish`` step) on load. It performs no I/O and runs
no collective; the engine does both.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import StateMismatchError
from ..format.metadata import CheckpointMetadata
from ..planning.items import LoadTensor, SaveRequest

#: ``indivisible=`` of a jax load: what to do with a ``NamedSharding`` dimension its mesh axis does not divide.
INDIVISIBLE_MODES = ("error", "replicate")


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
    device: Any = None  # torch load: materialise meta-device modules on this device (``to_empty``)


@dataclass
class Expected:
    """A name the load target wants: a tensor (shape, dtype) or an object (shape None).

    ``expected`` dicts are keyed by the *target* name; ``stored`` names the checkpoint entry it reads when
    that differs (``key_map``, tied weights), so two targets may read one stored entry and each is checked.
    """

    shape: tuple[int, ...] | None = None
    dtype: str | None = None
    stored: str | None = None  # the checkpoint entry read (default: the key itself)
    group: str | None = None  # entries of one group load all-or-nothing (one parameter's optimizer state)
    requires: str | None = None  # key of an entry this one is useless without (the parameter it belongs to)
    problem: str | None = None  # a mismatch only the adapter can see (e.g. optimizer state keys differ)
    reads: list[LoadTensor] = field(default_factory=list)  # this entry's reads (dropped when it is skipped)


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
    # expected keys that strict=False left out (filled by check_expected; finishers skip their values)
    dropped: set[str] = field(default_factory=set)
    # entry prefixes checked name by name although they lie under (or are) an object entry (modules nested in
    # an extra-state dict, a state dict an older save stored with a document: a stored parameter the target
    # lacks is unexpected, as it is under ``model``)
    scoped: set[str] = field(default_factory=set)

    def stored_names(self) -> set[str]:
        """The checkpoint entries this job reads or accounts for."""
        return {e.stored or n for n, e in self.expected.items() if e.problem is None}


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


def unexpected_names(
    meta: CheckpointMetadata, wanted: set[str], namespaces: set[str], scoped: set[str] = frozenset()
) -> list[str]:
    """Stored names under ``namespaces`` that nobody wants (format-internal ``~`` entries excepted).

    A name under a wanted object entry is that object's array, unless a ``scoped`` prefix lies between them
    or is that entry itself.
    """

    def covered(n: str) -> bool:
        owners = [e for e in wanted if e in meta.objects and n.startswith(e + "/")]
        if not owners:
            return False
        inner = max(owners, key=len)
        return not any(n.startswith(p + "/") and (p == inner or p.startswith(inner + "/")) for p in scoped)

    return sorted(
        n
        for n in set(meta.tensors) | set(meta.objects)
        if n.split("/", 1)[0] in namespaces and n not in wanted and "~" not in n and not covered(n)
    )


def _kind_hints(missing: list[str], unexpected: list[str], meta: CheckpointMetadata) -> list[str]:
    """Why a name is missing while entries below it are unexpected (or the reverse): one side stores that
    name as one object (a dict holding a plain value among its tensors) and the other as separate entries,
    named by what the checkpoint stores there (tensors, plain values)."""
    hints = []
    for name in missing:
        below = [u for u in unexpected if u.startswith(name + "/")]
        if not below:
            continue
        tensors = [u for u in below if u in meta.tensors]
        start = (
            f"hint: {name} holds a plain (non-tensor) value in the target, so it is loaded as one object, "
        )
        if len(tensors) == len(below):
            hints.append(
                f"{start}but the checkpoint stores it as tensors ({_some(below)}): make the target's entries "
                "tensors too (strict=False would leave all of it unloaded)"
            )
            continue
        values = [u for u in below if u not in meta.tensors]
        stored = f"plain values ({_some(values)})" + (f" and tensors ({_some(tensors)})" if tensors else "")
        hints.append(
            f"{start}but the checkpoint stores its entries one by one, as {stored} (as DCP saves a dict): load "
            "them into a dict (an empty dict in the object's place comes back holding each entry) and hand them "
            "to the object yourself (strict=False would leave all of it unloaded)"
        )
    for name in unexpected:
        below = [m for m in missing if m.startswith(name + "/")]
        if below and name in meta.objects:
            hints.append(
                f"hint: the checkpoint stores {name} as one object (it held a plain value among its tensors when "
                f"saved), but the target holds its entries as tensors ({_some(below)}): load it into the same kind "
                "of values"
            )
    return hints


def _some(names: list[str]) -> str:
    """Up to five of ``names``, comma-separated, ``...`` when there are more."""
    return ", ".join(names[:5]) + (" ..." if len(names) > 5 else "")


def check_expected(meta: CheckpointMetadata, job: LoadJob, options: AdapterOptions) -> dict[str, list[str]]:
    """Compare what the target expects with what is stored.

    Returns a report ``{"missing": [...], "unexpected": [...], "mismatched": [...], "skipped": [...]}``. With
    ``strict`` any missing, unexpected or mismatched entry raises :class:`StateMismatchError` listing every
    offending name; without it, the targets of missing or mismatched names are dropped (the intersection
    loads), and so are the entries that depend on them (``skipped``: e.g. the optimizer state of a parameter
    whose shape changed).
    """
    stored = set(meta.tensors) | set(meta.objects)
    missing = sorted(
        n
        for n, e in job.expected.items()
        if e.problem is None and (e.stored or n) not in stored and n not in job.optional
    )
    mismatched = []
    bad = set(missing)
    for name, exp in job.expected.items():
        source = exp.stored or name
        where = name if source == name else f"{name} (stored as {source})"
        tm = meta.tensors.get(source)
        if exp.problem is not None:
            problem = exp.problem
        elif tm is None or exp.shape is None:
            continue
        elif tuple(exp.shape) != tm.shape:
            problem = f"checkpoint shape {list(tm.shape)} != target shape {list(exp.shape)}"
        elif exp.dtype is not None and exp.dtype != tm.dtype and not options.allow_cast:
            problem = (
                f"checkpoint dtype {tm.dtype} != target dtype {exp.dtype} (pass allow_cast=True to convert)"
            )
        else:
            continue
        mismatched.append(f"{where}: {problem}")
        bad.add(name)
    unexpected = unexpected_names(meta, job.stored_names(), job.namespaces, job.scoped)
    report = {"missing": missing, "unexpected": unexpected, "mismatched": mismatched}
    if options.strict and any(report.values()):
        lines = [
            f"{k} ({len(v)}): " + ", ".join(v[:50]) + (" ..." if len(v) > 50 else "")
            for k, v in report.items()
            if v
        ]
        raise StateMismatchError(
            "checkpoint does not match the load target:\n  "
            + "\n  ".join(lines + _kind_hints(missing, unexpected, meta))
            + "\n(pass strict=False to load the intersection)"
        )
    report["skipped"] = _skip_dependents(job.expected, bad)
    job.dropped |= bad
    dropped_reads = {id(r) for n in bad for r in job.expected[n].reads}
    # entries of adapters that do not list their reads are dropped by stored name
    bad_stored = {job.expected[n].stored or n for n in bad if not job.expected[n].reads}
    job.targets[:] = [
        t
        for t in job.targets
        if id(t) not in dropped_reads and t.name not in bad_stored and t.name in meta.tensors
    ]
    return report


def _skip_dependents(expected: dict[str, Expected], bad: set[str]) -> list[str]:
    """Add to ``bad`` every entry whose ``requires`` or ``group`` is bad; return those added."""
    skipped: list[str] = []
    while True:
        groups = {expected[n].group for n in bad if expected[n].group is not None}
        more = [
            n
            for n, e in expected.items()
            if n not in bad and (e.requires in bad or (e.group is not None and e.group in groups))
        ]
        if not more:
            return sorted(skipped)
        bad.update(more)
        skipped.extend(more)
