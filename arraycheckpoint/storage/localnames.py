"""The names a save on a POSIX file system creates beside its target ``<dir>/<name>``, and how cleanup tells them.

Training frameworks find their checkpoints by a pattern searched in every entry of the checkpoint folder:
torchtitan's ``_find_load_step`` and ``_purge_stale_checkpoints`` (``re.search(r"step-(\\d+)")``), the HF
Trainer's ``get_last_checkpoint`` (``checkpoint-\\d+``), accelerate's ``checkpoint_\\d+``. A name of ours that
carried the target's name (``.step-3.acp-staging-<token>``, holding DCP's ``.metadata`` before the commit) was
taken for step 3 after a crash (torchtitan then fails every restart: ``step-3`` not found), and a save in flight
counted as a step by a retention purge (an older, complete step deleted early). So no name of ours holds the
target's name; each is a fixed prefix and hexadecimal digits or a save token:

* ``.acp-lock-<h>``: the save lock of ``<name>`` (``<h>``: 16 hex digits of the SHA-256 of ``<name>``), and
  ``.acp-lock-<h>.takeover`` while a crashed save's lock is taken over (:mod:`.locks`);
* ``.acp-staging-<token>/``: the save's staging directory, renamed onto ``<dir>/<name>`` at the commit;
* ``.acp-old-<token>/<name>``: the checkpoint an ``overwrite=True`` commit replaces, moved into a holder named
  after the save (the entry inside says where it goes back if the save crashes between its renames);
* ``.acp-trash-<hex>/``: a checkpoint being deleted by retention (renamed first).

Versions before session 23 named them after the target (``.<name>.acp-lock``, ``.<name>.acp-staging-<token>``,
``<name>.acp-old-<...>``, ``.<name>.acp-trash-<...>``): :func:`classify` still knows them, so their leftovers
are cleaned up, and a save refuses a target whose old-style lock a live save (of an older version) holds.
"""

from __future__ import annotations

import hashlib
import os
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from ..errors import UnsafeNameError
from ..format.metadata import CONTROL_LAYOUTS
from . import locks

LOCK = ".acp-lock-"
STAGING = ".acp-staging-"
OLD = ".acp-old-"
TRASH = ".acp-trash-"

_NAMES = re.compile(
    r"^(?:\.acp-(?P<kind>staging|trash)-(?P<token>.+)|\.acp-lock-[0-9a-f]{16}|\.acp-old-(?P<holder>.+)"
    # the names of older versions, after their target
    r"|\.(?P<a>.+)\.acp-(?:staging|trash)-.+|\.(?P<b>.+)\.acp-lock|(?P<c>.+)\.acp-old-.+)\Z",
    re.DOTALL,
)


@dataclass(frozen=True)
class Leftover:
    """What a name in a target's directory is to a save: ``kind`` is "lock", "staging", "trash" or "old" (a
    replaced copy: its holder, or an older version's copy named ``<step>.acp-old-...``); ``token`` is the save's
    (a staging directory's or a holder's); ``step`` is the target's name where the name says it (an older
    version's replaced copy)."""

    kind: str
    token: str | None
    step: str | None = None


def _digest(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogateescape")).hexdigest()[:16]


def lock_path(final: str | Path) -> Path:
    """The save lock file of the target ``final``: ``<dir>/.acp-lock-<h>``."""
    p = Path(final)
    return p.parent / f"{LOCK}{_digest(p.name)}"


def legacy_lock_path(final: str | Path) -> Path:
    """The lock file an older version takes for ``final`` (``<dir>/.<name>.acp-lock``)."""
    p = Path(final)
    return p.parent / f".{p.name}.acp-lock"


def staging_path(final: str, token: str) -> str:
    """The staging directory of the save ``token`` to ``final``: ``<dir>/.acp-staging-<token>``."""
    return os.path.join(os.path.dirname(final), STAGING + token)


def old_holder(final: str, token: str | None) -> str:
    """The directory an overwrite commit of the save ``token`` moves the replaced ``final`` into (as
    ``<holder>/<name>``)."""
    return os.path.join(os.path.dirname(final), OLD + (token or uuid.uuid4().hex[:12]))


def trash_path(final: str) -> str:
    """A fresh name to rename ``final`` to before deleting it (retention)."""
    return os.path.join(os.path.dirname(final), TRASH + uuid.uuid4().hex[:12])


def staging_token(name: str) -> str | None:
    """The save token in a staging directory's name (``.acp-staging-<token>``, or an older version's
    ``.<step>.acp-staging-<token>``, also inside its replaced copy's ``<step>.acp-old-.<step>.acp-staging-<token>``);
    None for other names."""
    return name.split(STAGING, 1)[1] if STAGING in name else None


def classify(name: str) -> Leftover | None:
    """What the entry ``name`` of a target's directory is of a save's (this version's or an older one's), or
    None when it is none of ours."""
    m = _NAMES.match(name)
    if m is None:
        return None
    if m.group("kind"):
        return Leftover(m.group("kind"), m.group("token"))
    if m.group("holder"):
        return Leftover("old", m.group("holder"))
    if m.group("a"):
        return Leftover("staging" if ".acp-staging-" in name else "trash", staging_token(name))
    if m.group("c"):
        return Leftover("old", staging_token(name), m.group("c"))
    return Leftover("lock", None)


def refuse_ours(final: str) -> None:
    """Refuse ``final`` as a save's target when its name is one of ours (:func:`classify`): cleanup would take
    the checkpoint saved there for a crashed save's leftover, and delete it or put it back elsewhere.

    Raises:
        UnsafeNameError: naming the path and the names that are reserved.
    """
    if classify(os.path.basename(final.rstrip("/"))) is not None:
        raise UnsafeNameError(
            f"cannot save to {final}: its name is one arraycheckpoint gives to a save's lock, staging or replaced "
            f"copies ({LOCK}*, {STAGING}*, {OLD}*, {TRASH}*, and an older version's .<name>.acp-lock, "
            ".<name>.acp-staging-*, <name>.acp-old-*), which a manager's cleanup removes as a crashed save's "
            "leftover: choose another name"
        )


def live_tokens(parent: str, names: list[str]) -> dict[str, str]:
    """The tokens of the saves in flight under ``parent`` (a lock file not judged crashed: :mod:`.locks`, or
    that this process may not open), mapped to their lock file's name: their staging and replaced copies
    stay."""
    live = {}
    for name in names:
        found = classify(name)
        if found is None or found.kind != "lock":
            continue
        path = os.path.join(parent, name)
        if not locks.is_live(path):
            continue  # a crashed save's: its lock and staging are leftovers
        fd = locks.open_lock(path)
        raw = b""
        if fd is not None:
            try:
                raw = locks.read_lock(fd)
            except OSError:
                pass
            finally:
                os.close(fd)
        live[locks.token_of(raw)] = name
    return live


def in_flight(found: Leftover, name: str, live: dict[str, str], parent: str = "") -> bool:
    """Whether the leftover ``name`` of ``parent`` (``found``) belongs to a save in flight (``live``:
    :func:`live_tokens`): its lock, its staging, a copy it replaced, or any replaced copy (in a holder
    ``.acp-old-<token>/<step>``, or an older version's ``<step>.acp-old-...``) of a step a live save targets:
    that save may be between its two renames, the step absent, and a copy put back there would make its
    second rename fail."""
    if name in live.values() or (found.token is not None and found.token in live):
        return True
    if found.kind != "old":
        return False
    held = set(live.values())
    steps = [os.path.basename(final) for _path, final in replaced_copies(parent, name)]
    return any({legacy_lock_path(step).name, lock_path(step).name} & held for step in steps)


def step_locked(final: str) -> bool:
    """Whether a save in flight (this version's or an older one's) holds the lock of the target ``final``."""
    return any(
        os.path.isfile(p) and not os.path.islink(p) and locks.is_live(str(p))
        for p in (lock_path(final), legacy_lock_path(final))
    )


def replaced_copies(parent: str, name: str) -> list[tuple[str, str]]:
    """The replaced copies the entry ``name`` holds, each ``(its path, where it goes back)``: an older
    version's ``<step>.acp-old-...`` itself, or what a holder ``.acp-old-<token>/`` holds; none for other
    names."""
    found = classify(name)
    if found is None or found.kind != "old":
        return []
    path = os.path.join(parent, name)
    if found.step is not None:
        return [(path, os.path.join(parent, found.step))]
    try:
        inside = sorted(os.listdir(path)) if os.path.isdir(path) and not os.path.islink(path) else []
    except OSError:
        inside = []
    return [(os.path.join(path, entry), os.path.join(parent, entry)) for entry in inside]


def replaced_time(parent: str, name: str) -> int:
    """When the newest replaced copy in ``name`` was committed (its marker's mtime, ns); 0 for anything
    else or an uncommitted copy."""
    return max((committed_time(path) for path, _final in replaced_copies(parent, name)), default=0)


def committed_time(path: str) -> int:
    """When the checkpoint at ``path`` was committed (its marker's mtime, ns); 0 when it is none."""
    for files in CONTROL_LAYOUTS:
        try:
            return os.stat(os.path.join(path, files.committed)).st_mtime_ns
        except OSError:
            continue
    return 0
